"""Cutting a model into pipeline stages: which blocks each stage holds, and pruning a rank to its stage.

A model splits automatically when it holds a repeated block list (a GPT's ``blocks``, found as for
sharding: :func:`lightning_shard._modules.largest_block_container`). The blocks are cut into contiguous
runs; the modules registered before the block list (along the path to it: embeddings) run on the first
stage, those registered after it (final norm, head) on the last. Modules without parameters (rotary
tables, dropout) stay on every stage. Each rank then keeps only its stage: the other blocks are dropped
from the list (the kept ones keep their names, ``model.blocks.2.attn...``, so state dicts stay keyed as in
the whole model) and the other stages' modules become ``None``, which the model's forward skips (the
contract in docs/pipeline.md).

A Hugging Face model splits by the plan it carries (``config.base_model_pp_plan``: the base model's
embeddings, its layer list and its final norm, in order; the head's class attribute ``_pp_plan``): the
layer list is cut as above, and the modules a stage does not run become identities, as Hugging Face's
own pipeline code replaces them, so the model's unchanged forward runs a stage (a later stage's hidden
states go in where the token ids did; a stage before the last returns its hidden states as "logits").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

from torch import nn

from lightning_shard._modules import largest_block_container


@dataclass(frozen=True)
class StagePlan:
    """Where a model is cut: stage ``s`` holds blocks ``starts[s]`` up to ``starts[s + 1]`` of ``container``."""

    container: str
    """The block list's module name (``"model.blocks"``)."""
    starts: tuple[int, ...]
    num_blocks: int
    before: tuple[str, ...]
    """Modules with parameters that run before the blocks: on the first stage only."""
    after: tuple[str, ...]
    """Modules with parameters that run after the blocks: on the last stage only."""
    placeholder: str = "none"
    """What replaces another stage's module: ``"none"`` (the forward skips it) or ``"identity"`` (a Hugging
    Face model's forward runs it: :func:`hf_pipeline_plan`)."""
    tied: tuple[tuple[tuple[str, int], ...], ...] = ()
    """Parameters used on several stages (a head tied to the input embedding), each as ``(name, stage)``
    pairs, first stage first: every stage keeps its copy and the copies' gradients are summed each step."""

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def blocks_of(self, stage: int) -> range:
        end = self.starts[stage + 1] if stage + 1 < self.num_stages else self.num_blocks
        return range(self.starts[stage], end)

    def split_points(self) -> list[str]:
        return [f"{self.container}.{start}" for start in self.starts[1:]]


def plan_stages(model: nn.Module, num_stages: int, split_points: tuple[str, ...] | None = None) -> StagePlan:
    """Cut ``model`` into ``num_stages`` stages: at ``split_points`` (the blocks that start stages 2, 3, ...),
    or balanced by parameter count (first stage + embeddings, last stage + head)."""
    hf = hf_pipeline_plan(model)
    if hf is None:
        _check_hf_has_plan(model, num_stages)
    found = largest_block_container(model)
    if hf is not None:
        found = (hf[0], cast(nn.ModuleList, model.get_submodule(hf[0])))
    if found is None:
        raise ValueError(
            f"ShardStrategy(pipeline_parallel_size={num_stages}) cannot split {type(model).__name__}: it holds no"
            " list of identical blocks (an nn.ModuleList or nn.Sequential, e.g. a GPT's transformer layers)."
            " Hold the repeated layers in one nn.ModuleList (see docs/pipeline.md)."
        )
    name, container = found
    blocks = len(container)
    if blocks < num_stages:
        raise ValueError(
            f"ShardStrategy(pipeline_parallel_size x stages_per_rank = {num_stages} stages) needs at least one"
            f" block per stage, but {name} holds {blocks}. Use at most {blocks} stages in all."
        )
    before, after = hf[1:] if hf is not None else _around(model, name)
    if split_points is not None:
        starts = _starts_from_points(name, blocks, split_points)
    else:
        costs = [_numel(block) for block in container]
        head = sum(_numel(model.get_submodule(m)) for m in before)
        tail = sum(_numel(model.get_submodule(m)) for m in after)
        starts = balanced_starts(costs, num_stages, head, tail)
    plan = StagePlan(name, starts, blocks, before, after, "identity" if hf is not None else "none")
    return replace(plan, tied=_shared_parameters(model, plan))


def keep_stage(model: nn.Module, plan: StagePlan, stage: int | tuple[int, ...]) -> None:
    """Prune ``model`` in place to what ``stage`` (or the stages of an interleaved rank) runs: other
    stages' modules are dropped or replaced (:attr:`StagePlan.placeholder`)."""
    stages = (stage,) if isinstance(stage, int) else stage
    container = model.get_submodule(plan.container)
    keep = {str(i) for s in stages for i in plan.blocks_of(s)}
    for key in list(container._modules):
        if key not in keep:
            del container._modules[key]
    dropped = (plan.after if plan.num_stages - 1 not in stages else ()) + (
        plan.before if 0 not in stages else ()
    )
    for name in dropped:
        set_placeholder(model, plan, name)


def set_placeholder(model: nn.Module, plan: StagePlan, name: str) -> nn.Module | None:
    """Put the placeholder for another stage's module ``name`` in its place; returns what was there."""
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent)
    held = owner._modules.get(attr)
    setattr(owner, attr, nn.Identity() if plan.placeholder == "identity" else None)
    return held


def hf_pipeline_plan(model: nn.Module) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
    """``(layer list, modules before it, modules after it)`` by the pipeline plan of the outermost Hugging
    Face model in ``model`` (``config.base_model_pp_plan`` and the head's ``_pp_plan``), or ``None``."""
    for prefix, module in model.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_pp_plan", None)
        base_name = getattr(module, "base_model_prefix", None)
        if not plan or not isinstance(base_name, str):
            continue
        base = getattr(module, base_name, None) if base_name else None
        base_path = _join(prefix, base_name) if isinstance(base, nn.Module) else prefix
        base = model.get_submodule(base_path)
        keys = [k for k in plan if isinstance(getattr(base, k, None), nn.Module)]
        lists = [k for k in keys if isinstance(getattr(base, k), (nn.ModuleList, nn.Sequential))]
        if len(lists) != 1:
            raise ValueError(
                f"ShardStrategy(pipeline_parallel_size>1): the pipeline plan of {type(base).__name__}"
                f" ({list(plan)}) names {len(lists)} layer lists; it can be cut at exactly one."
            )
        cut = keys.index(lists[0])
        # the head's own entries: its class attribute (an instance's merges in the base model's, prefixed)
        own = getattr(type(module), "_pp_plan", None) or {} if base_path != prefix else {}
        head = tuple(_join(prefix, k) for k in own)
        before = tuple(_join(base_path, k) for k in keys[:cut])
        after = tuple(_join(base_path, k) for k in keys[cut + 1 :]) + head
        _check_plan_covers(model, _join(base_path, lists[0]), before + after)
        return _join(base_path, lists[0]), before, after
    return None


def _check_hf_has_plan(model: nn.Module, num_stages: int) -> None:
    """A Hugging Face model without a pipeline plan: its forward cannot run a stage (it neither skips the
    other stages' modules nor takes hidden states in place of token ids)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(getattr(module, "base_model_prefix", None), str) and hasattr(
            config, "base_model_pp_plan"
        ):
            raise ValueError(
                f"ShardStrategy(pipeline_parallel_size={num_stages}) cannot split {type(module).__name__}: its"
                " Hugging Face config carries no pipeline plan (config.base_model_pp_plan), so its forward cannot"
                " run one stage. Use a model whose config has one (Llama, Mistral, Qwen2, Gemma, ...), write"
                " the network as a module that follows docs/pipeline.md's contract, or use"
                " pipeline_parallel_size=1."
            )


def _check_plan_covers(model: nn.Module, container: str, placed: tuple[str, ...]) -> None:
    """Every parameter lies in the layer list or in a module the plan places on a stage."""
    roots = (container, *placed)
    loose = [n for n, _ in model.named_parameters() if not any(n.startswith(r + ".") for r in roots)]
    if loose:
        raise ValueError(
            f"ShardStrategy(pipeline_parallel_size>1) splits {type(model).__name__} by its Hugging Face"
            f" pipeline plan, which places no stage for {loose[:4]}. Keep extra trainable modules out of a"
            " pipelined model, or use pipeline_parallel_size=1."
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _around(model: nn.Module, container: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules with parameters registered before and after the path to ``container``, by ancestor."""
    before: list[str] = []
    after: list[str] = []
    parts = container.split(".")
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        parent = model.get_submodule(prefix)
        if any(True for _ in parent.parameters(recurse=False)):
            held = ", ".join(n for n, _ in parent.named_parameters(recurse=False))
            raise ValueError(
                f"ShardStrategy(pipeline_parallel_size>1) cannot place the parameters {held} held directly by"
                f" {prefix or type(model).__name__} on a stage. Hold them in a submodule (an nn.Linear, an"
                " nn.Embedding) registered before or after the block list."
            )
        seen = False
        for child, module in parent.named_children():
            if child == part:
                seen = True
            elif module is not None and _numel(module) > 0:
                (after if seen else before).append(f"{prefix}.{child}" if prefix else child)
    return tuple(before), tuple(after)


def _starts_from_points(container: str, blocks: int, points: tuple[str, ...]) -> tuple[int, ...]:
    valid = [f"{container}.{i}" for i in range(1, blocks)]
    starts = [0]
    for point in points:
        if point not in valid:
            raise ValueError(
                f"ShardStrategy(pipeline_split_points=[..., {point!r}, ...]) is not a block that can start a"
                f" stage. Name blocks of {container}, in order: {valid}."
            )
        index = int(point.rpartition(".")[2])
        if index <= starts[-1]:
            raise ValueError(
                f"ShardStrategy(pipeline_split_points={list(points)!r}) must name blocks in increasing order,"
                " one stage each."
            )
        starts.append(index)
    return tuple(starts)


def balanced_starts(costs: list[int], stages: int, head: int, tail: int) -> tuple[int, ...]:
    """Contiguous runs of blocks, one or more per stage, minimising the largest stage's cost.

    ``best[s][i]``: the smallest possible largest cost when the first ``i`` blocks form ``s`` stages; the
    first stage also carries ``head`` (embeddings), the last ``tail`` (head). O(stages x blocks^2).
    """
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                load = prefix[i] - prefix[j] + (head if s == 1 else 0) + (tail if s == stages else 0)
                value = max(best[s - 1][j], load)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    starts, i = [], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return tuple(reversed(starts))


def _shared_parameters(model: nn.Module, plan: StagePlan) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The parameters that more than one stage uses, each as its ``(name, stage)`` uses, by stage."""
    pieces = [(m, 0) for m in plan.before] + [(m, plan.num_stages - 1) for m in plan.after]
    pieces += [(f"{plan.container}.{i}", s) for s in range(plan.num_stages) for i in plan.blocks_of(s)]
    uses: dict[int, dict[int, str]] = {}
    for name, stage in pieces:
        for param_name, param in model.get_submodule(name).named_parameters(remove_duplicate=False):
            uses.setdefault(id(param), {}).setdefault(stage, f"{name}.{param_name}")
    return tuple(
        tuple((n, s) for s, n in sorted(by_stage.items())) for by_stage in uses.values() if len(by_stage) > 1
    )


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


__all__ = ["StagePlan", "hf_pipeline_plan", "keep_stage", "plan_stages", "set_placeholder"]
