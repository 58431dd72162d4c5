"""Collectives in user code before, between and after Trainer calls give the answers they give under
Lightning's DDPStrategy: the strategy keeps its process groups alive until the process exits."""

from __future__ import annotations

import time
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


def _collectives(strategy: Any) -> dict[str, Any]:
    """What a user script does with ``trainer.strategy`` around a Trainer call."""
    rank = strategy.global_rank
    local = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    if rank == 1:
        time.sleep(0.5)  # a barrier that does not wait returns on rank 0 at once
    start = time.monotonic()
    strategy.barrier("user")
    waited = time.monotonic() - start
    return {
        "waited": waited,
        "broadcast": strategy.broadcast(f"best-from-rank-{rank}"),
        "broadcast_obj": strategy.broadcast({"path": f"/ckpt/{rank}", "score": rank}, src=1),
        "sum": strategy.reduce(local.clone(), reduce_op="sum").tolist(),
        "mean": strategy.reduce(local.clone(), reduce_op="mean").tolist(),
        "gather": strategy.all_gather(local.clone()).tolist(),
        "reduce_bool": strategy.reduce_boolean_decision(rank == 0, all=True),
    }


def _job(engine: str) -> dict[str, Any]:
    import lightning as L

    strategies = shard_stages_then_ddp(engine, STAGES[engine])
    out: dict[str, Any] = {}
    for name, make in strategies.items():
        trainer = L.Trainer(devices=2, strategy=make(), **trainer_kwargs(max_steps=2, limit_val_batches=2))
        model = _eval_gpt()
        trainer.fit(model, loader(4), loader(4))
        out[name, "fit"] = _collectives(trainer.strategy)
        trainer.validate(model, loader(4), verbose=False)
        out[name, "validate"] = _collectives(trainer.strategy)
        trainer.test(model, loader(4), verbose=False)
        out[name, "test"] = _collectives(trainer.strategy)
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_collectives_after_fit_validate_and_test_give_the_ddp_answers(engine):
    results = run_ranks(_job, engine)
    for rank, out in enumerate(results):
        for (name, call), got in out.items():
            where = f"rank {rank}, {name}, after {call}"
            assert got["broadcast"] == "best-from-rank-0", where
            assert got["broadcast_obj"] == {"path": "/ckpt/1", "score": 1}, where
            assert got["sum"] == [3.0, 30.0], where
            assert got["mean"] == [1.5, 15.0], where
            assert got["gather"] == [[1.0, 10.0], [2.0, 20.0]], where
            assert got["reduce_bool"] is False, where
            if rank == 0:
                assert got["waited"] > 0.3, where  # held until rank 1 arrived
            ddp = out["ddp", call]
            assert {k: v for k, v in got.items() if k != "waited"} == {
                k: v for k, v in ddp.items() if k != "waited"
            }, where


def _after_a_timeout() -> dict[str, Any]:
    from datetime import timedelta

    import lightning as L

    from lightning_shard import CollectiveTimeoutError, ShardStrategy

    strategy = ShardStrategy(stage=3, timeout=timedelta(seconds=3))
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=1))
    trainer.fit(_eval_gpt(), loader(4))
    out: dict[str, Any] = {}
    if strategy.global_rank == 1:
        time.sleep(6)  # misses the barrier: rank 0 gives up on it
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
    return out


def test_after_a_collective_times_out_every_later_collective_raises_never_a_local_value():
    rank0, rank1 = run_ranks(_after_a_timeout)
    assert rank0["barrier"][0] == "raised" and "ShardStrategy(timeout=0:00:03)" in rank0["barrier"][1]
    for out in (rank0, rank1):
        # rank 1's barrier meets no one (rank 0 has given up) and times out; from then on, nothing runs.
        for call in ("broadcast", "reduce", "all_gather"):
            assert out[call][0] == "raised", (call, out[call])
            assert "was not run: an earlier collective" in out[call][1] or "gave up" in out[call][1]
