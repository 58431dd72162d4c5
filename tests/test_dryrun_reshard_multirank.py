"""The reshard plan against a real load: a sharded checkpoint saved by 4 gloo ranks (HSDP, 2 x 2) and loaded by 2
(ZeRO-3), each loading rank recording what DCP's reader reads; the plan names exactly those files, and the same
bytes and read items from each. Uneven sizes (251 tokens, 101 positions) make the shards uneven."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_shard import ShardFabricStrategy
from lightning_shard.checkpoint import sharded
from lightning_shard.checkpoint._dcp_metadata import MetadataReader
from lightning_shard.demos.gpt import GPT
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.dryrun import reshard

pytestmark = pytest.mark.multirank

ARGS = dict(vocab_size=251, seq_len=101, d_model=64, n_heads=4, n_layers=2)
SAVE = dict(stage=3, replicate_size=2)
LOAD = dict(stage=3)


class RecordingReader(MetadataReader):
    """DCP's reader, noting for each read item the file it opens and the bytes it keeps."""

    reads: list[tuple[str, int]] = []

    def read_data(self, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            saved = planner.metadata.state_dict_metadata[item.storage_index.fqn]
            kept = (
                info.length
                if item.type.name == "BYTE_IO"
                else math.prod(item.lengths) * saved.properties.dtype.itemsize
            )
            RecordingReader.reads.append((info.relative_path, kept))
        return super().read_data(plan, planner)


def _job(path: str, flags: dict[str, Any], save: bool) -> dict[str, list[int]]:
    fabric = L.Fabric(
        accelerator="cpu",
        devices=4 if save else 2,
        strategy=ShardFabricStrategy(**flags),
        precision="32-true",
    )
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = GPT(**ARGS)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    if save:  # one step, so that the optimizer has state to save (a load lays out its own)
        fabric.backward(model(torch.randint(0, ARGS["vocab_size"], (2, 16))).float().pow(2).mean())
        optimizer.step()
        fabric.save(path, {"model": model, "optimizer": optimizer})
        return {}
    # this rank's process only: the load's DCP reader, recording
    sharded.metadata_reader = lambda where, weights_only=None: RecordingReader(str(where))
    fabric.load(path, {"model": model, "optimizer": optimizer})
    files: dict[str, list[int]] = {}
    for name, kept in RecordingReader.reads:
        total = files.setdefault(name, [0, 0])
        total[0] += kept
        total[1] += 1
    return files


def test_the_reshard_plan_names_the_files_and_bytes_a_real_load_reads(tmp_path: Path):
    path = str(tmp_path / "ckpt")
    run_ranks(_job, path, SAVE, True, world_size=4)
    real = run_ranks(_job, path, LOAD, False, world_size=2)
    plan = reshard(GPT, SAVE, 4, LOAD, 2, ranks=[0, 1], precision="32-true", init_args=ARGS)
    for got, planned in zip(real, plan.ranks, strict=True):
        assert {name: [read.bytes, read.reads] for name, read in planned.files.items()} == got, planned.rank
    # shard 0 of the loading layout is shards 0 and 1 of the saving one: rank 0's file and rank 1's, and the
    # replicated entries (every `step`, every param group) spread over all four files by DCP's deduplication
    assert sum(read.bytes for read in plan.ranks[0].files.values()) > 0
    assert set(real[0]) <= {f"__{r}_0.distcp" for r in range(4)}
