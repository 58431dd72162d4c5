""":func:`reshard`: which files each rank of a new layout reads from a sharded checkpoint saved by another, planned
from metadata and meta tensors only.

A checkpoint saved by ``save_world_size`` ranks under ``save_strategy`` is planned as DCP would write it (the
global ``Metadata``, each chunk in the file its writer writes: :mod:`.checkpoint_plan`), and the ranks of
``load_world_size`` under ``load_strategy`` are planned against it as DCP's default load planner reads it: for
each chosen loading rank, the files it opens, the bytes it keeps from each (the overlaps of its chunks with the
saved ones) and the bytes of the saved chunks it touches (``FileSystemReader`` reads each whole).

One rank per pipeline stage of each layout is set up on the fake group; every other rank's chunks are
arithmetic on those (:class:`~lightning_shard.dryrun.checkpoint_plan.Layout`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from lightning_shard.config import ShardConfig
from lightning_shard.dryrun.checkpoint_plan import (
    FileRead,
    Layout,
    file_reads,
    object_bytes,
    read_items,
    saved_metadata,
)
from lightning_shard.dryrun.checkpoint_plan import stage_entries as _stage_entries
from lightning_shard.dryrun.models import ModelSource, model_factory
from lightning_shard.dryrun.run import (
    check_layout,
    checked_config,
    precision_policy,
    prepared_rank,
    state_dict,
)
from lightning_shard.dryrun.world import default_ranks, rank_of
from lightning_shard.precision import PrecisionPolicy
from lightning_shard.units import format_bytes

SHOWN = 5  # missing keys named in an error; the rest are counted


@dataclass(frozen=True)
class RankRead:
    """What one loading rank reads."""

    rank: int
    coordinates: dict[str, int]
    files: dict[str, FileRead]
    """File name -> what the rank reads from it, in the order of the saving ranks."""
    needed_bytes: int
    """The bytes of the rank's own chunks: those it keeps are these and :attr:`object_bytes`, where the saved
    chunks cover its own."""
    object_bytes: int
    """The saved objects it reads (the param groups' entries), whole."""
    seconds: float

    @property
    def bytes(self) -> int:
        return sum(read.bytes for read in self.files.values())

    @property
    def chunk_bytes(self) -> int:
        return sum(read.chunk_bytes for read in self.files.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "coordinates": self.coordinates,
            "bytes": self.bytes,
            "chunk_bytes": self.chunk_bytes,
            "needed_bytes": self.needed_bytes,
            "object_bytes": self.object_bytes,
            "files": {name: asdict(read) for name, read in self.files.items()},
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class ReshardPlan:
    """A checkpoint saved by one layout, read by another."""

    save_world_size: int
    load_world_size: int
    metadata: Metadata = field(repr=False)
    """The global DCP metadata the save writes (``storage_data``: chunk -> ``__<rank>_0.distcp``, raw bytes)."""
    saved_bytes: int
    """Bytes of every saved chunk and object, each once."""
    ranks: list[RankRead]
    seconds: float
    """The whole plan: both layouts' ranks set up, the save's metadata, the chosen ranks' reads."""

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` record (keys in docs/dryrun.md)."""
        files = {info.relative_path for info in self.metadata.storage_data.values()}
        return {
            "save_world_size": self.save_world_size,
            "load_world_size": self.load_world_size,
            "saved_files": len(files),
            "saved_bytes": self.saved_bytes,
            "saved_entries": len(self.metadata.state_dict_metadata),
            "seconds": self.seconds,
            "ranks": [rank.to_dict() for rank in self.ranks],
        }


def _layout(
    build: Callable[[], nn.Module], config: ShardConfig, policy: PrecisionPolicy, world_size: int
) -> Layout:
    """The checkpoint entries of every rank: one rank per pipeline stage set up on the fake group."""
    dims = check_layout(config, world_size, build())
    stages, mappings = [], {}
    for stage in range(dims.pp):
        rank = rank_of(dims, pp=stage)
        with prepared_rank(build, config, policy, rank, world_size) as (_, _, session, optimizers, _):
            entries, found = _stage_entries(state_dict(session, optimizers))
        stages.append(entries)
        mappings.update(found)
    return Layout(dims, stages, mappings)


def _refuse_zero_1(config: ShardConfig, flag: str) -> None:
    if config.stage == 1:
        raise ValueError(
            f"reshard({flag}=...stage=1): ZeRO-1 saves each optimizer entry from the one rank that owns it, which"
            " the plan (one rank per pipeline stage standing for the stage) cannot place. Plan the same layout"
            " with stage=2 or 3: the parameters' chunks and files are the same, the optimizer state sharded."
        )


def _missing(keys: list[str], save_world_size: int, load_world_size: int) -> ValueError:
    shown = ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")
    return ValueError(
        f"reshard: the layout of {load_world_size} ranks needs {len(keys)} entries the checkpoint of"
        f" {save_world_size} ranks lacks ({shown}): the real load would refuse it. Give both layouts the same"
        " model and optimizers (load_strategy changes the layout, not the state)."
    )


def reshard(
    model: ModelSource,
    save_strategy: Any,
    save_world_size: int,
    load_strategy: Any = None,
    load_world_size: int | None = None,
    ranks: list[int] | None = None,
    *,
    precision: str | None = None,
    init_args: dict[str, Any] | None = None,
) -> ReshardPlan:
    """Plan a sharded checkpoint of ``model`` saved by ``save_world_size`` ranks under ``save_strategy`` and
    loaded by ``load_world_size`` ranks under ``load_strategy`` (default: the same flags): for each of
    ``ranks`` of the loading world (default: first, last, one per stage and expert block), the files it reads
    and the bytes (see the module's docstring).

    Raises ``ValueError`` (naming the argument) where a layout does not divide its world or the model, for
    ZeRO-1, for ranks outside the loading world, and where the loading layout needs entries the save lacks.
    """
    start = time.perf_counter()
    load_world_size = save_world_size if load_world_size is None else load_world_size
    for name, size in (("save_world_size", save_world_size), ("load_world_size", load_world_size)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"reshard({name}={size!r}) must be a whole number of ranks, 1 or more.")
    save_config = checked_config(save_strategy)
    load_config = save_config if load_strategy is None else checked_config(load_strategy)
    _refuse_zero_1(save_config, "save_strategy")
    _refuse_zero_1(load_config, "load_strategy")
    first = model_factory(model, init_args)()
    load_dims = check_layout(load_config, load_world_size, first)
    chosen = default_ranks(load_dims) if ranks is None else sorted(set(ranks))
    bad = [r for r in chosen if not 0 <= r < load_world_size]
    if bad:
        raise ValueError(
            f"reshard(ranks={ranks}) names ranks outside the loading world of {load_world_size}: {bad}."
        )

    def build() -> nn.Module:
        return copy.deepcopy(first)

    saving = _layout(
        build, save_config, precision_policy(save_strategy, precision, save_config), save_world_size
    )
    loading = _layout(
        build,
        load_config,
        precision_policy(load_strategy or save_strategy, precision, load_config),
        load_world_size,
    )
    metadata = saved_metadata(saving)
    missing: list[str] = []
    reads = []
    for rank in chosen:
        begun = time.perf_counter()
        items = read_items(loading, rank, metadata, missing.append)
        if missing:
            raise _missing(sorted(set(missing)), save_world_size, load_world_size)
        files = file_reads(items, metadata)
        seconds = round(time.perf_counter() - begun, 3)
        needed, objects = loading.needed_bytes(rank), object_bytes(items, metadata)
        reads.append(RankRead(rank, load_dims.coordinates(rank), files, needed, objects, seconds))
    saved = sum(info.length for info in metadata.storage_data.values())
    total = round(time.perf_counter() - start, 3)
    return ReshardPlan(save_world_size, load_world_size, metadata, saved, reads, total)


def _files(names: list[str]) -> str:
    """``__0_0.distcp`` .. ``__3_0.distcp``, ``__7_0.distcp`` as ``0-3,7``: the saving ranks whose files are read."""
    numbers = sorted(int(name[2:].split("_")[0]) for name in names if name.startswith("__"))
    spans: list[list[int]] = []
    for n in numbers:
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "-"


def reshard_table(plan: ReshardPlan) -> str:
    """One line per loading rank: the saving ranks whose files it reads, the bytes it keeps and touches."""
    head = ("rank", "place", "files", "of saving ranks", "bytes kept", "chunks touched", "plan")
    rows: list[tuple[str, ...]] = [head]
    for r in plan.ranks:
        place = " ".join(f"{k}{v}" for k, v in r.coordinates.items() if k not in ("edp", "ep"))
        rows.append(
            (
                str(r.rank),
                place,
                str(len(r.files)),
                _files(list(r.files)),
                format_bytes(r.bytes),
                format_bytes(r.chunk_bytes),
                f"{r.seconds:.2f} s",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    files = len({info.relative_path for info in plan.metadata.storage_data.values()})
    return "\n".join(
        [
            f"checkpoint of {plan.save_world_size} ranks ({format_bytes(plan.saved_bytes)} in {files} files) read by"
            f" {len(plan.ranks)} of {plan.load_world_size} ranks (planned in {plan.seconds:.1f} s)",
            "",
            *lines,
        ]
    )
