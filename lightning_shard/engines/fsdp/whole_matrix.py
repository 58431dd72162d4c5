"""Optimizers whose update needs whole matrices (Muon, Shampoo, SOAP) over sharded or split parameters.

Muon orthogonalises each matrix's update (Newton-Schulz on the whole matrix); Shampoo and SOAP precondition it
by factors of the whole matrix. Run on FSDP2's shards (or tensor-parallel slices) they compute something else,
or fail on DTensor placement rules. Here each DTensor parameter is *owned* by one rank of the ranks that split
it (its gather group: the mesh dimensions where it is sharded; replicas, HSDP's ``replicate``, each own theirs
and compute the same update from the same reduced gradient):

1. the parameter and its gradient are gathered whole (``full_tensor``), one parameter at a time;
2. the owner runs the user's optimizer on the whole matrix: a stand-in parameter holding it, alone in its param
   group for that call, so the optimizer's own code, hyperparameters and state (momentum, preconditioners) are
   used as they are; the state lives on the owner only, keyed by the stand-in;
3. the owner broadcasts the updated matrix over the group, and every rank keeps its own shard of it.

Owners are spread by size (largest parameters first, each to the rank of the group owning the fewest
elements), so the optimizer state is partitioned across the ranks as ZeRO's is, by parameter instead of by
slice. Only one whole matrix (and its gradient) exists at a time beside the shards. Parameters that are plain
tensors (replicated, not DTensors) step as they are on every rank.

Clipping and the non-finite skip have acted on the gradients before the step (over the whole gradient's norm).
Each call of the user's optimizer steps one parameter: exact for optimizers whose update of a parameter reads
only that parameter's own gradient, state and the group's scalars (Muon, Shampoo, SOAP, AdamW, ...).
Which optimizers take this step is :mod:`lightning_shard.engines._matrix_optimizers`'s to say.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim import Optimizer

from lightning_shard._optim import replace_step
from lightning_shard.engines import _named_state as named_state
from lightning_shard.engines._matrix_optimizers import split_dims
from lightning_shard.engines._shm import shared_memory_group

_MARK = "_lightning_shard_whole_matrix"


@dataclass
class _Gather:
    """The ranks a parameter is split over: their group, and this rank's index in it."""

    group: Any
    ranks: list[int]  # global ranks, in group order
    index: int


def _gather_group(mesh: Any, dims: tuple[int, ...]) -> _Gather:
    sub = mesh[tuple(mesh.mesh_dim_names[d] for d in dims)] if len(dims) < mesh.ndim else mesh
    if sub.ndim > 1:
        sub = sub._flatten()
    group = sub.get_group()
    ranks = dist.get_process_group_ranks(group)
    return _Gather(group, ranks, ranks.index(dist.get_rank()))


def _gather_of(param: DTensor) -> _Gather | None:
    dims = split_dims(param)
    if not dims:
        return None
    if param.device_mesh.mesh_dim_names is None:
        raise ValueError(
            "A whole-matrix optimizer needs named mesh dimensions to find the ranks a parameter is split over;"
            f" {param.device_mesh} has none."
        )
    return _gather_group(param.device_mesh, dims)


def _groups_of(params: list[nn.Parameter]) -> dict[torch.Tensor, _Gather | None]:
    """Each DTensor parameter's gather group (one process group per mesh and dimensions)."""
    made: dict[tuple[int, tuple[int, ...]], _Gather | None] = {}
    out: dict[torch.Tensor, _Gather | None] = {}
    for p in params:
        if isinstance(p, DTensor):
            key = (id(p.device_mesh), split_dims(p))
            if key not in made:
                made[key] = _gather_of(p)
            out[p] = made[key]
    return out


class WholeMatrixStep:
    """The step of one optimizer over DTensor parameters, each matrix whole on its owner (module docstring)."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.gathers: dict[torch.Tensor, _Gather | None] = {}  # DTensor parameter -> its gather group
        self.owner: dict[torch.Tensor, int] = {}  # global rank of each split parameter's owner
        self.stand_ins: dict[torch.Tensor, nn.Parameter] = {}  # parameter stepped here -> its stand-in
        #: Bytes this rank received by the steps so far: whole matrices and gradients gathered, updates broadcast.
        self.traffic = {"gathered": 0, "broadcast": 0}
        load: dict[tuple[int, ...], list[int]] = {}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.gathers = _groups_of(params)
        # Largest first, ties in parameter order: the same order on every rank of a group.
        for p in sorted(params, key=lambda q: -q.numel()):
            if not isinstance(p, DTensor):
                continue
            gather = self.gathers[p]
            if gather is None:  # replicated: every rank steps its own copy
                self.stand_ins[p] = _stand_in(p)
                continue
            owned = load.setdefault(tuple(gather.ranks), [0] * len(gather.ranks))
            index = min(range(len(owned)), key=owned.__getitem__)
            owned[index] += p.numel()
            self.owner[p] = gather.ranks[index]
            if index == gather.index:
                self.stand_ins[p] = _stand_in(p)

    def owned(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """``(parameter, stand-in)`` of every parameter this rank steps whole (its optimizer state's keys)."""
        return list(self.stand_ins.items())

    def step(self, step: Any, **kwargs: Any) -> None:
        """One call of the user's optimizer over the plain parameters and this rank's whole matrices."""
        groups = [(group, list(group["params"])) for group in self.optimizer.param_groups]
        split: list[DTensor] = []
        try:
            with torch.no_grad():
                for group, params in groups:
                    group["params"] = [q for p in params if (q := self._gathered(p, split)) is not None]
            step(**kwargs)
        finally:
            for group, params in groups:
                group["params"] = params
        with torch.no_grad():
            for p in split:  # the owners' updates, one matrix at a time, in the same order on every rank
                self._scatter(p)
            for stand_in in self.stand_ins.values():
                stand_in.grad = None
                stand_in.data = torch.empty(0, dtype=stand_in.dtype, device=stand_in.device)

    def _gathered(self, p: nn.Parameter, split: list[DTensor]) -> nn.Parameter | None:
        """What the optimizer steps for ``p`` on this rank: ``p`` itself (a plain tensor), its stand-in holding
        the whole matrix (owned) or the local tensor (replicated), or nothing."""
        if not isinstance(p, DTensor):
            return p
        grad = p.grad
        stand_in = self.stand_ins.get(p)
        if self.gathers[p] is None:
            assert stand_in is not None
            stand_in.data = p.to_local()
            stand_in.grad = None if grad is None else grad.to_local()  # type: ignore[attr-defined]
            return stand_in
        if grad is None:  # no gradient on any rank of the group (one graph): no step, as torch's optimizers
            return None
        whole_grad = _whole(grad, p, self.gathers[p])
        whole = _whole(p, p, self.gathers[p])
        split.append(p)
        self.traffic["gathered"] += (
            whole.numel() * whole.element_size() + whole_grad.numel() * whole_grad.element_size()
        )
        if stand_in is None:
            return None
        stand_in.data, stand_in.grad = whole, whole_grad
        return stand_in

    def _scatter(self, p: DTensor) -> None:
        gather = self.gathers[p]
        assert gather is not None
        stand_in = self.stand_ins.get(p)
        whole = (
            stand_in.data if stand_in is not None else torch.empty(p.shape, dtype=p.dtype, device=p.device)
        )
        _broadcast(whole, p, gather, self.owner[p], stand_in is not None)
        self.traffic["broadcast"] += whole.numel() * whole.element_size()
        shard = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(shard)


def _rows(p: DTensor, ranks: int) -> list[int] | None:
    """Each rank's rows of ``p`` where it is split by rows over one mesh dimension (FSDP2's ``Shard(0)``, chunked
    as ``torch.chunk``), in the order of the ranks of its gather group; ``None`` for any other split."""
    split = [placement for placement in p.placements if not placement.is_replicate()]
    if len(split) != 1 or type(split[0]) is not Shard or split[0].dim != 0:
        return None
    total = p.shape[0]
    chunk = -(-total // ranks)
    return [max(0, min(chunk, total - i * chunk)) for i in range(ranks)]


def _whole(value: Any, p: DTensor, gather: _Gather | None) -> torch.Tensor:
    """``value`` (``p`` or its gradient) whole on every rank of ``p``'s gather group: through shared memory
    where the group's CPU ranks share a host and ``p`` is split by rows (each rank's rows are one block of the
    whole), else DTensor's all-gather."""
    assert gather is not None
    rows = _rows(p, len(gather.ranks))
    shm = shared_memory_group(gather.group) if rows is not None else None
    if isinstance(value, DTensor) and rows is not None and shm is not None:
        whole = torch.empty(p.shape, dtype=value.dtype, device=value.device)
        if shm.gather(list(whole.split(rows)), value.to_local().contiguous()):
            return whole
    return value.full_tensor() if isinstance(value, DTensor) else value


def _broadcast(whole: torch.Tensor, p: DTensor, gather: _Gather, owner: int, owns: bool) -> None:
    """The owner's ``whole`` to every rank of the group (shared memory where :func:`_whole` uses it)."""
    shm = shared_memory_group(gather.group) if _rows(p, len(gather.ranks)) is not None else None
    if shm is not None:
        empty = torch.empty(0, dtype=whole.dtype, device=whole.device)
        source = gather.ranks.index(owner)
        outputs = [whole if j == source else empty for j in range(len(gather.ranks))]
        if shm.gather(outputs, whole if owns else empty):
            return
    dist.broadcast(whole, src=owner, group=gather.group)


def _stand_in(p: DTensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)


def takes_closure(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` accepts the closure Lightning's automatic optimization passes."""
    try:
        parameters = inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return True
    return "closure" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def run_closure_first(optimizer: Optimizer) -> None:
    """For an optimizer whose ``step()`` takes no closure: Lightning's closure (forward, backward) is run first,
    then ``step()``, as the optimizers that take one do it."""
    replace_step(optimizer, optimizer.step)


def step_whole_matrices(optimizer: Optimizer) -> WholeMatrixStep | None:
    """Make ``optimizer.step`` step each of its DTensor parameters whole on its owner; ``None`` when it holds
    no DTensor parameter (nothing is split: its step is already whole)."""
    if getattr(optimizer, _MARK, None) is not None:
        marked: WholeMatrixStep = getattr(optimizer, _MARK)
        return marked
    if not any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
        return None
    whole = WholeMatrixStep(optimizer)
    replace_step(optimizer, functools.partial(whole.step, optimizer.step))
    setattr(optimizer, _MARK, whole)
    return whole


def whole_matrix_step(optimizer: Optimizer) -> WholeMatrixStep | None:
    """The :class:`WholeMatrixStep` :func:`step_whole_matrices` attached to ``optimizer``, if any."""
    found: WholeMatrixStep | None = getattr(optimizer, _MARK, None)
    return found


# --- checkpoints: name-keyed entries, each whole, written by the rank that steps the parameter -------------


def _names(model: nn.Module) -> dict[torch.Tensor, str]:
    inner = getattr(model, "module", model)
    return {p: name for name, p in inner.named_parameters()}


def _entries(whole: WholeMatrixStep, names: dict[torch.Tensor, str]) -> list[tuple[str, torch.Tensor]]:
    """``(name, the key of its state)`` of every parameter whose state lives on this rank."""
    out = []
    for group in whole.optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                out.append((names[p], p))
            elif p in whole.stand_ins:
                out.append((names[p], whole.stand_ins[p]))
    return out


def _groups(optimizer: Optimizer, names: dict[torch.Tensor, str]) -> list[dict[str, Any]]:
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
    """``{"state": {name: {...}}, "param_groups": [...]}`` as ``get_optimizer_state_dict`` lays it out, each
    entry whole: this rank's own, or every rank's if ``full``. A sharded checkpoint gets each matrix's state
    once, from its owner, so it reads back at any stage and world size."""
    whole = whole_matrix_step(optimizer)
    assert whole is not None
    names = _names(model)
    if full:  # one file, pickled by torch.save: each entry as the optimizer keeps it, on the CPU
        state = {
            name: named_state.copied_to(optimizer.state[key], torch.device("cpu"))
            for name, key in _entries(whole, names)
            if key in optimizer.state
        }
        state = named_state.on_every_rank(state)
    else:  # DCP: nested entries flat
        state = {
            name: named_state.flattened(optimizer.state[key])
            for name, key in _entries(whole, names)
            if key in optimizer.state
        }
    return {"state": state, "param_groups": _groups(optimizer, names)}


def load_target(model: nn.Module, optimizer: Optimizer, meta: Any, key: str) -> dict[str, Any]:
    """Empty whole tensors, shaped from the checkpoint's metadata, for the entries this rank holds."""
    whole = whole_matrix_step(optimizer)
    assert whole is not None
    names = _names(model)
    state = {
        name: named_state.saved_fields(
            meta, key, name, lambda md: torch.empty(md.size, dtype=md.properties.dtype)
        )
        for name, _ in _entries(whole, names)
    }
    return {"state": state, "param_groups": _groups(optimizer, names)}


def load_optimizer_state_dict(model: nn.Module, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Install the entries this rank holds (from any stage's checkpoint) and every group's hyperparameters."""
    whole = whole_matrix_step(optimizer)
    assert whole is not None
    saved = state_dict["state"]
    for name, key in _entries(whole, _names(model)):
        entry = saved.get(name)
        if entry is None:
            continue
        device = key.device if key.numel() else next(p for p, s in whole.stand_ins.items() if s is key).device
        optimizer.state[key] = named_state.copied_to(named_state.nested(entry), device)
    named_state.load_hyperparameters(optimizer.param_groups, state_dict["param_groups"])


class WholeMatrixState:
    """A whole-matrix optimizer's state (stages 2-3, tensor parallelism) as fault tolerance reads and restores it:
    each matrix's entry on its owner, by name. Rank ``r`` of every replica group owns the same matrices, so a
    peer's entries are this rank's to hold."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def holds(self, optimizer: Optimizer) -> bool:
        return whole_matrix_step(optimizer) is not None

    def state(self, optimizer: Optimizer) -> dict[str, Any]:
        return optimizer_state_dict(self.model, optimizer, full=False)

    def load(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        load_optimizer_state_dict(self.model, optimizer, state)
