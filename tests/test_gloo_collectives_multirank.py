"""FSDP2's collectives on gloo, through shared memory or, where that is unavailable, the reduce-scatter as an
all-to-all plus a local sum: the same gradient shards as torch's (bit-equal on 2 ranks, where a sum of two
has one order), on 2 and 4 ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_shard.demos.ranks import run_ranks


def _grads(custom: bool) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    from lightning_shard.engines._gloo import use_cpu_collectives

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    )  # uneven shards
    fully_shard(model[0])
    fully_shard(model)
    if custom:
        assert use_cpu_collectives(model[0]) and use_cpu_collectives(model)
    g = torch.Generator().manual_seed(10 + torch.distributed.get_rank())  # each rank its own batch
    model(torch.randn(4, 7, generator=g)).pow(2).sum().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def _job() -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_shard.engines import _shm
    from lightning_shard.engines._gloo import CpuReduceScatter

    dist.init_process_group("gloo")
    out = {"default": _grads(False), "shared_memory": _grads(True)}
    assert _shm.shared_memory_group(dist.group.WORLD) is not None
    _shm.release()
    _shm._DIRECTORY = "/nonexistent-directory"  # no shared memory: all-to-all and gloo's all-gather
    out["all_to_all"] = _grads(True)
    assert _shm.shared_memory_group(dist.group.WORLD) is None
    # The op: a sum, or an average, of each rank's buffer (rank r holds r + 1 everywhere).
    n = dist.get_world_size()
    buffer = torch.full((3 * n,), float(dist.get_rank() + 1))
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
        shard = torch.empty(3)
        CpuReduceScatter(shared_memory=False)(shard, buffer, dist.group.WORLD, op)
        out[str(op)] = shard.tolist()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_reduce_scatter_matches_gloo(world_size):
    n = world_size
    for out in run_ranks(_job, world_size=world_size):
        for a, b, c in zip(out["default"], out["shared_memory"], out["all_to_all"], strict=True):
            for other in (b, c):
                if world_size == 2:
                    assert torch.equal(a, other)
                else:
                    torch.testing.assert_close(a, other, rtol=1e-6, atol=1e-7)
        total = n * (n + 1) / 2
        assert out[str(torch.distributed.ReduceOp.SUM)] == [total] * 3
        assert out[str(torch.distributed.ReduceOp.AVG)] == pytest.approx([total / n] * 3)
        assert out[str(torch.distributed.ReduceOp.MAX)] == [float(n)] * 3
