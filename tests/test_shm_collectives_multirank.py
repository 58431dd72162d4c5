"""Collectives through shared memory among CPU ranks on one host (``engines/_shm.py``): the same results
as gloo's (bit-equal on 2 ranks), calls in a row that reuse and grow the files, every rank falling back
to gloo together when one rank cannot map them, nothing left in /dev/shm, and training at stages 0-3
carried by them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lightning_shard.demos.ranks import run_ranks


@pytest.fixture
def shm() -> Iterator[str]:
    """A folder of /dev/shm for one test's ranks to make their files in (``_shm._DIRECTORY``): what is left
    there is this job's, whatever other jobs on the machine have in /dev/shm at the time."""
    folder = tempfile.mkdtemp(prefix="lightning_shard-test-", dir="/dev/shm")
    yield folder
    left = os.listdir(folder)
    for name in left:
        os.unlink(os.path.join(folder, name))
    os.rmdir(folder)
    assert left == []


def _job(broken_rank: int | None, folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_shard.engines import _shm

    _shm._DIRECTORY = folder
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == broken_rank:
        _shm._DIRECTORY = "/nonexistent-directory"  # this rank cannot make its file
    group = _shm.shared_memory_group(dist.group.WORLD)
    assert group is not None
    out: dict[str, Any] = {"used": [], "equal": [], "close": []}
    g = torch.Generator().manual_seed(rank)
    # Sizes that grow, shrink and grow again; each call's data differs, so a half read too early or
    # written too soon shows up as a wrong value.
    for size in (8, 8, 1000, 24, 5000, 5000, 16):
        x = torch.randn(size * n, generator=g)
        # all-gather
        mine = x[:size].clone()
        ours, ref = torch.empty(size * n), torch.empty(size * n)
        out["used"].append(group.all_gather(ours, mine))
        dist.all_gather_into_tensor(ref, mine)
        if not out["used"][-1]:
            dist.all_gather_into_tensor(ours, mine)
        out["equal"].append(torch.equal(ours, ref))
        # reduce-scatter, sum and mean
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            ours, gathered = torch.empty(size), torch.empty(size * n * n)
            if not group.reduce_scatter(ours, x, op):
                ours = None
            dist.all_gather_into_tensor(gathered, x)
            ref = gathered.view(n, n, size)[:, rank].sum(0) / (n if op == dist.ReduceOp.AVG else 1)
            out["close"].append(ours is None or torch.allclose(ours, ref, rtol=1e-6, atol=1e-6))
            if n == 2 and ours is not None and op == dist.ReduceOp.SUM:
                out["equal"].append(torch.equal(ours, ref))
        # all-reduce: the same bits on every rank
        y = x.clone()
        if group.all_reduce(y, dist.ReduceOp.SUM):
            every = torch.empty(y.numel() * n)
            dist.all_gather_into_tensor(every, y)
            out["equal"].append(all(torch.equal(c, y) for c in every.view(n, -1)))
            ref = x.clone()
            dist.all_reduce(ref)
            out["close"].append(torch.allclose(y, ref, rtol=1e-6, atol=1e-6))
        # gather with a different size per rank
        parts = [torch.full((j + size,), -1.0) for j in range(n)]
        parts[rank] = torch.full((rank + size,), float(rank))
        if group.gather(parts, parts[rank]):
            out["equal"].append(
                all(torch.equal(p, torch.full_like(p, float(j))) for j, p in enumerate(parts))
            )
    out["usable"] = group.usable
    out["left"] = os.listdir(folder)
    _shm.release()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_shared_memory_collectives_match_gloo(world_size, shm):
    for out in run_ranks(_job, None, shm, world_size=world_size):
        assert out["usable"] and all(out["used"])
        assert all(out["equal"]) and all(out["close"])
        assert out["left"] == []  # unlinked once every rank had mapped them


def test_one_rank_without_shared_memory_falls_back_everywhere(shm):
    outs = run_ranks(_job, 1, shm, world_size=2)
    for out in outs:
        assert not out["usable"] and not any(out["used"])
        assert all(out["equal"]) and all(out["close"])


class _UserHook:
    """A DDP communication hook registered in a callback, as under Lightning's DDPStrategy."""

    def __init__(self) -> None:
        self.calls = 0
        self.second: str | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            return

        def hook(state, bucket):
            self.calls += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
        try:
            model.register_comm_hook(None, hook)
        except RuntimeError as err:
            self.second = str(err)


def _train(
    stage: int, user_hook: bool, folder: str, ddp_strategy: bool = False, **ddp_kwargs: Any
) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_shard import ShardStrategy
    from lightning_shard.engines import _shm
    from tests.helpers import LossRecorder, loader, tiny_gpt, trainer_kwargs

    _shm._DIRECTORY = folder
    calls: dict[str, int] = {}
    for name in ("all_gather", "reduce_scatter", "all_reduce", "gather"):
        original = getattr(_shm.SharedMemoryGroup, name)

        def spy(self, *args, _original=original, _name=name):
            done = _original(self, *args)
            calls[_name] = calls.get(_name, 0) + int(done)
            return done

        setattr(_shm.SharedMemoryGroup, name, spy)
    user = type("UserHook", (_UserHook, L.Callback), {})()
    losses = LossRecorder()
    strategy = DDPStrategy(**ddp_kwargs) if ddp_strategy else ShardStrategy(stage=stage, **ddp_kwargs)
    seen: dict[str, Any] = {}
    keys = ("static_graph", "gradient_as_bucket_view")
    ddp_options = L.Callback()
    # The DDP module as training runs (DDPStrategy unwraps it at teardown).
    ddp_options.on_train_start = lambda trainer, module: seen.update(  # type: ignore[method-assign]
        {key: getattr(trainer.model, key, None) for key in keys}
    )
    callbacks = [losses, user, ddp_options] if user_hook else [losses, ddp_options]
    trainer = L.Trainer(**trainer_kwargs(devices=2, strategy=strategy, max_steps=3, callbacks=callbacks))
    trainer.fit(tiny_gpt(), loader(4))
    return {
        "calls": calls,
        "left": os.listdir(folder),
        "groups": len(_shm._groups),
        "user": (user.calls, user.second),
        "losses": losses.losses,
        "ddp": seen,
    }


def _stage0_and_ddp(folder: str) -> dict[str, Any]:
    return {
        (strategy, hook): _train(
            0, hook, folder, strategy == "ddp", static_graph=True, gradient_as_bucket_view=True
        )
        for strategy in ("shard", "ddp")
        for hook in (False, True)
    }


@pytest.mark.parametrize(
    "stage, expected",
    [
        (0, {"all_reduce"}),
        (1, {"all_reduce", "gather"}),
        (2, {"all_gather", "gather", "reduce_scatter"}),
    ],  # an all-gather is a gather
)
def test_training_communicates_through_shared_memory(stage, expected, shm):
    for out in run_ranks(_train, stage, False, shm, world_size=2):
        assert {name for name, count in out["calls"].items() if count} == expected
        assert out["left"] == [] and out["groups"] == 0  # released at teardown


def test_stage0_matches_ddpstrategy_and_a_users_ddp_comm_hook_replaces_the_shared_memory_one(shm):
    for runs in run_ranks(_stage0_and_ddp, shm, world_size=2):
        ours, users = runs[("shard", False)], runs[("shard", True)]
        assert ours["calls"]["all_reduce"] > 0 and "all_reduce" not in users["calls"]
        calls, second = users["user"]
        assert calls > 0  # DDP's hook: one call per bucket per step
        assert second == "register_comm_hook or register_builtin_comm_hook can only be called once."
        # The same script under Lightning's DDPStrategy: the same losses (bit-equal on 2 ranks), the same
        # hook calls and the same error for a second registration.
        for hook in (False, True):
            assert runs[("shard", hook)]["losses"] == runs[("ddp", hook)]["losses"]
            assert runs[("shard", hook)]["user"] == runs[("ddp", hook)]["user"]
            # DDPStrategy's options reach the DDP module as under DDPStrategy (both default False).
            assert runs[("shard", hook)]["ddp"] == runs[("ddp", hook)]["ddp"]
            assert runs[("shard", hook)]["ddp"] == {"static_graph": True, "gradient_as_bucket_view": True}
