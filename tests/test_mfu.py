"""MFUMonitor: FLOP counting, HFU vs MFU, exact rates from a fake clock, peak table, bad input."""

from __future__ import annotations

import contextlib
import csv
import math
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode

from lightning_shard import MFUMonitor
from lightning_shard._batch import batch_shape
from lightning_shard.callbacks import mfu as mfu_module
from lightning_shard.callbacks._flops import CPU_ATTENTION_FLOPS, StepFlopCounter
from lightning_shard.callbacks._peaks import (
    PEAK_FLOPS,
    compute_dtype,
    match_device,
    probe_cpu_peak,
    table_peak,
)
from lightning_shard.callbacks.throughput import ThroughputMonitorFlops, feed_throughput_monitor
from lightning_shard.demos import GPT, GPTModule
from tests.helpers import MemoryLogger

SEQ, D, LAYERS, HEADS, VOCAB, BATCH = 32, 32, 2, 2, 256, 4


class FakeClock:
    """Time that moves only when the test moves it, so every rate has an exact expected value."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class ClockedTokens(Dataset):
    """Fixed token windows; fetching one sample costs ``fetch_s`` fake seconds."""

    def __init__(self, clock: FakeClock, fetch_s: float, n: int = 64) -> None:
        self.clock, self.fetch_s = clock, fetch_s
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.clock.t += self.fetch_s
        return self.data[i, :-1], self.data[i, 1:]


class ClockedGPT(GPTModule):
    """Each training step costs ``step_s`` fake seconds of compute."""

    def __init__(self, clock: FakeClock | None = None, step_s: float = 0.0, **kwargs) -> None:
        super().__init__(vocab_size=VOCAB, seq_len=SEQ, d_model=D, n_layers=LAYERS, n_heads=HEADS, **kwargs)
        self.clock, self.step_s = clock, step_s

    def training_step(self, batch, batch_idx):
        if self.clock is not None:
            self.clock.t += self.step_s
        return super().training_step(batch, batch_idx)


class CheckpointedGPT(GPT):
    """Test-only: every block recomputed in backward (full activation checkpointing)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))


def fit(
    module: L.LightningModule, loader: DataLoader, callbacks: list, max_steps: int, **trainer_kwargs
) -> L.Trainer:
    trainer_kwargs.setdefault("logger", False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, loader)
    return trainer


def loader(clock: FakeClock | None = None, fetch_s: float = 0.0) -> DataLoader:
    return DataLoader(
        ClockedTokens(clock or FakeClock(), fetch_s), batch_size=BATCH, shuffle=False, drop_last=True
    )


def analytic_model_flops(tokens: int) -> int:
    """6·N·tokens + 12·L·T·d·tokens: N counts the matmul weights, the tied head included."""
    n_matmul = LAYERS * 12 * D * D + D * VOCAB
    return 6 * n_matmul * tokens + 12 * LAYERS * SEQ * D * tokens


def count_step(model: nn.Module, idx: torch.Tensor) -> StepFlopCounter:
    with StepFlopCounter() as counter:
        model(idx).float().sum().backward()
    model.zero_grad(set_to_none=True)
    return counter


# --- FLOP counting ---------------------------------------------------------------------------------


def test_auto_flops_equal_analytic_and_flop_counter_mode():
    torch.manual_seed(0)
    module = ClockedGPT()
    monitor = MFUMonitor(peak_flops=1e12, log_every_n_steps=1)
    fit(module, loader(), [monitor], max_steps=2)
    tokens = BATCH * SEQ
    # Model FLOPs are the textbook formula: 6N per token plus the attention term.
    assert monitor.counted["model_flops"] == pytest.approx(analytic_model_flops(tokens), rel=0.02)
    assert monitor.counted["model_flops"] == analytic_model_flops(tokens)
    # Hardware FLOPs are exactly what FlopCounterMode counts for one forward+backward of the same batch
    # (the CPU flash-attention formulas added; stock torch counts CPU attention as 0).
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as reference:
        module.model(idx).sum().backward()
    assert monitor.counted["hardware_flops"] == reference.get_total_flops()
    assert monitor.counted["units"] == tokens


@pytest.mark.parametrize("peak_flops", [1e12, None], ids=["given_peak", "cpu_probe"])
def test_auto_counting_leaves_training_untouched(peak_flops: float | None):
    """Counting rides on the real first step, and the CPU probe draws from its own generator: same losses
    and parameters with or without the monitor (dropout on), no mode or hook left behind."""
    from torch.nn.modules import module as nn_module

    def train(callbacks: list) -> tuple[list[float], dict[str, torch.Tensor]]:
        L.seed_everything(0, verbose=False)
        module = ClockedGPT(dropout=0.1)
        losses = StepLosses()
        fit(module, loader(), [losses, *callbacks], max_steps=3)
        return losses.losses, {k: v.clone() for k, v in module.state_dict().items()}

    hooks = [nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks]
    hooks_before = [dict(h) for h in hooks]
    with_monitor = train([MFUMonitor(peak_flops=peak_flops, log_every_n_steps=1)])
    without = train([])
    assert with_monitor[0] == without[0] and len(without[0]) == 3
    assert all(torch.equal(with_monitor[1][k], without[1][k]) for k in without[1])
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    assert [dict(h) for h in hooks] == hooks_before  # the counter's module tracker took its hooks away


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def test_cpu_probe_leaves_the_random_stream_alone():
    state = torch.get_rng_state()
    probe_cpu_peak("fp32", size=16, budget_s=0.0)
    assert torch.equal(torch.get_rng_state(), state)


def test_counter_leaves_no_dispatch_mode_after_an_exception():
    class Boom(ClockedGPT):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fit(Boom(), loader(), [MFUMonitor(peak_flops=1e12)], max_steps=2)
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None


def test_hfu_exceeds_mfu_by_the_recompute():
    torch.manual_seed(0)
    plain, ckpt = GPT(VOCAB, SEQ, D, LAYERS, HEADS), CheckpointedGPT(VOCAB, SEQ, D, LAYERS, HEADS)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    plain_count, ckpt_count = count_step(plain, idx), count_step(ckpt, idx)
    tokens = BATCH * SEQ
    blocks_forward = plain_count.by_phase["forward"] - 2 * tokens * D * VOCAB  # all but the head
    # Non-reentrant checkpointing stops recomputing once backward has what it needs: the last MLP
    # matmul's output is never needed, so it is not re-run, and the count shows it.
    not_rerun = LAYERS * 2 * tokens * 4 * D * D
    assert ckpt_count.model_flops == plain_count.model_flops  # recompute is not model work
    recompute = ckpt_count.by_phase["recompute"] - plain_count.by_phase["recompute"]
    assert recompute == blocks_forward - not_rerun

    clock = FakeClock()
    module = ClockedGPT(clock, step_s=0.5)
    module.model = ckpt
    monitor = MFUMonitor(peak_flops=1e12, log_every_n_steps=3, window=2)
    monitor._clock = clock
    fit(module, loader(clock), [monitor], max_steps=3)
    assert monitor.counted["hardware_flops"] == ckpt_count.hardware_flops
    ratio = ckpt_count.hardware_flops / ckpt_count.model_flops
    assert monitor.metrics["perf/hfu"] > monitor.metrics["perf/mfu"]
    assert monitor.metrics["perf/hfu"] / monitor.metrics["perf/mfu"] == pytest.approx(ratio, rel=1e-12)


def test_grouped_query_attention_is_counted_as_executed():
    """K/V projections to fewer heads are smaller matmuls; the count follows the shapes that ran."""
    b, t, d, heads, kv_heads = 2, 16, 32, 4, 1
    d_kv = d // heads * kv_heads

    class GQA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d_kv), nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x).view(b, t, heads, -1).transpose(1, 2)
            k, v = (z.view(b, t, kv_heads, -1).transpose(1, 2) for z in self.kv(x).split(d_kv, dim=-1))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.o(y.transpose(1, 2).reshape(b, t, d))

    counter = count_step(GQA(), torch.randn(b, t, d, requires_grad=True))
    tokens = b * t
    projections = 2 * tokens * (d * d + d * 2 * d_kv + d * d)
    attention = 4 * t * d * tokens  # QK^T and AV over all query heads
    assert counter.model_flops == 3 * (projections + attention)


def test_tensor_subclass_ops_are_counted_at_local_size():
    """A wrapper subclass (here TwoTensor, two inner tensors) is counted at the work it really does;
    DTensor takes the same path, so a tensor-parallel rank counts its shard (see the 2-rank test)."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, w = TwoTensor(torch.randn(4, 8), torch.randn(4, 8)), torch.randn(8, 8)
    with FlopCounterMode(display=False) as plain:
        a @ w
    with StepFlopCounter() as local:
        a @ w
    assert local.model_flops == 2 * plain.get_total_flops() == 2 * (2 * 4 * 8 * 8)


def test_batch_shape():
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert batch_shape((ids, ids)) == (4, 64)
    assert batch_shape({"labels": ids[:, :1], "input_ids": ids}) == (4, 64)
    assert batch_shape([torch.randn(8, 3, 32, 32), torch.zeros(8)]) == (8, None)
    assert batch_shape("no tensors") == (1, None)


# --- rates from a fake clock, logging --------------------------------------------------------------


def test_rates_from_fake_clock_are_exact_and_logged_to_csv(tmp_path: Path):
    clock = FakeClock()
    module = ClockedGPT(clock, step_s=0.25)
    # 4 samples x 0.0625 s per fetch = 0.25 s waiting, + 0.25 s step = 0.5 s per batch.
    monitor = MFUMonitor(peak_flops=1e9, window=3, log_every_n_steps=2)
    monitor._clock = clock
    logger = CSVLogger(tmp_path, name="run", version=0)
    rss = PeakRss()  # after the monitor: reads the kernel's figure right after the monitor's last log
    fit(
        module, loader(clock, fetch_s=0.0625), [monitor, rss], max_steps=6, logger=logger, log_every_n_steps=2
    )

    model_flops = monitor.counted["model_flops"]
    expected = {
        "perf/step_time_s": 0.5,
        "perf/samples_per_sec": BATCH / 0.5,
        "perf/tokens_per_sec": BATCH * SEQ / 0.5,
        "perf/tokens_per_sec_per_device": BATCH * SEQ / 0.5,
        "perf/tflops_per_device": model_flops / 0.5 / 1e12,
        "perf/mfu": model_flops / 0.5 / 1e9,
        "perf/hfu": monitor.counted["hardware_flops"] / 0.5 / 1e9,
        "perf/dataloader_wait_frac": 0.5,
        "perf/peak_tflops_per_device": 1e-3,
    }
    assert set(monitor.metrics) == {*expected, "perf/peak_memory_gb"}
    for key, value in expected.items():
        assert monitor.metrics[key] == pytest.approx(value, rel=1e-12), key
    # On CPU: the process's peak resident set in GB (1e9 bytes), as the kernel reports it.
    assert monitor.metrics["perf/peak_memory_gb"] == pytest.approx(rss.bytes / 1e9, rel=1e-3)

    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("perf/mfu")]
    assert [int(r["step"]) for r in logged] == [2, 4, 6]
    assert set(expected) <= set(rows[0])
    assert float(logged[-1]["perf/samples_per_sec"]) == pytest.approx(BATCH / 0.5)


class PeakRss(L.Callback):
    """The kernel's peak resident set of this process (Linux ``VmHWM``) at the end of every batch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        self.bytes = int(line.split()[1]) * 1024  # kB


def test_int_flops_per_batch_and_tokens_fn():
    clock = FakeClock()
    monitor = MFUMonitor(
        flops_per_batch=10**9, peak_flops=4e9, tokens_fn=lambda batch: 10, log_every_n_steps=2
    )
    monitor._clock = clock
    fit(ClockedGPT(clock, step_s=0.5), loader(clock), [monitor], max_steps=4)
    assert monitor.counted is None  # nothing counted: the user gave the FLOPs
    assert monitor.metrics["perf/tflops_per_device"] == pytest.approx(2e-3, rel=1e-12)
    assert monitor.metrics["perf/mfu"] == pytest.approx(0.5, rel=1e-12)
    assert monitor.metrics["perf/tokens_per_sec"] == pytest.approx(20.0, rel=1e-12)
    assert "perf/hfu" not in monitor.metrics  # hardware FLOPs are only known when counted


def test_unknown_device_warns_once_and_logs_no_mfu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(
        mfu_module, "_device_peak", lambda device, dtype: (None, "device 'Tesla K80' in fp32")
    )
    clock = FakeClock()
    monitor = MFUMonitor(log_every_n_steps=2)
    monitor._clock = clock
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(ClockedGPT(clock, step_s=0.5), loader(clock), [monitor], max_steps=4)
    ours = [w for w in caught if "no peak FLOP/s known" in str(w.message)]
    assert len(ours) == 1 and "peak_flops" in str(ours[0].message)
    assert "perf/mfu" not in monitor.metrics and "perf/hfu" not in monitor.metrics
    assert monitor.metrics["perf/samples_per_sec"] == pytest.approx(BATCH / 0.5)


@pytest.mark.parametrize(
    ("dtype", "torch_dtype"),
    [
        ("fp32", torch.float32),
        ("tf32", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
        ("fp64", torch.float64),
        ("fp8", torch.bfloat16),  # no CPU fp8 matmul: probed as bf16
    ],
)
def test_cpu_probe_is_the_fastest_burst_of_matmuls_in_the_run_dtype(monkeypatch, dtype, torch_dtype):
    """A fake clock that only matmuls move: a warm-up (not timed), then bursts of 4 matmuls at 0.5, 0.25
    and 1.0 s each; the budget ends during the third burst. The peak is the fastest burst's rate."""
    from lightning_shard.callbacks import _peaks

    clock, seconds_per_mm, seen = FakeClock(), iter([1.0] + [0.5] * 4 + [0.25] * 4 + [1.0] * 4), []
    real_mm = torch.mm

    def timed_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append((a.dtype, b.dtype, tuple(a.shape), tuple(b.shape)))
        clock.t += next(seconds_per_mm)
        return real_mm(a, b)

    monkeypatch.setattr(_peaks, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(torch, "mm", timed_mm)
    size = 8
    peak = probe_cpu_peak(dtype, size=size, budget_s=4.5)
    assert seen == [(torch_dtype, torch_dtype, (size, size), (size, size))] * 13  # warm-up + 3 bursts
    assert peak == 4 * 2 * size**3 / (4 * 0.25)  # 4 matmuls of 2·n³ FLOPs in the fastest burst's 1 s


def test_cpu_device_peak_is_the_probe_in_the_run_dtype(monkeypatch):
    monkeypatch.setattr(mfu_module, "probe_cpu_peak", lambda dtype: {"bf16": 3e11, "fp32": 1e11}[dtype])
    assert mfu_module._device_peak(torch.device("cpu"), "bf16") == (3e11, "cpu in bf16 (matmul probe)")
    assert mfu_module._device_peak(torch.device("cpu"), "fp32") == (1e11, "cpu in fp32 (matmul probe)")
    assert mfu_module._device_peak(torch.device("meta"), "fp32") == (None, "device type 'meta' in fp32")


# --- peak table --------------------------------------------------------------------------------------

NAMES = [
    ("NVIDIA H100 80GB HBM3", "h100 sxm"),
    ("NVIDIA H100 SXM5 80GB", "h100 sxm"),
    ("NVIDIA H100", "h100 sxm"),
    ("NVIDIA H100 PCIe", "h100 pcie"),
    ("NVIDIA H100 80GB HBM2e", "h100 pcie"),
    ("NVIDIA H100 NVL", "h100 nvl"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA H200 NVL", "h200 nvl"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GB200", "gb200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-PCIE-40GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA L40", "l40"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA A10", "a10"),
    ("NVIDIA GeForce RTX 4090", "rtx 4090"),
    ("nvidia_h200", "h200"),
    ("NVIDIA A40", None),
    ("NVIDIA GeForce RTX 4090 D", None),
    ("NVIDIA RTX 4000 Ada Generation", None),
    ("Tesla K80", None),
    ("cpu", None),
]


@pytest.mark.parametrize(("name", "key"), NAMES)
def test_device_name_matching(name: str, key: str | None):
    assert match_device(name) == key


def test_every_entry_has_the_dtypes_of_its_generation():
    for key, peaks in PEAK_FLOPS.items():
        assert {"fp32", "tf32", "bf16", "fp16"} <= set(peaks), key
        assert all(v > 1e12 for v in peaks.values()), key
        if key not in ("a100", "a10", "a10g"):  # Ampere has no fp8 tensor cores
            assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=0.02), key


def test_peak_follows_the_run_precision(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    assert mfu_module._device_peak(cuda, "bf16")[0] == pytest.approx(989.4e12)
    assert mfu_module._device_peak(cuda, "fp8")[0] == pytest.approx(1978.9e12)
    assert table_peak("NVIDIA A100-SXM4-80GB", "fp8") is None  # never a wrong number


def test_names_lightning_misses(monkeypatch: pytest.MonkeyPatch):
    """Lightning's table has no fp8 and misreads these names; ours has a dense bf16 peak for each."""
    throughput = pytest.importorskip("lightning.fabric.utilities.throughput")
    lightning_bf16 = {}
    for name in ("NVIDIA H200", "NVIDIA B200", "NVIDIA GB200", "NVIDIA L40S"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lightning_bf16[name] = throughput.get_available_flops(torch.device("cuda"), torch.bfloat16)
    assert lightning_bf16["NVIDIA H200"] is None
    assert lightning_bf16["NVIDIA B200"] is None and lightning_bf16["NVIDIA GB200"] is None
    assert lightning_bf16["NVIDIA L40S"] == 121e12  # the L4's number
    assert table_peak("NVIDIA H200", "bf16") == pytest.approx(989.4e12)
    assert table_peak("NVIDIA B200", "bf16") == pytest.approx(2250e12)
    assert table_peak("NVIDIA GB200", "fp8") == pytest.approx(5000e12)
    assert table_peak("NVIDIA L40S", "bf16") == pytest.approx(362e12)


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("bf16-mixed", "bf16"),
        ("bf16-true", "bf16"),
        ("16-mixed", "fp16"),
        ("32-true", "fp32"),
        ("64-true", "fp64"),
        ("transformer-engine", "fp8"),
        ("transformer-engine-float16", "fp8"),
    ],
)
def test_compute_dtype(precision: str, expected: str):
    assert compute_dtype(precision, nn.Linear(2, 2), torch.device("cpu")) == expected


@contextlib.contextmanager
def tf32_on(switch: str) -> Iterator[None]:
    """TF32 turned on through one of torch's switches, then off again through the same switch.

    Process-wide state, so it is restored by hand: the attributes of ``torch.backends.cuda.matmul``
    live in C++, which ``monkeypatch`` cannot undo (pytest >= 9.2 tries ``delattr`` and fails), and
    restoring through another switch than the one used leaves torch refusing to read the legacy flag
    ("mix of the legacy and new APIs").
    """
    matmul = torch.backends.cuda.matmul
    undo: list[Callable[[], None]] = []

    def set_(obj: Any, name: str, value: str | bool) -> None:
        old = getattr(obj, name)
        setattr(obj, name, value)
        undo.append(lambda: setattr(obj, name, old))

    if switch == "allow_tf32":
        set_(matmul, "allow_tf32", True)
    elif switch == "set_float32_matmul_precision":
        old = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        undo.append(lambda: torch.set_float32_matmul_precision(old))
    elif switch == "matmul.fp32_precision":
        set_(matmul, "fp32_precision", "tf32")
    else:  # "backends.fp32_precision": the global default, which a backend set to "none" inherits
        set_(matmul, "fp32_precision", "none")
        set_(torch.backends, "fp32_precision", "tf32")
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


@pytest.mark.parametrize(
    "switch",
    ["allow_tf32", "set_float32_matmul_precision", "matmul.fp32_precision", "backends.fp32_precision"],
)
def test_compute_dtype_is_tf32_exactly_when_cuda_fp32_matmuls_may_use_it(switch: str):
    cuda, linear, matmul = torch.device("cuda"), nn.Linear(2, 2), torch.backends.cuda.matmul
    assert compute_dtype("32-true", linear, cuda) == "fp32"
    with tf32_on(switch):
        assert compute_dtype("32-true", linear, cuda) == "tf32"
        assert compute_dtype("32-true", linear, torch.device("cpu")) == "fp32"  # a cuBLAS mode only
        assert compute_dtype("bf16-mixed", linear, cuda) == "bf16"  # TF32 concerns fp32 matmuls only
        assert table_peak("NVIDIA H100", compute_dtype("32-true", linear, cuda)) == pytest.approx(494.7e12)
    assert compute_dtype("32-true", linear, cuda) == "fp32"
    # Left as found: every switch reads back the default, the legacy ones included.
    assert (matmul.allow_tf32, torch.get_float32_matmul_precision()) == (False, "highest")


def test_compute_dtype_float8_modules():
    class Float8Linear(nn.Linear):  # torchao's float8 training swaps nn.Linear for a class of this name
        pass

    assert compute_dtype("bf16-mixed", nn.Sequential(Float8Linear(2, 2)), torch.device("cuda")) == "fp8"
    assert compute_dtype("bf16-mixed", nn.Sequential(nn.Linear(2, 2)), torch.device("cuda")) == "bf16"


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "989e12"])
def test_bad_peak_flops(value):
    with pytest.raises(ValueError, match=r"MFUMonitor\(peak_flops=.*\) must be a positive finite number"):
        MFUMonitor(peak_flops=value)


@pytest.mark.parametrize("value", ["fast", 0, -5, True, 1.5])
def test_bad_flops_per_batch(value):
    with pytest.raises(ValueError, match=r"MFUMonitor\(flops_per_batch=.*\) must be 'auto'"):
        MFUMonitor(flops_per_batch=value)


@pytest.mark.parametrize("flag", ["window", "log_every_n_steps"])
@pytest.mark.parametrize("value", [0, -3, 2.0])
def test_bad_counts(flag: str, value):
    with pytest.raises(
        ValueError, match=rf"MFUMonitor\({flag}={value!r}\) must be an int >= 1.*Use e.g. {flag}="
    ):
        MFUMonitor(**{flag: value})


def test_bad_tokens_fn():
    with pytest.raises(ValueError, match=r"MFUMonitor\(tokens_fn=3\) must be a callable"):
        MFUMonitor(tokens_fn=3)


def test_docs_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    text = (Path(__file__).resolve().parents[1] / "docs" / "monitoring.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/monitoring.md", "exec"), {})
    with open(tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("perf/mfu") for r in rows) and any(r.get("straggler/rank0_ms") for r in rows)


def test_callbacks_package_exports_the_monitors_and_imports_no_engine():
    import ast

    import lightning_shard
    import lightning_shard.callbacks as callbacks

    assert {"MFUMonitor", "StragglerDetector", "ThroughputMonitorFlops", "feed_throughput_monitor"} <= set(
        callbacks.__all__
    )
    assert callbacks.ThroughputMonitorFlops is ThroughputMonitorFlops
    assert lightning_shard.MFUMonitor is callbacks.MFUMonitor is MFUMonitor
    assert lightning_shard.StragglerDetector is callbacks.StragglerDetector
    # Callbacks work with any strategy: they reach other ranks only through trainer.strategy, so no
    # callback module imports an engine, the strategy, DeepSpeed, or the package root (which loads the
    # strategy), not even lazily inside a function.
    forbidden = ("lightning_shard.engines", "lightning_shard.trainer.strategy", "deepspeed")
    for path in Path(callbacks.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                bad = name == "lightning_shard" or any(
                    name == f or name.startswith(f + ".") for f in forbidden
                )
                assert not bad, f"callbacks/{path.name} imports {name}"


# --- Lightning's ThroughputMonitor gets FLOPs and a peak -------------------------------------------


class SeenFlops(L.Callback):
    """``pl_module.flops_per_batch`` as Lightning's ThroughputMonitor reads it: at each batch end."""

    def __init__(self) -> None:
        self.train: list[Any] = []
        self.validation: list[Any] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(getattr(pl_module, "flops_per_batch", "missing"))

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        self.validation.append(getattr(pl_module, "flops_per_batch", "missing"))


class ValidatedGPT(ClockedGPT):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())


def throughput_fit(module: L.LightningModule, callbacks: list, **kwargs) -> tuple[MemoryLogger, SeenFlops]:
    logger, seen = MemoryLogger(), SeenFlops()
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[monitor, *callbacks, seen],
        logger=logger,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module, loader(), loader())
    return logger, seen


@pytest.mark.parametrize("accumulate", [1, 2])
def test_throughput_monitor_gets_counted_flops_and_the_cpu_peak(
    monkeypatch: pytest.MonkeyPatch, accumulate: int
):
    monkeypatch.setattr(mfu_module, "probe_cpu_peak", lambda dtype: 1e12)
    module, feed = ValidatedGPT(), ThroughputMonitorFlops()
    logger, seen = throughput_fit(
        module,
        [feed],
        max_steps=4 // accumulate,
        accumulate_grad_batches=accumulate,
        limit_val_batches=2,
        val_check_interval=2,
    )
    model_flops = analytic_model_flops(BATCH * SEQ)
    # Published before the first batch end where a step counted it; a first batch that only accumulates
    # is known from the next batch on.
    expected_first = model_flops if accumulate == 1 else None
    assert seen.train == [expected_first, model_flops, model_flops, model_flops]
    assert seen.validation and all(v == model_flops // 3 for v in seen.validation)  # forward only: 2N of 6N
    assert module.flops_per_batch is None  # no stale number after the fit
    mfu = [
        (m["train/device/mfu"], m["train/device/flops_per_sec"])
        for m in logger.metrics
        if "train/device/mfu" in m
    ]
    assert mfu and all(value == flops_per_sec / 1e12 for value, flops_per_sec in mfu)
    assert feed._first.counted["model_flops"] == model_flops


def test_throughput_monitor_flops_shared_with_mfu_monitor(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(mfu_module, "probe_cpu_peak", lambda dtype: 1e12)
    monitor, feed = MFUMonitor(), ThroughputMonitorFlops()
    _, seen = throughput_fit(ValidatedGPT(), [monitor, feed], max_steps=3)
    assert feed._first.counted is None  # the MFUMonitor's count of the same step is used, not repeated
    assert seen.train == [monitor.counted["model_flops"]] * 3


def test_throughput_monitor_flops_keeps_what_the_user_gave():
    module = ValidatedGPT()
    module.flops_per_batch = 777
    logger, seen = throughput_fit(module, [ThroughputMonitorFlops(peak_flops=1e9)], max_steps=3)
    assert seen.train == [777] * 3 and module.flops_per_batch == 777
    assert any(m.get("train/device/mfu") for m in logger.metrics)  # the peak was filled in, the FLOPs kept
    # A peak Lightning knows is kept too.
    monitor = ThroughputMonitor(batch_size_fn=len)
    monitor.available_flops = 5
    trainer = SimpleNamespace(callbacks=[monitor])
    ThroughputMonitorFlops(peak_flops=1e9).on_fit_start(trainer, ClockedGPT())  # type: ignore[arg-type]
    assert monitor.available_flops == 5


def test_feed_throughput_monitor_attaches_once_and_only_for_a_throughput_monitor():
    assert feed_throughput_monitor(SimpleNamespace(callbacks=[MFUMonitor()])) is None  # type: ignore[arg-type]
    trainer = SimpleNamespace(callbacks=[ThroughputMonitor(batch_size_fn=len)])
    feed = feed_throughput_monitor(trainer)  # type: ignore[arg-type]
    assert isinstance(feed, ThroughputMonitorFlops) and trainer.callbacks[-1] is feed
    assert feed_throughput_monitor(trainer) is feed and len(trainer.callbacks) == 2  # type: ignore[arg-type]
    own = ThroughputMonitorFlops()
    trainer = SimpleNamespace(callbacks=[ThroughputMonitor(batch_size_fn=len), own])
    assert feed_throughput_monitor(trainer) is own and len(trainer.callbacks) == 2  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -1.0, True, "fast"])
def test_bad_throughput_peak_flops(value):
    with pytest.raises(
        ValueError, match=r"ThroughputMonitorFlops\(peak_flops=.*\) must be a positive number"
    ):
        ThroughputMonitorFlops(peak_flops=value)


def test_docs_throughput_example_runs(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(mfu_module, "probe_cpu_peak", lambda dtype: 1e12)
    text = (Path(__file__).resolve().parents[1] / "docs" / "monitoring.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[1]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/monitoring.md", "exec"), namespace)
    monitor, seen = namespace["callbacks"][0], SeenFlops()
    fit(ClockedGPT(), loader(), [*namespace["callbacks"], seen], max_steps=3)
    # Lightning's default window (100 batches) is longer than this run: what it was given is checked.
    assert monitor.available_flops == 1e12
    assert seen.train == [analytic_model_flops(BATCH * SEQ)] * 3


def test_grouped_gemm_flops_equal_the_loop_of_matmuls_they_replace():
    # Expert parallelism's local experts run torch's grouped GEMM where it runs: its FLOPs are counted (torch's
    # registry lacks them), forward and backward, as the loop of matmuls over the same rows counts them.
    from lightning_shard.callbacks._flops import StepFlopCounter
    from lightning_shard.expert_parallel.grouped import grouped_linear, grouped_mm_runs

    rows = torch.randn(8, 16, requires_grad=True)
    weight = torch.randn(2, 32, 16, requires_grad=True)
    if not grouped_mm_runs(rows, weight):
        pytest.skip("torch's grouped GEMM does not run for this device and dtype here")
    counts = {}
    for mode in ("grouped_mm", "loop"):
        counter = StepFlopCounter()
        with counter:
            grouped_linear(rows, weight, [3, 5], mode=mode).sum().backward()
        counts[mode] = dict(counter.by_phase)
    assert (
        counts["grouped_mm"]
        == counts["loop"]
        == {"forward": 2 * 8 * 16 * 32, "backward": 4 * 8 * 16 * 32, "recompute": 0}
    )
