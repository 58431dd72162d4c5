"""Model state per place, tensor by tensor, as the job lays it out: which rank holds what of each parameter.

The even split ``Ψ / N`` of :mod:`.memory` is what a rank holds on average. A rank holds more or less than that:

- tensor parallelism splits only the layers its plan names (the model's carried plan: Hugging Face's
  ``base_model_tp_plan`` or the model's ``tensor_parallel_plan``), by whole rows or columns; the rest (embeddings
  and the head kept whole, norms) is whole on every tensor-parallel rank;
- pipeline stage ``s`` holds its run of blocks (cut as the strategy cuts them: balanced by parameter count,
  embeddings on the first stage, the final norm and head on the last);
- expert parallelism leaves ``E / e`` experts of each experts module on a rank (split by their dim 0), whole over
  the tensor-parallel ranks, sharded over the ``N / e`` ranks that hold the same block;
- FSDP2 (stages 2-3) shards every parameter by dim 0 over its shard group of ``k`` ranks: rank ``i`` keeps
  ``c = ceil(n / k)`` rows, of which ``max(0, min(c, n - i c))`` are real and the rest padding. Parameters and
  gradients are held at the padded size (FSDP2 allocates each shard padded; the reduce-scatter writes padded
  shards), the optimizer's state at the real one. A tensor with ``n < k`` rows costs every rank one padded row
  and ranks past ``n`` hold none of it: 32 experts sharded over 256 ranks cost each rank one expert's bytes;
- stages 0-1 keep every parameter and gradient whole (DDP); stage 1 partitions the optimizer state by whole
  parameters, largest first onto the least loaded rank (``ZeroRedundancyOptimizer``'s greedy partition);
- Adam keeps two states of the parameter's dtype per element and a one-element float32 ``step`` per tensor.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_shard.expert_parallel import ExpertLayout, planned_experts
from lightning_shard.parallel.hf_styles import ExpertsTensorParallel, parameter_placement
from lightning_shard.parallel.plan import resolve_plan
from lightning_shard.pipeline import balanced_starts, plan_stages

log = logging.getLogger(__name__)

BEFORE, AFTER, BOTH_ENDS = -1, -2, -3
"""Where a tensor outside the blocks sits: before them (first stage), after them (last stage), or both (a head
tied to the input embedding: each end keeps its copy)."""


@dataclass(frozen=True)
class Tensor:
    """One parameter: its shape and how each parallelism splits it."""

    shape: tuple[int, ...]
    trainable: bool
    block: int
    """Its block's index, or :data:`BEFORE` / :data:`AFTER` / :data:`BOTH_ENDS`."""
    tp_dim: int | None
    """The dimension tensor parallelism splits (None: whole), with the experts split by the plan too."""
    tp_dim_ep: int | None
    """The same under expert parallelism, which holds the experts whole over the tensor-parallel ranks."""
    expert: int = 0
    """1: an experts module's parameter (sharded over the ranks holding its block under expert parallelism);
    2: one of its expert weights too (dim 0 split ``e`` ways)."""


@dataclass(frozen=True, eq=False)
class TensorTable:
    """Every parameter of a model (tied ones once), and what the pipeline cut weighs. Compared (and cached) by
    identity: one table per model read."""

    tensors: tuple[Tensor, ...]
    block_numel: tuple[int, ...]
    before_numel: int
    after_numel: int

    def stage_starts(self, pp: int) -> tuple[int, ...]:
        return _starts(self.block_numel, pp, self.before_numel, self.after_numel)

    @functools.cached_property
    def groups(self) -> tuple[dict[int, tuple[Tensor, ...]], tuple[int, ...]]:
        """The tensors by place (block index, or an end), and each block's first block of identical tensors: a
        model's blocks come in a few kinds (dense, with experts), each read once per layout."""
        by_place: dict[int, list[Tensor]] = {}
        for t in self.tensors:
            by_place.setdefault(t.block, []).append(t)
        frozen = {place: tuple(ts) for place, ts in by_place.items()}
        first: dict[tuple[Tensor, ...], int] = {}
        kinds = tuple(first.setdefault(frozen.get(b, ()), b) for b in range(len(self.block_numel)))
        return frozen, kinds


@functools.lru_cache(maxsize=64)
def _starts(costs: tuple[int, ...], pp: int, head: int, tail: int) -> tuple[int, ...]:
    return balanced_starts(list(costs), pp, head, tail)


def _tp_dims(model: nn.Module, experts_whole: bool) -> dict[str, int]:
    """Parameter name -> the dimension the model's carried tensor-parallel plan splits (absent: whole)."""
    try:
        resolved = resolve_plan(model, None, 1, experts_whole)
    except ValueError as err:  # no plan, or one the strategy refuses: tensor parallelism splits nothing here
        log.info("planner: no tensor-parallel plan to split %s by (%s)", type(model).__name__, err)
        return {}
    dims: dict[str, int] = {}
    for name, style in resolved.items():
        module = model.get_submodule(name)
        linear, embedding = isinstance(module, nn.Linear), isinstance(module, nn.Embedding)
        if style == "colwise" and (linear or embedding):
            dims[f"{name}.weight"] = 1 if embedding else 0
            if linear and module.bias is not None:
                dims[f"{name}.bias"] = 0
        elif style == "rowwise" and (linear or embedding):
            dims[f"{name}.weight"] = 0 if embedding else 1
        elif isinstance(style, ExpertsTensorParallel):
            for param, how in style.parameters.items():
                ndim = getattr(module, param).ndim
                dims[f"{name}.{param}"] = getattr(parameter_placement(how, ndim), "dim", 0)
    return dims


def tensor_table(model: nn.Module) -> TensorTable | None:
    """The table of ``model`` (on the meta device is enough), or None when it holds no block list."""
    try:
        cut = plan_stages(model, 1)
    except ValueError:
        return None
    experts: dict[str, int] = {}
    try:
        for owner, module in planned_experts(model):
            split = set(ExpertLayout.of(module, owner).expert_parameters)
            for local, _ in module.named_parameters():
                experts[f"{owner}.{local}"] = 2 if local in split else 1
    except ValueError:
        experts = {}
    split_tp, split_ep = _tp_dims(model, False), _tp_dims(model, True)
    ends: dict[str, int] = {}
    for modules, end in ((cut.before, BEFORE), (cut.after, AFTER)):
        for module_name in modules:
            for param_name, _ in model.get_submodule(module_name).named_parameters(remove_duplicate=False):
                key = f"{module_name}.{param_name}"
                ends[key] = BOTH_ENDS if ends.get(key, end) != end else end
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    tensors = []
    container = f"{cut.container}."
    for name, param in model.named_parameters():
        names = aliases[id(param)]
        inside = [int(n[len(container) :].split(".", 1)[0]) for n in names if n.startswith(container)]
        ends_of = {ends[n] for n in names if n in ends}
        where = inside[0] if inside else BOTH_ENDS if len(ends_of) > 1 else next(iter(ends_of), BEFORE)
        tensors.append(
            Tensor(
                tuple(param.shape),
                param.requires_grad,
                where,
                split_tp.get(name),
                split_ep.get(name),
                experts.get(name, 0),
            )
        )
    blocks = list(model.get_submodule(cut.container).children())
    return TensorTable(
        tuple(tensors),
        tuple(sum(p.numel() for p in block.parameters()) for block in blocks),
        sum(sum(p.numel() for p in model.get_submodule(m).parameters()) for m in cut.before),
        sum(sum(p.numel() for p in model.get_submodule(m).parameters()) for m in cut.after),
    )


@dataclass(frozen=True)
class Sharding:
    """The layout of one configuration as the table is read for it."""

    tp: int
    pp: int
    shard: int
    """``k``: the ranks FSDP2 shards over (stages 2-3), or that partition the optimizer state (stage 1)."""
    ep: int
    zero: int
    """The ZeRO stage."""
    param_bytes: int
    states: int
    """Optimizer states per element (Adam: 2)."""
    step_bytes: int
    """Bytes per tensor of the optimizer's scalar state (Adam's float32 ``step``: 4)."""


@dataclass(frozen=True)
class Place:
    """Model state of the rank at ``index`` of its shard group on pipeline stage ``stage``."""

    stage: int
    index: int
    parameters: int
    gradients: int
    optimizer: int

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def _local(t: Tensor, s: Sharding) -> tuple[int, int]:
    """(rows, elements per row) of this rank's tensor-parallel / expert-parallel piece of ``t``."""
    shape = list(t.shape) or [1]
    dim = t.tp_dim_ep if s.ep > 1 else t.tp_dim
    if dim is not None and s.tp > 1:
        shape[dim] = -(-shape[dim] // s.tp)
    if s.ep > 1 and t.expert == 2:
        shape[0] //= s.ep
    return shape[0], math.prod(shape[1:])


def _group(t: Tensor, s: Sharding, index: int) -> tuple[int, int]:
    """(ranks, this rank's index among them) of the group ``t`` is sharded over."""
    if s.ep > 1 and t.expert:
        return s.shard // s.ep, index // s.ep
    return s.shard, index


def place_state(table: TensorTable, s: Sharding, stage: int, index: int) -> Place:
    """Bytes of the rank at ``index`` of its shard group on pipeline stage ``stage`` (module docstring)."""
    by_place, kinds = table.groups
    starts = table.stage_starts(s.pp) if s.pp > 1 else (0,)
    end = starts[stage + 1] if stage + 1 < len(starts) else len(kinds)
    counts: dict[int, int] = {}
    for block in range(starts[stage], end):
        counts[kinds[block]] = counts.get(kinds[block], 0) + 1
    first, last = stage == 0, stage == s.pp - 1
    ends = [BEFORE] * first + [AFTER] * last + [BOTH_ENDS] * (first or last)
    totals = [0, 0, 0]
    sizes: dict[int, list[int]] = {}
    for place, times in [*counts.items(), *((end_, 1) for end_ in ends)]:
        params, grads, optim_bytes, partitioned = _part(table, by_place.get(place, ()), s, index)
        totals = [totals[0] + times * params, totals[1] + times * grads, totals[2] + times * optim_bytes]
        for ranks, numels in partitioned.items():
            sizes.setdefault(ranks, []).extend(numels * times)
    optim = totals[2]
    for ranks, numels in sizes.items():  # stage 1: the optimizer state partitioned by whole tensors
        count, elements = _greedy(tuple(numels), ranks, index if ranks == s.shard else index // s.ep)
        optim += elements * s.states * s.param_bytes + count * s.step_bytes
    return Place(stage, index, totals[0] * s.param_bytes, totals[1] * s.param_bytes, optim)


def _part(
    table: TensorTable, tensors: tuple[Tensor, ...], s: Sharding, index: int
) -> tuple[int, int, int, dict[int, list[int]]]:
    """(parameter elements, gradient elements, optimizer bytes, stage 1's tensor sizes by group) of ``tensors``
    on the rank at ``index``, cached on the table."""
    if not tensors:
        return 0, 0, 0, {}
    cache: dict[Any, Any] = table.__dict__.setdefault("_parts", {})
    key = (tensors[0].block, s, index)
    if key not in cache:
        params = grads = optim = 0
        partitioned: dict[int, list[int]] = {}
        for t in tensors:
            rows, rest = _local(t, s)
            ranks, mine = _group(t, s, index)
            stored = real = rows * rest
            if s.zero >= 2:
                chunk = -(-rows // ranks)
                stored, real = chunk * rest, max(0, min(chunk, rows - mine * chunk)) * rest
            params += stored
            if not t.trainable:
                continue
            grads += stored
            if s.zero == 1:
                partitioned.setdefault(ranks, []).append(rows * rest)
            else:
                optim += real * s.states * s.param_bytes + s.step_bytes
        cache[key] = (params, grads, optim, partitioned)
    return cache[key]


def _greedy(sizes: tuple[int, ...], ranks: int, index: int) -> tuple[int, int]:
    """(tensors, elements) ``ZeroRedundancyOptimizer`` gives rank ``index`` of ``ranks``: largest first, each
    onto the rank holding the fewest elements so far (the lowest such rank)."""
    heap = [(0, rank, 0) for rank in range(ranks)]
    for size in sorted(sizes, reverse=True):
        load, rank, count = heapq.heappop(heap)
        heapq.heappush(heap, (load + size, rank, count + 1))
    load, _, count = next(entry for entry in heap if entry[1] == index)
    return count, load


def places(table: TensorTable, s: Sharding) -> tuple[Place, ...]:
    """The first and the last rank of the shard group on each pipeline stage."""
    indices = sorted({0, s.shard - 1})
    return tuple(place_state(table, s, stage, i) for stage in range(s.pp) for i in indices)
