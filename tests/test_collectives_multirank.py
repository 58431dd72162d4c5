"""Collectives in user code before, between and after Trainer calls give the answers they give under
Lightning's DDPStrategy: the strategy keeps its process groups alive until the process exits."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_shard.demos.ranks import run_ranks
from tests.helpers import ENGINES, loader, shard_stages_then_ddp, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank

#: (engine, stages) -> the ShardStrategy configurations one job runs, each compared with DDPStrategy.
STAGES = {"fsdp": (0, 1, 2, 3), "deepspeed": (1, 2, 3)}


def _eval_gpt() -> Any:
    model = tiny_gpt()

    def evaluate(batch: Any, batch_idx: int) -> None:
        x, y = batch
        model.log("eval_loss", torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))

    model.validation_step = evaluate  # type: ignore[method-assign]
    model.test_step = evaluate  # type: ignore[method-assign]
    return model


#: Per rank: when it entered the user's barrier and when it left it (``time.monotonic()``: one clock for the
#: processes of one machine); not compared with DDPStrategy's.
TIMES = ("entered", "left")


def _wait_for(path: Path, at_most: float = 60.0) -> None:
    """Until another rank has written ``path``; past ``at_most`` seconds, on (a rank that never writes it fails
    the test through the collectives that follow, not through a hang)."""
    deadline = time.monotonic() + at_most
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.005)


def _collectives(strategy: Any, entering: Path) -> dict[str, Any]:
    """What a user script does with ``trainer.strategy`` around a Trainer call."""
    rank = strategy.global_rank
    local = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    if rank == 0:
        entering.touch()
    else:
        # Rank 1 enters the barrier after rank 0 has (and a little later): a barrier that does not wait
        # returns on rank 0 before rank 1 has entered it, whatever the ranks' skew after the Trainer call.
        _wait_for(entering)
        time.sleep(0.1)
    entered = time.monotonic()
    strategy.barrier("user")
    left = time.monotonic()
    return {
        "entered": entered,
        "left": left,
        "broadcast": strategy.broadcast(f"best-from-rank-{rank}"),
        "broadcast_obj": strategy.broadcast({"path": f"/ckpt/{rank}", "score": rank}, src=1),
        "sum": strategy.reduce(local.clone(), reduce_op="sum").tolist(),
        "mean": strategy.reduce(local.clone(), reduce_op="mean").tolist(),
        "gather": strategy.all_gather(local.clone()).tolist(),
        "reduce_bool": strategy.reduce_boolean_decision(rank == 0, all=True),
    }


def _job(engine: str, root: str) -> dict[str, Any]:
    import lightning as L

    strategies = shard_stages_then_ddp(engine, STAGES[engine])
    out: dict[str, Any] = {}
    for name, make in strategies.items():
        trainer = L.Trainer(
            devices=2,
            strategy=make(),
            **trainer_kwargs(max_steps=2, limit_val_batches=2, limit_test_batches=2),
        )
        model = _eval_gpt()
        trainer.fit(model, loader(4), loader(4))
        out[name, "fit"] = _collectives(trainer.strategy, Path(root, f"{name}-fit"))
        trainer.validate(model, loader(4), verbose=False)
        out[name, "validate"] = _collectives(trainer.strategy, Path(root, f"{name}-validate"))
        trainer.test(model, loader(4), verbose=False)
        out[name, "test"] = _collectives(trainer.strategy, Path(root, f"{name}-test"))
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_collectives_after_fit_validate_and_test_give_the_ddp_answers(engine, tmp_path):
    results = run_ranks(_job, engine, str(tmp_path))
    for rank, out in enumerate(results):
        for (name, call), got in out.items():
            where = f"rank {rank}, {name}, after {call}"
            assert got["broadcast"] == "best-from-rank-0", where
            assert got["broadcast_obj"] == {"path": "/ckpt/1", "score": 1}, where
            assert got["sum"] == [3.0, 30.0], where
            assert got["mean"] == [1.5, 15.0], where
            assert got["gather"] == [[1.0, 10.0], [2.0, 20.0]], where
            assert got["reduce_bool"] is False, where
            if rank == 0:  # held until rank 1 arrived
                assert got["left"] >= results[1][name, call]["entered"], where
            ddp = out["ddp", call]
            assert {k: v for k, v in got.items() if k not in TIMES} == {
                k: v for k, v in ddp.items() if k not in TIMES
            }, where


def _after_a_timeout(root: str) -> dict[str, Any]:
    from datetime import timedelta

    import lightning as L

    from lightning_shard import CollectiveTimeoutError, ShardStrategy

    strategy = ShardStrategy(stage=3, timeout=timedelta(seconds=3))
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=1))
    trainer.fit(_eval_gpt(), loader(4))
    out: dict[str, Any] = {}
    gave_up = Path(root, "rank0-gave-up")
    if strategy.global_rank == 1:
        _wait_for(gave_up, at_most=30)  # misses the barrier: rank 1 arrives once rank 0 has given up on it
    for call, run in (
        ("barrier", lambda: strategy.barrier()),
        ("broadcast", lambda: strategy.broadcast(strategy.global_rank)),
        ("reduce", lambda: strategy.reduce(torch.ones(1), reduce_op="sum")),
        ("all_gather", lambda: strategy.all_gather(torch.ones(1))),
    ):
        try:
            out[call] = ("returned", run())
        except CollectiveTimeoutError as error:
            out[call] = ("raised", str(error))
        if call == "barrier" and strategy.global_rank == 0:
            gave_up.touch()
    return out


def test_after_a_collective_times_out_every_later_collective_raises_never_a_local_value(tmp_path):
    rank0, rank1 = run_ranks(_after_a_timeout, str(tmp_path))
    assert rank0["barrier"][0] == "raised" and "ShardStrategy(timeout=0:00:03)" in rank0["barrier"][1]
    for out in (rank0, rank1):
        # rank 1's barrier meets no one (rank 0 has given up) and times out; from then on, nothing runs.
        for call in ("broadcast", "reduce", "all_gather"):
            assert out[call][0] == "raised", (call, out[call])
            assert "was not run: an earlier collective" in out[call][1] or "gave up" in out[call][1]


class _RaisesOnRank1(Exception):
    pass


def _one_rank_raises() -> dict[str, Any]:
    from datetime import timedelta

    import lightning as L
    import torch.distributed as dist

    from lightning_shard import ShardStrategy

    barriers: list[str] = []
    barrier = dist.barrier

    def counted(*args: Any, **kwargs: Any) -> Any:
        barriers.append("after the error" if raised else "before")
        return barrier(*args, **kwargs)

    raised = False
    model = tiny_gpt()
    step = model.training_step

    def training_step(batch: Any, batch_idx: int) -> Any:
        nonlocal raised
        if batch_idx == 1 and dist.get_rank() == 1:
            raised = True
            raise _RaisesOnRank1("a bug on rank 1 alone")
        return step(batch, batch_idx)

    model.training_step = training_step  # type: ignore[method-assign]
    dist.barrier = counted  # type: ignore[assignment]
    strategy = ShardStrategy(stage=3, timeout=timedelta(seconds=20))
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=3))
    try:
        trainer.fit(model, loader(4))
        error = None
    except Exception as exc:  # noqa: BLE001  (the test reports which error each rank saw)
        error = type(exc).__name__
    return {"error": error, "barriers": barriers}


def test_an_exception_on_one_rank_ends_its_call_without_a_collective_the_others_cannot_match():
    # Rank 0 is in step 1's collectives when rank 1 raises: a barrier in rank 1's teardown would be matched
    # against them or wait for the timeout; DDPStrategy's teardown has none. Rank 1 leaves at once; rank 0's
    # collective then loses its peer and says so.
    rank0, rank1 = run_ranks(_one_rank_raises)
    assert rank1["error"] == "_RaisesOnRank1"
    assert "after the error" not in rank1["barriers"], rank1["barriers"]
    assert rank0["error"] == "CollectiveTimeoutError", rank0


def _wait_forever(pid_dir: str) -> None:
    import os

    Path(pid_dir, str(os.getpid())).touch()
    time.sleep(600)


class _StopWaiting(Exception):
    pass


def _running(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_run_ranks_stops_its_ranks_when_the_caller_stops_waiting(tmp_path):
    # A test's time limit interrupts run_ranks with an exception: its ranks must not outlive it.
    import signal
    import threading

    def stop_waiting(*_: Any) -> None:
        raise _StopWaiting

    def once_both_started() -> None:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)  # the waiting thread

    previous = signal.signal(signal.SIGUSR1, stop_waiting)
    try:
        threading.Thread(target=once_both_started, daemon=True).start()
        with pytest.raises(_StopWaiting):
            run_ranks(_wait_forever, str(tmp_path))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in pids), pids
