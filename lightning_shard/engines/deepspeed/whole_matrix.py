"""Optimizers whose update needs whole matrices (Muon, Shampoo, SOAP) under DeepSpeed ZeRO-1/2/3: the user's
optimizer, stepped on whole matrices over DeepSpeed's partitions.

ZeRO flattens each param group into one fp32 partition per rank (ZeRO-3: one per sub-group) and calls the
optimizer on those 1-D tensors; torch's Muon refuses them and SOAP would precondition a slice of many matrices.
DeepSpeed's own Muon (config optimizer ``Muon``) runs inside its gradient reduction with its own momentum and
Newton-Schulz settings: a different optimizer from the one the user returned. So DeepSpeed keeps everything it
does (the reduction, loss scaling, clipping over the whole gradient's norm, fp32 master weights, the gather of
the updated weights) and only its call of the optimizer on a partition changes:

1. every parameter has one owner among the data-parallel ranks: the rank whose partition holds it whole where
   one does (most parameters at ZeRO-1/2: nothing moves), else one chosen by size (largest first, to the rank
   owning the fewest elements; every parameter at ZeRO-3, where each rank holds a slice of each);
2. a split parameter's fragments of gradient and fp32 master weight are summed onto its owner (zeros elsewhere),
   one parameter at a time: the whole matrix;
3. the owner runs the user's optimizer over stand-ins holding its whole matrices, in one call per DeepSpeed
   call (the user's code, hyperparameters and LR schedule as they are); the state lives on the owner only, kept
   by parameter name outside ``optimizer.state`` between steps (DeepSpeed reads that by its flat partitions);
4. the owner broadcasts each updated split matrix; every rank copies its fragment back into its partition,
   which DeepSpeed then casts and gathers as always.

Each call of the user's optimizer steps whole parameters: exact for optimizers whose update of a parameter reads
only that parameter's gradient, state and the group's scalars, as the FSDP engine's whole-matrix step assumes
(:mod:`._whole_matrix`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_shard._optim import replace_step
from lightning_shard.checkpoint.layout import DEEPSPEED_TAG
from lightning_shard.engines import _named_state as named_state

_MARK = "_lightning_shard_zero_whole_matrix"
#: Each rank's owned entries of the optimizer state, beside DeepSpeed's files in a checkpoint.
STATE_FILE = "whole_matrix_states_rank_{:02d}.pt"


@dataclass
class _Piece:
    """One parameter within one flat fp32 partition: its elements ``[start, start + length)`` (of the flattened
    parameter) lie at ``at`` in this rank's partition."""

    name: str
    shape: torch.Size
    numel: int
    start: int
    length: int
    at: int
    owner: int = 0  # index in the data-parallel group
    local: bool = False  # held whole by its owner's partition: nothing to gather or broadcast


def _pieces(zero: Any, names: dict[int, str]) -> list[tuple[torch.Tensor, list[_Piece]]]:
    """``(flat fp32 partition, its parameters)`` of every group DeepSpeed steps, as this rank holds them."""
    out = []
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3: each rank holds one slice of each parameter
        rank = dist.get_rank(zero.dp_process_group)
        for flat, params in zip(zero.fp32_partitioned_groups_flat, zero.fp16_groups, strict=True):
            pieces, at = [], 0
            for p in params:
                size = p.partition_numel()
                start = rank * size
                length = max(0, min(size, p.ds_numel - start))
                pieces.append(_Piece(names[id(p)], p.ds_shape, p.ds_numel, start, length, at))
                at += size
            out.append((flat, pieces))
        return out
    for flat, params in zip(zero.single_partition_of_fp32_groups, zero.bit16_groups, strict=True):
        pieces = []
        for p in params:  # ZeRO-1/2: the group flattened, cut in equal partitions
            mapping = getattr(p, "_hp_mapping", None)
            start, length, at = (
                (0, 0, 0)
                if mapping is None
                else (
                    mapping.lp_fragment_address.start,
                    mapping.lp_fragment_address.numel,
                    mapping.hp_fragment_address.start,
                )
            )
            pieces.append(_Piece(names[id(p)], p.shape, p.numel(), start, length, at))
        out.append((flat, pieces))
    return out


def _assign_owners(flats: list[tuple[torch.Tensor, list[_Piece]]], group: Any, device: torch.device) -> None:
    """Owners by the rule of the module docstring, the same on every rank (from every rank's fragment lengths)."""
    pieces = [piece for _, ps in flats for piece in ps]
    world = dist.get_world_size(group)
    mine = torch.tensor([piece.length for piece in pieces], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    lengths = torch.stack(every).cpu()  # [rank, piece]
    load = [0] * world
    split = []
    for j, piece in enumerate(pieces):
        whole = [r for r in range(world) if int(lengths[r, j]) == piece.numel]
        if whole:
            piece.owner, piece.local = whole[0], True
            load[whole[0]] += piece.numel
        else:
            split.append(piece)
    for piece in sorted(split, key=lambda q: -q.numel):  # stable: ties in parameter order
        piece.owner = min(range(world), key=load.__getitem__)
        load[piece.owner] += piece.numel


class ZeroWholeMatrixStep:
    """The user's optimizer over DeepSpeed ZeRO's flat partitions, each parameter whole on its owner."""

    def __init__(self, zero: Any, names: dict[int, str], device: torch.device) -> None:
        self.optimizer: Optimizer = zero.optimizer
        self.group = zero.dp_process_group
        self.rank = dist.get_rank(self.group)
        self.device = device  # where the collectives run (the flat partitions may be offloaded to the CPU)
        self.flats = _pieces(zero, names)
        _assign_owners(self.flats, self.group, device)
        self.by_flat = {id(flat): pieces for flat, pieces in self.flats}
        self.stand_ins = {
            piece.name: nn.Parameter(torch.empty(0, dtype=flat.dtype, device=flat.device))
            for flat, pieces in self.flats
            for piece in pieces
            if piece.owner == self.rank
        }
        #: The optimizer state of the parameters this rank owns, by name.
        self.state: dict[str, dict[str, Any]] = {}
        #: Bytes this rank received by the steps so far: fragments summed onto it, updates broadcast to it.
        self.traffic = {"gathered": 0, "broadcast": 0}

    def step(self, step: Any, **kwargs: Any) -> None:
        groups = [(group, list(group["params"])) for group in self.optimizer.param_groups]
        touched: list[tuple[torch.Tensor, _Piece]] = []
        stepped: list[str] = []
        try:
            with torch.no_grad():
                for group, params in groups:
                    stand_ins = []
                    for flat in params:
                        for piece in self.by_flat[id(flat)]:
                            touched.append((flat, piece))
                            if self._gathered(flat, piece):
                                stand_ins.append(self.stand_ins[piece.name])
                                stepped.append(piece.name)
                    group["params"] = stand_ins
            for name in stepped:
                if name in self.state:
                    self.optimizer.state[self.stand_ins[name]] = self.state.pop(name)
            step(**kwargs)
        finally:
            for group, params in groups:
                group["params"] = params
            for name in stepped:
                state = self.optimizer.state.pop(self.stand_ins[name], None)
                if state:
                    self.state[name] = state
        with torch.no_grad():
            for flat, piece in touched:  # in the same order on every rank
                self._scatter(flat, piece)
            for stand_in in self.stand_ins.values():
                stand_in.grad = None
                stand_in.data = torch.empty(0, dtype=stand_in.dtype, device=stand_in.device)

    def _gathered(self, flat: torch.Tensor, piece: _Piece) -> bool:
        """Fill the stand-in of ``piece`` with its whole matrix and gradient if this rank owns it."""
        own = piece.owner == self.rank
        if piece.local:
            if own:  # views of the partition: the optimizer updates it in place
                stand_in = self.stand_ins[piece.name]
                stand_in.data = flat.data.narrow(0, piece.at, piece.numel).view(piece.shape)
                stand_in.grad = flat.grad.narrow(0, piece.at, piece.numel).view(piece.shape)  # type: ignore[union-attr]
            return own
        both = torch.zeros(2, piece.numel, dtype=flat.dtype, device=self.device)
        if piece.length:
            both[0, piece.start : piece.start + piece.length].copy_(flat.narrow(0, piece.at, piece.length))
            grad = flat.grad.narrow(0, piece.at, piece.length)  # type: ignore[union-attr]
            both[1, piece.start : piece.start + piece.length].copy_(grad)
        dist.reduce(both, dst=dist.get_global_rank(self.group, piece.owner), group=self.group)
        if not own:
            return False
        self.traffic["gathered"] += both.numel() * both.element_size()
        stand_in = self.stand_ins[piece.name]
        both = both.to(flat.device)
        stand_in.data, stand_in.grad = both[0].view(piece.shape), both[1].view(piece.shape)
        return True

    def _scatter(self, flat: torch.Tensor, piece: _Piece) -> None:
        if piece.local:
            return
        own = piece.owner == self.rank
        whole = (
            self.stand_ins[piece.name].data.reshape(-1).to(self.device)
            if own
            else torch.empty(piece.numel, dtype=flat.dtype, device=self.device)
        )
        dist.broadcast(whole, src=dist.get_global_rank(self.group, piece.owner), group=self.group)
        if not own:
            self.traffic["broadcast"] += whole.numel() * whole.element_size()
        if piece.length:
            flat.data.narrow(0, piece.at, piece.length).copy_(whole.narrow(0, piece.start, piece.length))

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the owned state (for the state-bytes accounting)."""
        return named_state.tensors(self.state)


def step_whole_matrices(engine: Any, device: torch.device) -> ZeroWholeMatrixStep:
    """Make DeepSpeed's ZeRO optimizer of ``engine`` step the user's optimizer on whole matrices."""
    zero = engine.optimizer
    names = {id(p): name for name, p in engine.module.named_parameters()}
    whole = ZeroWholeMatrixStep(zero, names, device)
    replace_step(whole.optimizer, functools.partial(whole.step, whole.optimizer.step))
    setattr(zero, _MARK, whole)
    return whole


def whole_matrix_step(engine: Any) -> ZeroWholeMatrixStep | None:
    found: ZeroWholeMatrixStep | None = getattr(getattr(engine, "optimizer", None), _MARK, None)
    return found


# --- checkpoints: each rank's owned entries, whole and by name, beside DeepSpeed's files -------------------


def save(engine: Any, folder: Path) -> None:
    whole = whole_matrix_step(engine)
    assert whole is not None
    tag = folder / DEEPSPEED_TAG
    tag.mkdir(parents=True, exist_ok=True)
    state = {name: named_state.copied_to(entry, torch.device("cpu")) for name, entry in whole.state.items()}
    torch.save({"state": state}, tag / STATE_FILE.format(dist.get_rank()))


def load(engine: Any, folder: Path) -> None:
    """Install the entries this rank owns, from every rank's file: any world size wrote them."""
    whole = whole_matrix_step(engine)
    assert whole is not None
    files = sorted((folder / DEEPSPEED_TAG).glob(STATE_FILE.replace("{:02d}", "*")))
    if not files:
        raise ValueError(
            f"The DeepSpeed checkpoint {str(folder)!r} holds no whole-matrix optimizer state ({STATE_FILE} files):"
            " it was written with another optimizer or without the whole-matrix step. Resume it with the optimizer"
            " it was trained with, or start from its weights (ShardStrategy(init_weights=...))."
        )
    whole.state.clear()
    for file in files:
        saved = torch.load(file, map_location="cpu", weights_only=True, mmap=True)["state"]
        for name, entry in saved.items():
            if name in whole.stand_ins:
                whole.state[name] = named_state.copied_to(entry, whole.stand_ins[name].device)
