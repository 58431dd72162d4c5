"""The fp32 weights of a DeepSpeed ZeRO checkpoint, a few parameters at a time (for :mod:`._hf_sources`).

DeepSpeed's ``zero_to_fp32`` rebuilds every parameter at once (at stages 1-2 it first concatenates each param
group's partitions from all ranks into one vector). This reader keeps only an index -- where each parameter
lies in the ranks' flat fp32 partitions -- and, for the parameters asked for, opens the rank files one at a
time (``torch.load(mmap=True)``: the pickle is read, and of the tensors only the pages of the slices copied
out) and copies each parameter's pieces into a tensor of its own. The layout it reads, as ``zero_to_fp32``
reads it:

* stages 1-2 (``single_partition_of_fp32_groups``): param group g is one flat vector cut into consecutive
  pieces, rank r holding the r-th. Its parameters lie in ``param_shapes[g]`` order, each followed by its
  ``param_alignment_paddings`` entry (none: 0); the vector's end is padded to a multiple of 2 x world size.
* stage 3 (``fp32_flat_groups``): a parameter of n elements is cut into ``world`` pieces of p = ceil(n / world)
  elements, the last one padded; rank r's sub-group vectors, end to end, hold its piece of every parameter in
  ``param_shapes`` order (all groups merged), so parameter i sits at the same offset on every rank:
  full[r*p : (r+1)*p] = rank_r[offset_i : offset_i + p].
* buffers: rank 0's ``module`` entries named in ``buffer_names``, fp32 when floating; frozen parameters:
  ``frozen_param_fragments`` (stage 3: each rank's piece, end to end); tied parameters (``shared_params``): the
  tensor they are tied to; no ZeRO partitions (stage 0): the module saved whole, as fp32.

``weights_only`` is kept as everywhere in the pack: unless it is ``False``, every file is first scanned
(:func:`._pickles.check_deepspeed_pickles`) and then loaded by torch's restricted unpickler, with DeepSpeed's
plain classes allowed; nothing in a file runs.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import lightning_shard.checkpoint._errors as errors
import lightning_shard.checkpoint._torch_files as torch_files
from lightning_shard.checkpoint._pickles import DEEPSPEED_GLOBALS, check_deepspeed_pickles
from lightning_shard.checkpoint.layout import DEEPSPEED_EXPERTS, DEEPSPEED_TAG, expert_blocks_file

#: Where a flat source tensor lives in a loaded file: ``("optim", i)``: the rank's i-th flat fp32 vector;
#: ``("frozen", name)``: a frozen parameter's fragment; ``("module", name)``: a whole module entry;
#: ``("experts", name)``: an expert-parallel rank's block of an expert parameter (its own file).
_Key = tuple[str, Any]


@dataclass(frozen=True)
class _Piece:
    """``length`` elements of file ``file``'s flat tensor ``key`` from ``start``, at ``out`` in the parameter."""

    file: Path
    key: _Key
    start: int
    length: int
    out: int


@dataclass(frozen=True)
class _Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[_Piece, ...]


def deepspeed_tensor_parallel_ranks(tag: Path) -> int:
    """How many tensor-parallel ranks (AutoTP) wrote DeepSpeed's tag folder ``tag``: the distinct ``mp_rank_NN``
    of its model-state files (ZeRO-3 writes one ``zero_pp_rank_R_mp_rank_NN_model_states.pt`` per data-parallel
    rank, all ``mp_rank_00`` without tensor parallelism)."""
    names = (
        re.search(r"mp_rank_(\d+)_model_states\.pt$", p.name) for p in tag.glob("*mp_rank_*_model_states.pt")
    )
    return len({match.group(1) for match in names if match is not None})


def refuse_tensor_parallel(path: Path) -> None:
    """Raise unless the DeepSpeed checkpoint ``path`` holds whole layers: with tensor parallelism (AutoTP) each
    ``mp_rank`` file holds its own slices, which DeepSpeed's ``zero_to_fp32`` and this reader would take as whole."""
    split = deepspeed_tensor_parallel_ranks(path / DEEPSPEED_TAG)
    if split > 1:
        raise errors.CheckpointLoadError(
            f"Checkpoint {str(path)!r} was written by DeepSpeed with tensor parallelism (AutoTP, {split}"
            " tensor-parallel ranks): its layers are split across its mp_rank files, which this reader does not"
            " join. Resume it with the same layout (ShardStrategy(engine='deepspeed',"
            f" tensor_parallel_size={split}) on as many ranks), or train with engine='fsdp', whose checkpoints"
            " consolidate at any tensor_parallel_size."
        )


class ZeroReader:
    """One DeepSpeed checkpoint directory (the one holding ``checkpoint/``), indexed for per-parameter reads."""

    def __init__(self, path: Path, weights_only: bool | None) -> None:
        self.path = path
        self.weights_only = weights_only
        folder = path / DEEPSPEED_TAG
        refuse_tensor_parallel(path)
        self._model_files = _natural(folder.glob("*_model_states.pt"))
        self._optim_files = _natural(folder.glob("*_optim_states.pt"))
        if weights_only is not False:  # the scan names a refused global and the opt-in, before any load
            check_deepspeed_pickles(sorted(folder.glob("*.pt")))
        states = self._load(self._model_files[0])
        self._entries: dict[str, _Entry] = {}
        self._tied: dict[str, str] = {}
        if states.get("param_shapes") is None:  # stage 0: no ZeRO partitions, the module is saved whole
            for name, value in states["module"].items():
                if torch.is_tensor(value):
                    self._whole(name, value, ("module", name), self._model_files[0], torch.float32)
            return
        buffers = set(states.get("buffer_names") or ())
        for name, value in states["module"].items():
            if name in buffers:
                dtype = torch.float32 if value.is_floating_point() else value.dtype
                self._whole(name, value, ("module", name), self._model_files[0], dtype)
        experts = states.get(DEEPSPEED_EXPERTS)
        stage = self._index_partitions(states, set(experts["names"]) if experts else set())
        if experts:
            self._index_experts(folder, experts)
        self._index_frozen(states, stage)
        for name, target in (states.get("shared_params") or {}).items():
            if target in self._entries:
                self._tied[name] = target

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor's shape and dtype, in ``zero_to_fp32``'s order; nothing read but the files' pickles."""
        out = {name: (e.shape, e.dtype) for name, e in self._entries.items()}
        out.update({name: out[target] for name, target in self._tied.items()})
        return out

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``names`` and no others, each in memory of its own; rank files opened one at a time."""
        out = {}
        for name in names:
            entry = self._entries[self._tied.get(name, name)]
            out[name] = _allocate(entry.shape, entry.dtype)
        by_file: dict[Path, list[tuple[str, _Piece]]] = {}
        for name in names:
            for piece in self._entries[self._tied.get(name, name)].pieces:
                by_file.setdefault(piece.file, []).append((name, piece))
        for file in sorted(by_file, key=lambda f: _natural_key(f.name)):
            loaded = self._load(file)
            for name, piece in by_file[file]:
                source = _flat(loaded, piece.key)
                _copy(out[name].view(-1)[piece.out : piece.out + piece.length], source, piece.start)
            del loaded  # its mapping closes before the next rank's file opens
        return out

    def hyper_parameters(self) -> Any:
        return self._load(self._model_files[0]).get("hyper_parameters")

    # --- the index ---------------------------------------------------------------------------------

    def _index_partitions(self, states: dict[str, Any], experts: set[str]) -> int:
        """Each trainable parameter's pieces in the optimizer files; returns the ZeRO stage. The param groups of
        ``experts`` (expert parallelism: partitioned over the ranks holding one block) are read from the blocks'
        own files instead (:meth:`_index_experts`)."""
        sizes: list[list[int]] = []  # rank -> its flat vectors' lengths
        stage, world, paddings = 0, 0, None
        for rank, file in enumerate(self._optim_files):
            saved = self._load(file)["optimizer_state_dict"]
            if rank == 0:
                stage, world = int(saved["zero_stage"]), saved["partition_count"]
                world = max(world) if isinstance(world, list) else int(world)
                paddings = saved.get("param_alignment_paddings")
            flat = saved["single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"]
            sizes.append([t.numel() for t in flat])
        if world != len(self._optim_files) or not sizes:
            raise self._damaged(
                f"its ZeRO stage-{stage} optimizer was partitioned over {world} ranks but"
                f" {len(self._optim_files)} *_optim_states.pt files are there"
            )
        groups = [list(shapes.items()) for shapes in states["param_shapes"]]
        if stage <= 2:
            self._index_stage12(groups, sizes, paddings, experts)
        else:
            self._index_stage3([p for group in groups for p in group], sizes)
        return stage

    def _index_stage12(
        self,
        groups: list[list[tuple[str, Any]]],
        sizes: list[list[int]],
        paddings: list[list[int]] | None,
        experts: set[str],
    ) -> None:
        world = len(sizes)
        for g, params in enumerate(groups):
            if params and all(name in experts for name, _ in params):
                continue
            bounds = [0]  # where each rank's piece of group g starts in the group's vector
            for rank in range(world):
                bounds.append(bounds[-1] + sizes[rank][g])
            offset = 0
            for i, (name, shape) in enumerate(params):
                numel = math.prod(shape)
                pieces = []
                for rank in range(world):
                    lo, hi = max(offset, bounds[rank]), min(offset + numel, bounds[rank + 1])
                    if lo < hi:
                        pieces.append(
                            _Piece(
                                self._optim_files[rank], ("optim", g), lo - bounds[rank], hi - lo, lo - offset
                            )
                        )
                self._entries[name] = _Entry(tuple(shape), torch.float32, tuple(pieces))
                offset += numel + (paddings[g][i] if paddings is not None else 0)
            align = 2 * world  # DeepSpeed pads each group's vector to a multiple of 2 x world size
            if math.ceil(offset / align) * align != math.ceil(bounds[-1] / align) * align:
                raise self._damaged(
                    f"param group {g}'s parameters need {offset} elements but its ZeRO partitions hold {bounds[-1]}"
                )

    def _index_experts(self, folder: Path, experts: dict[str, Any]) -> None:
        """Each expert parameter whole: expert-parallel rank r's fp32 block is rows ``r * E/ep ..`` of it."""
        size, shapes = int(experts["size"]), experts["shapes"]
        files = [folder / expert_blocks_file(rank) for rank in range(size)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise self._damaged(f"its expert blocks {', '.join(missing)} are missing")
        for name in experts["names"]:
            shape = tuple(shapes[name])
            block = math.prod(shape) // size
            pieces = tuple(_Piece(files[r], ("experts", name), 0, block, r * block) for r in range(size))
            self._entries[name] = _Entry(shape, torch.float32, pieces)

    def _index_stage3(self, params: list[tuple[str, Any]], sizes: list[list[int]]) -> None:
        world = len(sizes)
        offset = 0  # the same on every rank: each holds one piece of every parameter
        for name, shape in params:
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            pieces = []
            for rank in range(world):
                length = min(part, numel - rank * part)
                if length > 0:
                    pieces += self._stage3_pieces(rank, sizes[rank], offset, length, rank * part)
            self._entries[name] = _Entry(tuple(shape), torch.float32, tuple(pieces))
            offset += part
        held = sum(sizes[0])
        if offset != held:
            raise self._damaged(
                f"its parameters need {offset} elements per rank but rank 0's partitions hold {held}"
            )

    def _stage3_pieces(self, rank: int, sizes: list[int], start: int, length: int, out: int) -> list[_Piece]:
        """The range [start, start + length) of rank ``rank``'s sub-group vectors end to end, cut where one
        sub-group ends and the next begins."""
        pieces, base = [], 0
        for i, size in enumerate(sizes):
            lo, hi = max(start, base), min(start + length, base + size)
            if lo < hi:
                pieces.append(
                    _Piece(self._optim_files[rank], ("optim", i), lo - base, hi - lo, out + lo - start)
                )
            base += size
        return pieces

    def _index_frozen(self, states: dict[str, Any], stage: int) -> None:
        shapes = states.get("frozen_param_shapes") or {}
        if not shapes:
            return
        if stage <= 2:  # rank 0 holds each frozen parameter whole
            for name in shapes:
                value = states["frozen_param_fragments"][name]
                self._whole(name, value, ("frozen", name), self._model_files[0], value.dtype)
            return
        fragments = [self._load(file).get("frozen_param_fragments") or {} for file in self._model_files]
        for name, shape in shapes.items():
            numel, done, pieces = math.prod(shape), 0, []
            for file, held in zip(self._model_files, fragments, strict=True):
                length = min(held[name].numel(), numel - done)
                if length > 0:
                    pieces.append(_Piece(file, ("frozen", name), 0, length, done))
                    done += length
            dtype = fragments[0][name].dtype
            self._entries[name] = _Entry(tuple(shape), dtype, tuple(pieces))

    def _whole(self, name: str, value: torch.Tensor, key: _Key, file: Path, dtype: torch.dtype) -> None:
        piece = _Piece(file, key, 0, value.numel(), 0)
        self._entries[name] = _Entry(tuple(value.shape), dtype, (piece,))

    # --- files ---------------------------------------------------------------------------------------

    def _load(self, file: Path) -> dict[str, Any]:
        with _deepspeed_classes(self.weights_only):
            return torch_files.load(file, self.weights_only, mmap=True)

    def _damaged(self, what: str) -> ValueError:
        return ValueError(
            f"Checkpoint {str(self.path)!r} (export(checkpoint) / CLI CHECKPOINT) is not a complete DeepSpeed"
            f" ZeRO checkpoint: {what}. Its files come from different saves, or a save did not finish. Export"
            " another checkpoint, or save this one again."
        )


def _allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Every tensor the reader hands out is made here (the tests count what is alive at once)."""
    return torch.empty(shape, dtype=dtype)


def _copy(out: torch.Tensor, source: torch.Tensor, start: int) -> None:
    """Every byte the reader takes from a checkpoint file is copied here."""
    out.copy_(source[start : start + out.numel()])


def _flat(loaded: dict[str, Any], key: _Key) -> torch.Tensor:
    kind, which = key
    if kind == "optim":
        saved = loaded["optimizer_state_dict"]
        flat = saved.get("single_partition_of_fp32_groups", saved.get("fp32_flat_groups"))
        return flat[which]
    if kind == "experts":
        return loaded["blocks"][which].reshape(-1)
    tensor = loaded["frozen_param_fragments" if kind == "frozen" else "module"][which]
    return tensor.reshape(-1)


class _Saved:
    """What a DeepSpeed object in the files (a loss scaler, a partition's bookkeeping) is loaded as: its saved
    arguments and attributes, and nothing of DeepSpeed's code. The reader needs only the tensors and ints."""

    def __init__(self, *args: Any) -> None:
        self.args = args


def _deepspeed_classes(weights_only: bool | None) -> contextlib.AbstractContextManager[Any]:
    """DeepSpeed's plain classes (:data:`._pickles.DEEPSPEED_GLOBALS`) allowed to torch's restricted unpickler
    for the loads inside, each as a stand-in: ``ZeroStageEnum(3)`` as the int 3, the others as :class:`_Saved`.
    So DeepSpeed need not be installed (nor imported, seconds per export worker) to read its checkpoints."""
    if weights_only is False:
        return contextlib.nullcontext()
    stand_ins: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        (int if name.endswith(".ZeroStageEnum") else _Saved, name) for name in sorted(DEEPSPEED_GLOBALS)
    ]
    return torch.serialization.safe_globals(stand_ins)


def _natural_key(name: str) -> list[Any]:
    """``zero_pp_rank_10`` after ``zero_pp_rank_9``, as DeepSpeed orders rank files."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _natural(files: Any) -> list[Path]:
    return sorted(files, key=lambda f: _natural_key(f.name))
