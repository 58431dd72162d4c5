"""The dry run against a real job: a 4-rank gloo run of the same small model and flags holds, on every rank,
exactly the bytes the dry run reports for that rank.

The real side reads what was allocated, not the layout: the distinct storages behind the parameter shards and
behind the gradients after one step (FSDP2's padded buffers), and the optimizer's state tensors after that step,
and the checkpoint files the rank wrote in a sharded save. Uneven sizes (251 tokens, 101 positions) make the
last shards padding.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_shard import ShardFabricStrategy, dryrun
from lightning_shard.demos.gpt import GPT
from lightning_shard.demos.ranks import run_ranks

pytestmark = pytest.mark.multirank

ARGS = dict(vocab_size=251, seq_len=101, d_model=64, n_heads=4, n_layers=2)
FLAGS = dict(stage=3, tensor_parallel_size=2)


def _storages(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _real_job(path: str) -> dict[str, Any]:
    fabric = L.Fabric(
        accelerator="cpu", devices=4, strategy=ShardFabricStrategy(**FLAGS), precision="32-true"
    )
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = GPT(**ARGS)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    params = _storages(list(model.parameters()))
    tokens = torch.randint(0, ARGS["vocab_size"], (2, 16))
    fabric.backward(model(tokens).float().pow(2).mean())
    grads = _storages([p.grad for p in model.parameters() if p.grad is not None])
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    fabric.save(path, {"model": model, "optimizer": optimizer})
    rank = fabric.global_rank
    files = sorted(
        f for f in os.listdir(path) if f.startswith(f"__{rank}_") or (rank == 0 and f == ".metadata")
    )
    return {
        "param_bytes": params,
        "grad_bytes": grads,
        "optimizer_bytes": sum(getattr(t, "_local_tensor", t).nbytes for t in state),
        "files": files,
    }


def test_the_dry_run_holds_what_a_real_4_rank_job_holds(tmp_path: Path):
    real = run_ranks(_real_job, str(tmp_path / "ckpt"), world_size=4)
    reports = dryrun(GPT, FLAGS, 4, ranks=[0, 1, 2, 3], precision="32-true", init_args=ARGS, planner=False)
    for rank, (got, report) in enumerate(zip(real, reports, strict=True)):
        dry = {k: getattr(report, k) for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}
        assert dry == {k: got[k] for k in dry}, (rank, dry, got)
        assert sorted(report.checkpoint_files) == got["files"], (rank, report.checkpoint_files, got["files"])
    # ranks 0 and 2 are shard ranks 0 and 1 of one tensor-parallel slice: the same padded allocations, while
    # the last shard's real rows (and so its optimizer state) are fewer
    assert reports[0].param_bytes == reports[2].param_bytes
    assert reports[0].optimizer_bytes > reports[2].optimizer_bytes
