"""StragglerDetector: per-rank times from a fake clock, a slowed rank flagged on 2 real ranks, bad input."""

from __future__ import annotations

import socket
import time
import warnings

import lightning as L
import pytest
import torch

from lightning_shard import MFUMonitor, StragglerDetector
from lightning_shard.demos.ranks import run_ranks
from tests.test_mfu import BATCH, SEQ, ClockedGPT, FakeClock, fit, loader


def test_per_rank_time_from_fake_clock_is_exact():
    clock = FakeClock()
    detector = StragglerDetector(every_n_steps=3)
    detector._clock = clock
    # Per batch: fetching 4 samples x 0.0625 s, then 0.25 s of training_step before backward.
    fit(ClockedGPT(clock, step_s=0.25), loader(clock, fetch_s=0.0625), [detector], max_steps=6)
    assert detector.rank_ms == [pytest.approx(500.0, rel=1e-12)]
    assert detector.metrics == {
        "straggler/rank0_ms": pytest.approx(500.0, rel=1e-12),
        "straggler/median_ms": pytest.approx(500.0, rel=1e-12),
        "straggler/max_ratio": 1.0,
    }
    assert detector.stragglers == []
    assert detector._hosts == [socket.gethostname()[:64]]


@pytest.mark.parametrize("value", [1, 1.0, 0.5, -2, float("nan"), True])
def test_bad_threshold(value):
    with pytest.raises(ValueError, match=r"StragglerDetector\(threshold=.*\) must be a finite number > 1"):
        StragglerDetector(threshold=value)


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_bad_every_n_steps(value):
    with pytest.raises(
        ValueError,
        match=r"StragglerDetector\(every_n_steps=.*\) must be an int >= 1.*Use e.g. every_n_steps=50",
    ):
        StragglerDetector(every_n_steps=value)


# --- 2 ranks over gloo: one spawn, shared by the tests below ---------------------------------------

SLEEP_S = 0.15


class SlowRankGPT(ClockedGPT):
    """Rank ``slow_rank`` sleeps before its forward: its own compute is longer, the others only wait."""

    def __init__(self, slow_rank: int, sleep_s: float) -> None:
        super().__init__()
        self.slow_rank, self.sleep_s = slow_rank, sleep_s

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.slow_rank:
            time.sleep(self.sleep_s)
        return super().training_step(batch, batch_idx)


def tensor_parallel_count() -> tuple[int, int]:
    """A 2-way tensor-parallel MLP's step on this rank: (stock FlopCounterMode, StepFlopCounter) FLOPs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_shard.callbacks._flops import StepFlopCounter

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    parallelize_module(mlp, init_device_mesh("cpu", (2,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(8, 16)
    with FlopCounterMode(display=False) as stock:
        mlp(x).sum().backward()
    with StepFlopCounter() as local:
        mlp(x).sum().backward()
    return stock.get_total_flops(), local.model_flops


def two_rank_run(slow_rank: int, sleep_s: float) -> dict:
    """One rank: count a tensor-parallel step, then a 2-rank DDP fit with both monitors and a slowed rank.

    The fit reuses the process group the tensor-parallel part created (the torchrun environment is set).
    """
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tp_counts = tensor_parallel_count()
    L.seed_everything(0, verbose=False)
    detector = StragglerDetector(threshold=1.5, every_n_steps=4)
    monitor = MFUMonitor(log_every_n_steps=4, window=3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=8,
        callbacks=[monitor, detector],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SlowRankGPT(slow_rank, sleep_s), loader())
    return {
        "tp_counts": tp_counts,
        "stragglers": detector.stragglers,
        "rank_ms": detector.rank_ms,
        "warnings": [str(w.message) for w in caught if "StragglerDetector" in str(w.message)],
        "perf": monitor.metrics,
        "counted": monitor.counted,
        "peak": monitor.device_peak,
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(two_rank_run, 1, SLEEP_S)


@pytest.mark.multirank
def test_slowed_rank_and_only_it_is_flagged(two_ranks: list[dict]):
    for r in two_ranks:
        # Both ranks gathered the same per-rank times and flagged rank 1 at steps 4 and 8, and only it.
        assert [s["rank"] for s in r["stragglers"]] == [1, 1]
        assert all(s["host"] == socket.gethostname()[:64] and s["ratio"] > 1.5 for s in r["stragglers"])
        assert r["rank_ms"][1] - r["rank_ms"][0] == pytest.approx(1e3 * SLEEP_S, rel=0.5)
    assert two_ranks[0]["rank_ms"] == two_ranks[1]["rank_ms"]
    # Warnings come from rank zero only, naming the rank and its host.
    assert len(two_ranks[0]["warnings"]) == 2 and "rank 1 on host" in two_ranks[0]["warnings"][0]
    assert two_ranks[1]["warnings"] == []


@pytest.mark.multirank
def test_mfu_sums_per_rank_work_over_ranks(two_ranks: list[dict]):
    perf = two_ranks[0]["perf"]
    assert two_ranks[0]["counted"] == two_ranks[1]["counted"]  # each rank counted its own (equal) batch
    assert perf == two_ranks[1]["perf"]  # one all_gather: every rank computes the same metrics
    assert perf["perf/tokens_per_sec"] == pytest.approx(2 * perf["perf/tokens_per_sec_per_device"])
    step_s = perf["perf/step_time_s"]  # the ranks wait for each other every step: one step time
    expected = 2 * BATCH * SEQ / step_s  # two ranks' tokens per (synchronised) step
    assert perf["perf/tokens_per_sec"] == pytest.approx(expected, rel=0.1)
    # MFU = both ranks' model FLOPs per step / step time / both ranks' peaks (each probed its own).
    counted, peaks = two_ranks[0]["counted"], [r["peak"] for r in two_ranks]
    assert perf["perf/mfu"] == pytest.approx(2 * counted["model_flops"] / step_s / sum(peaks), rel=0.1)
    assert perf["perf/peak_tflops_per_device"] == pytest.approx(sum(peaks) / 2 / 1e12, rel=1e-12)
    # No recompute here but CPU flash attention's: HFU/MFU is exactly the counted ratio.
    ratio = counted["hardware_flops"] / counted["model_flops"]
    assert ratio > 1 and perf["perf/hfu"] / perf["perf/mfu"] == pytest.approx(ratio, rel=1e-9)


@pytest.mark.multirank
def test_tensor_parallel_ranks_count_their_shard(two_ranks: list[dict]):
    # Unsharded: forward 2*8*(16*64 + 64*16); backward: the weight grads of both layers and the input
    # grad of the second (x needs no grad).
    whole = 2 * 8 * (16 * 64 + 64 * 16) + 2 * 8 * (16 * 64 + 64 * 16) + 2 * 8 * 64 * 16
    (stock0, ours0), (stock1, ours1) = (r["tp_counts"] for r in two_ranks)
    assert stock0 == stock1 == whole  # stock counting sees DTensor's global shapes on every rank
    assert ours0 == ours1 == whole // 2  # ours counts each rank's shard: the ranks sum to the whole
