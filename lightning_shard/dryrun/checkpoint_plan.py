"""A sharded checkpoint's DCP plan for every rank of a world, from the shards of one rank per pipeline stage.

torch.distributed.checkpoint (DCP) saves a state dict in three steps: each rank lists the chunks it holds
(``create_default_local_save_plan``: a DTensor's local shard, a plain tensor or object whole), the coordinator
drops chunks held by several ranks from all plans but the smallest (``dedup_save_plans``), and the chunks make
the global :class:`~torch.distributed.checkpoint.metadata.Metadata` (``create_default_global_save_plan``), whose
``storage_data`` maps each chunk to the file ``__<rank>_0.distcp`` its writer writes (``FileSystemWriter``, one
file per rank). A load lists the chunks each rank needs and reads their overlap with the saved chunks
(``create_read_items_for_chunk_list``).

Here the same DCP functions run on metadata only. The ranks of one pipeline stage hold the same entries: one
rank per stage is set up on the fake group (:func:`~lightning_shard.dryrun.run.prepared_rank`), and each
entry is described once: its key (flattened as DCP flattens), global size, dtype, and for a DTensor its
placements and every group of ranks its mesh stands for (the mesh's layout over the world's ranks). A rank's
chunk of the entry is computed from its coordinate in its group with DTensor's own
``_compute_local_shape_and_global_offset``: never from a mesh's current coordinate, which torch's caches
(keyed by meshes equal on every rank) may answer with another rank's when several ranks are played in one
process.

Figures are the tensors' raw bytes: a written chunk adds ``torch.save``'s framing (about a kilobyte), which
``FileSystemReader`` reads with it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from lightning_shard.parallel import ParallelDims

try:  # private torch APIs (docs/compatibility.md): a release without them fails the reshard plan, nothing else
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
except ImportError as error:  # pragma: no cover  (a release without them)
    _MISSING: Exception | None = error
else:
    _MISSING = None

Chunk = ChunkStorageMetadata
_PRIVATE = (
    "torch.distributed.checkpoint._dedup_save_plans.dedup_save_plans, filesystem._StorageInfo,"
    " tensor._utils._compute_local_shape_and_global_offset and DeviceMesh._layout / _rank_map"
)


def _unavailable(error: Exception) -> RuntimeError:
    return RuntimeError(
        f"the reshard plan needs torch's {_PRIVATE}, which this torch release does not have ({error}). It was"
        " tested with torch 2.13."
    )


def shard_file(rank: int) -> str:
    """The file rank ``rank`` writes: ``FileSystemWriter``'s ``__<rank>_<file>.distcp``, one file per rank."""
    return f"__{rank}_0.distcp"


@dataclass(frozen=True)
class Entry:
    """One entry of a stage's flattened state dict, as every rank of the stage holds it."""

    key: str
    kind: Literal["dtensor", "tensor", "bytes"]
    """``"dtensor"`` (a chunk per rank), ``"tensor"`` (whole on every rank of the stage), ``"bytes"`` (an object)."""
    size: torch.Size = torch.Size()
    properties: TensorProperties | None = None
    placements: tuple[Any, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    coordinates: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)
    """A DTensor's holders: global rank -> its coordinate in its group of the mesh."""
    nbytes: int = 0
    """An object's ``torch.save``'d bytes (what DCP writes for it)."""

    @property
    def itemsize(self) -> int:
        return self.properties.dtype.itemsize if self.properties is not None else 1


def _coordinates(value: DTensor, cache: dict[Any, dict[int, tuple[int, ...]]]) -> dict[int, tuple[int, ...]]:
    """Every rank of every group the DTensor's mesh stands for, with its coordinate in the group."""
    mesh = value.device_mesh
    try:  # private torch API: the mesh's layout over the world's ranks gives every group it stands for
        layout, rank_map = mesh._layout, mesh._rank_map
    except AttributeError as error:  # pragma: no cover  (a release without them)
        raise _unavailable(error) from error
    key = (str(layout), tuple(rank_map.tolist()))
    if key not in cache:
        groups = layout.remap_to_tensor(rank_map).reshape(-1, *mesh.shape)  # [groups, *mesh shape]
        found: dict[int, tuple[int, ...]] = {}
        positions = torch.cartesian_prod(*(torch.arange(n) for n in mesh.shape)).reshape(-1, mesh.ndim)
        coordinates = [tuple(int(i) for i in position) for position in positions]
        for group in groups:
            for coordinate in coordinates:
                found[int(group[coordinate])] = coordinate
        cache[key] = found
    return cache[key]


def stage_entries(state_dict: dict[str, Any]) -> tuple[list[Entry], dict[str, Any]]:
    """The entries of ``state_dict`` flattened as ``DefaultSavePlanner`` flattens it, and its key mappings (the
    metadata's ``planner_data``)."""
    if _MISSING is not None:  # pragma: no cover  (a release without them)
        raise _unavailable(_MISSING)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=False)
    cache: dict[Any, dict[int, tuple[int, ...]]] = {}
    entries = []
    for key, value in planner.state_dict.items():
        if isinstance(value, DTensor):
            properties = TensorProperties.create_from_tensor(value._local_tensor)
            entries.append(
                Entry(
                    key,
                    "dtensor",
                    value.size(),
                    properties,
                    tuple(value.placements),
                    tuple(value.device_mesh.shape),
                    _coordinates(value, cache),
                )
            )
        elif isinstance(value, torch.Tensor):
            entries.append(Entry(key, "tensor", value.size(), TensorProperties.create_from_tensor(value)))
        else:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            entries.append(Entry(key, "bytes", nbytes=buffer.getbuffer().nbytes))
    return entries, dict(planner.mappings)


@dataclass
class Layout:
    """The checkpoint entries of every rank of a layout: one list per pipeline stage."""

    dims: ParallelDims
    stages: list[list[Entry]]
    mappings: dict[str, Any]

    def stage_of(self, rank: int) -> int:
        return int(self.dims.coordinates(rank)["pp"])

    def chunks(self, entry: Entry, rank: int, cache: dict[Any, Any]) -> list[Chunk]:
        """The chunk of ``entry`` rank ``rank`` holds (``[]`` where it holds none)."""
        if entry.kind != "dtensor":
            return [Chunk(torch.Size([0] * len(entry.size)), entry.size)]
        coordinate = entry.coordinates.get(rank)
        if coordinate is None:
            return []
        key = (entry.size, entry.placements, entry.mesh_shape, coordinate)
        if key not in cache:
            sizes, offsets = _compute_local_shape_and_global_offset(
                entry.size, entry.mesh_shape, list(coordinate), entry.placements
            )
            cache[key] = Chunk(torch.Size(offsets), torch.Size(sizes))
        return [cache[key]]

    def needed_bytes(self, rank: int) -> int:
        """The bytes of rank ``rank``'s own chunks (its objects left out: it reads the saved ones whole)."""
        cache: dict[Any, Any] = {}
        total = 0
        for entry in self.stages[self.stage_of(rank)]:
            if entry.kind != "bytes":
                total += sum(math.prod(c.sizes) for c in self.chunks(entry, rank, cache)) * entry.itemsize
        return total


def _write_items(layout: Layout, rank: int, cache: dict[Any, Any]) -> Iterator[WriteItem]:
    """What ``create_default_local_save_plan`` lists for rank ``rank``, in the state dict's order. An item held
    by several ranks is one object (a plain tensor's or an object's is on every rank of the stage)."""
    for entry in layout.stages[layout.stage_of(rank)]:
        for chunk in [None] if entry.kind == "bytes" else layout.chunks(entry, rank, cache):
            key = (entry.key, None if chunk is None else tuple(chunk.offsets))
            item = cache.get(key)
            if item is None:
                item = cache[key] = _write_item(entry, chunk)
            yield item


def _write_item(entry: Entry, chunk: Chunk | None) -> WriteItem:
    if chunk is None:
        return WriteItem(index=MetadataIndex(entry.key), type=WriteItemType.BYTE_IO)
    kind = WriteItemType.SHARD if entry.kind == "dtensor" else WriteItemType.TENSOR
    data = TensorWriteData(chunk=chunk, properties=entry.properties, size=entry.size)  # type: ignore[arg-type]
    return WriteItem(index=MetadataIndex(entry.key, chunk.offsets), type=kind, tensor_data=data)


def _item_bytes(item: WriteItem, entries: dict[str, Entry]) -> int:
    entry = entries[item.index.fqn]
    if item.tensor_data is None:
        return entry.nbytes
    return math.prod(item.tensor_data.chunk.sizes) * entry.itemsize


def saved_metadata(layout: Layout) -> Metadata:
    """The global ``Metadata`` a save from every rank of ``layout`` writes, its ``storage_data`` naming each chunk's
    file (offsets and lengths in raw bytes, objects first as ``FileSystemWriter`` writes them)."""
    cache: dict[Any, Any] = {}
    plans = [SavePlan(list(_write_items(layout, rank, cache))) for rank in range(layout.dims.world_size)]
    plans = dedup_save_plans(plans)
    plans, metadata = create_default_global_save_plan(plans)
    entries = {entry.key: entry for stage in layout.stages for entry in stage}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rank, plan in enumerate(plans):
        offset = 0
        ordered = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
        for item in ordered:
            length = _item_bytes(item, entries)
            storage[item.index] = _StorageInfo(shard_file(rank), offset, length)
            offset += length
    metadata.storage_data = storage
    metadata.planner_data = layout.mappings
    return metadata


@dataclass(frozen=True)
class FileRead:
    """What one loading rank reads from one file."""

    bytes: int
    """The saved chunks' overlap with the rank's own chunks (objects whole): what it keeps."""
    chunk_bytes: int
    """The saved chunks it touches, whole: ``FileSystemReader`` reads each read item's chunk whole, then narrows."""
    reads: int
    """DCP read items (one per overlap of a saved chunk with a chunk of the rank)."""


def read_items(
    layout: Layout, rank: int, metadata: Metadata, missing: Callable[[str], None]
) -> list[ReadItem]:
    """The read items of rank ``rank`` of ``layout`` against ``metadata`` (``DefaultLoadPlanner``'s local plan);
    ``missing(key)`` for an entry the checkpoint lacks."""
    cache: dict[Any, Chunk] = {}
    items: list[ReadItem] = []
    for entry in layout.stages[layout.stage_of(rank)]:
        saved = metadata.state_dict_metadata.get(entry.key)
        if saved is None:
            missing(entry.key)
        elif isinstance(saved, BytesStorageMetadata):
            index = MetadataIndex(entry.key)
            items.append(
                ReadItem(
                    LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0])
                )
            )
        elif isinstance(saved, TensorStorageMetadata):
            items += create_read_items_for_chunk_list(entry.key, saved, layout.chunks(entry, rank, cache))
    return items


def object_bytes(items: list[ReadItem], metadata: Metadata) -> int:
    """The saved objects among ``items``, whole."""
    storage = metadata.storage_data
    return sum(storage[item.storage_index].length for item in items if item.type == LoadItemType.BYTE_IO)


def file_reads(items: list[ReadItem], metadata: Metadata) -> dict[str, FileRead]:
    """The read items grouped by the file that holds them, as ``FileSystemReader.read_data`` groups them."""
    storage: dict[MetadataIndex, _StorageInfo] = metadata.storage_data
    totals: dict[str, list[int]] = {}
    for item in items:
        info = storage[item.storage_index]
        if item.type == LoadItemType.BYTE_IO:
            taken = info.length
        else:
            saved = metadata.state_dict_metadata[item.storage_index.fqn]
            assert isinstance(saved, TensorStorageMetadata)
            taken = math.prod(item.lengths) * saved.properties.dtype.itemsize
        total = totals.setdefault(info.relative_path, [0, 0, 0])
        total[0] += taken
        total[1] += info.length
        total[2] += 1
    return {path: FileRead(*totals[path]) for path in sorted(totals, key=_file_order)}


def _file_order(path: str) -> tuple[int, str]:
    number = path[2:].split("_")[0]
    return (int(number), path) if number.isdigit() else (-1, path)
