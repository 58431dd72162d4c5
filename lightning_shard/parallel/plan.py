"""Which layers split how: a tensor-parallel plan, resolved against a model and applied with torch.

A plan maps module-name patterns (``"blocks.*.attn.qkv"``; ``*`` is one name component; a pattern
matches a module's full name or its tail) to a style: ``"colwise"`` (output features split: each rank
computes some of the outputs, e.g. some attention heads), ``"rowwise"`` (input features split; the
partial outputs are summed), ``"sequence"`` (a norm that runs on the rank's slice of the sequence), or
any torch ``ParallelStyle``. With ``"sequence"`` in a plan the activations between the split layers of
the repeated blocks stay split along the sequence (Megatron's sequence parallelism): column-split
layers gather the sequence, row-split layers scatter it again, the first block splits it and the last
one gathers it back.

``tensor_parallel_plan=None`` uses the plan the model carries: a ``tensor_parallel_plan`` mapping on
any of its modules (the demo GPT has one), or a Hugging Face model's ``config.base_model_tp_plan``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_shard._modules import detect_block_classes
from lightning_shard.parallel.hf_styles import (
    PARAMETER_STYLES,
    ExpertsTensorParallel,
    ReplicatedGradAllReduce,
)

log = logging.getLogger(__name__)

STYLES = ("colwise", "rowwise", "sequence")
# Hugging Face plan styles with a direct torch equivalent (others are refused by name).
_HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "sequence_parallel": "sequence"}
# Hugging Face styles for the vocabulary ends (embedding, language-model head): those stay whole here, as
# they are often tied to each other; the layers in between are split.
_HF_KEEP_WHOLE = ("embedding_rowwise", "colwise_gather_output", "colwise_rep", "rowwise_rep", "gather_output")
# Wrappers that insert a name component without changing what the model is.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
_HEAD_ATTRS = ("n_heads", "num_heads", "num_attention_heads", "num_key_value_heads", "n_kv_heads")

PlanSpec = Mapping[str, Any]


def check_plan_flag(plan: Any) -> dict[str, Any] | None:
    """Construction-time check of ``tensor_parallel_plan``: a mapping of patterns to known styles."""
    if plan is None:
        return None
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(
            f"ShardStrategy(tensor_parallel_plan={plan!r}) must be a non-empty mapping from module-name patterns"
            ' to styles, e.g. {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"}.'
        )
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"ShardStrategy(tensor_parallel_plan=...) key {pattern!r} is not a module-name pattern."
            )
        if isinstance(style, ParallelStyle):
            continue
        if style not in STYLES:
            raise ValueError(
                f"ShardStrategy(tensor_parallel_plan={{{pattern!r}: {style!r}}}): unknown style {style!r}. Use"
                f" one of {', '.join(repr(s) for s in STYLES)} or a torch.distributed.tensor.parallel.ParallelStyle."
            )
    return dict(plan)


def clean_name(name: str) -> str:
    """A module name without the components wrappers insert (activation checkpointing, compile)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _pattern(pattern: str, anchored: bool) -> re.Pattern[str]:
    body = r"[^.]+".join(re.escape(part) for part in pattern.split("*"))
    return re.compile(("^" if anchored else r"(?:^|.*\.)") + body + "$")


def carried_plan(model: nn.Module, experts_whole: bool = False) -> tuple[dict[str, Any], str] | None:
    """The plan the model carries, with patterns anchored at ``model``, and where it was found.

    ``experts_whole``: expert parallelism holds the experts (each rank its own, whole), so a Hugging Face plan's
    entries for the experts modules and their weights are left out: the experts are replicated over the
    tensor-parallel ranks, which route the same tokens, as torchtitan's non-ETP layout keeps them."""
    for name, module in model.named_modules():
        own = getattr(module, "tensor_parallel_plan", None)  # a class or an instance attribute
        prefix = clean_name(name)
        if isinstance(own, Mapping) and own:
            return _prefixed(own, prefix), f"{type(module).__name__}.tensor_parallel_plan"
        # A Hugging Face model (it names its base model); a module that merely keeps a config is not one.
        base = getattr(module, "base_model_prefix", None)
        hf_plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if isinstance(base, str) and isinstance(hf_plan, Mapping) and hf_plan:
            if base and hasattr(module, base):
                prefix = f"{prefix}.{base}" if prefix else base
            where = f"{type(module).__name__}.config.base_model_tp_plan"
            return _prefixed(_hf_styles(hf_plan, where, experts_whole), prefix), where
    return None


def _hf_styles(hf_plan: Mapping[str, Any], where: str, experts_whole: bool) -> dict[str, Any]:
    """A Hugging Face plan in this module's terms: torch's styles by name, transformers' own styles as the
    ``ParallelStyle`` objects of :mod:`.hf_styles` (an experts module's parameter entries folded into its style)."""
    experts_modules = [p for p, style in hf_plan.items() if style == "moe_tp_experts"]
    owned = {
        pattern: owner
        for owner in experts_modules
        for pattern in hf_plan
        if pattern.startswith(f"{owner}.") and "." not in pattern[len(owner) + 1 :]
    }
    styles: dict[str, Any] = {}
    for pattern, style in hf_plan.items():
        if experts_whole and (pattern.endswith(".experts") or ".experts." in pattern):
            log.info("ShardStrategy: %s (%r in %s) is expert parallelism's, whole.", pattern, style, where)
            continue
        if style in _HF_KEEP_WHOLE:
            log.info(
                "ShardStrategy: %s (%r in %s) stays whole on every tensor-parallel rank.",
                pattern,
                style,
                where,
            )
            continue
        if pattern in owned:
            continue  # a parameter of an experts module: split by that module's style
        if style == "moe_tp_experts":
            parameters = {p[len(pattern) + 1 :]: hf_plan[p] for p, owner in owned.items() if owner == pattern}
            unknown = {name: s for name, s in parameters.items() if s not in PARAMETER_STYLES}
            if unknown:
                raise ValueError(
                    f"ShardStrategy(tensor_parallel_plan=None): the plan {where} splits the parameters {unknown} of"
                    f" {pattern!r} with styles that have no torch equivalent here. Pass tensor_parallel_plan="
                    " yourself, or expert_parallel_size= to hold the experts whole."
                )
            styles[pattern] = ExpertsTensorParallel(parameters)
        elif style == "replicated_with_grad_allreduce":
            styles[pattern] = ReplicatedGradAllReduce()
        elif style in _HF_STYLES:
            styles[pattern] = _HF_STYLES[style]
        else:
            raise ValueError(
                f"ShardStrategy(tensor_parallel_plan=None): the plan {where} carries the style {style!r}"
                f" for {pattern!r}, which has no torch equivalent here. Pass tensor_parallel_plan= yourself"
                f" (styles {', '.join(repr(s) for s in STYLES)} or torch ParallelStyle objects)."
            )
    return styles


def _prefixed(plan: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in plan.items()}


def resolve_plan(
    model: nn.Module, plan: PlanSpec | None, tp_size: int, experts_whole: bool = False
) -> dict[str, Any]:
    """Module name (as ``model.named_modules()`` gives it) -> style, every pattern checked against the model.

    Raises ``ValueError`` naming the flag when no plan is available, a pattern matches no module, a module
    is matched twice, or a split dimension / head count is not divisible by ``tp_size``.
    """
    anchored = plan is None
    if plan is None:
        found = carried_plan(model, experts_whole)
        if found is None:
            raise ValueError(
                f"ShardStrategy(tensor_parallel_size={tp_size}) needs a plan: {type(model).__name__} carries none"
                " (no tensor_parallel_plan attribute, no Hugging Face base_model_tp_plan). Pass"
                ' tensor_parallel_plan={"<pattern>": "colwise" | "rowwise" | "sequence", ...}, e.g.'
                ' {"layers.*.attn.q_proj": "colwise", "layers.*.attn.o_proj": "rowwise"}.'
            )
        plan = found[0]
    named = [(name, clean_name(name), module) for name, module in model.named_modules() if name]
    resolved: dict[str, Any] = {}
    for pattern, style in plan.items():
        regex = _pattern(pattern, anchored)
        hits = [(name, module) for name, clean, module in named if regex.match(clean)]
        if not hits and anchored:
            # a carried plan names the layers of every variant of its family (dense MLPs a model of experts lacks)
            log.info(
                "ShardStrategy: %s of the carried plan matches no module of %s.",
                pattern,
                type(model).__name__,
            )
            continue
        if not hits:
            examples = [clean for _, clean, m in named if isinstance(m, (nn.Linear, nn.Embedding))][:6]
            raise ValueError(
                f"ShardStrategy(tensor_parallel_plan=...): the pattern {pattern!r} matches no module of"
                f" {type(model).__name__}. '*' stands for one name component; module names look like"
                f" {', '.join(examples) or '(no Linear / Embedding modules)'}."
            )
        for name, module in hits:
            if name in resolved:
                raise ValueError(
                    f"ShardStrategy(tensor_parallel_plan=...): {clean_name(name)} is matched by more than one"
                    f" pattern (the last is {pattern!r}). Give each module one style."
                )
            if isinstance(style, str):
                _check_divisible(model, name, module, style, tp_size)
            resolved[name] = style
    sequence = [name for name, style in resolved.items() if style == "sequence"]
    if sequence:
        _sequence_region(model, sequence)  # the split sequence must enter and leave at block boundaries
    return resolved


def _check_divisible(model: nn.Module, name: str, module: nn.Module, style: str, tp: int) -> None:
    flag = f"ShardStrategy(tensor_parallel_size={tp})"
    if style in ("colwise", "rowwise"):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ValueError(
                f"ShardStrategy(tensor_parallel_plan=...): {clean_name(name)} is a {type(module).__name__};"
                f" {style!r} splits nn.Linear and nn.Embedding only. Give it a torch ParallelStyle instead."
            )
        if isinstance(module, nn.Linear):
            dim, size = (
                ("out_features", module.out_features)
                if style == "colwise"
                else ("in_features", module.in_features)
            )
        else:
            dim, size = (
                ("embedding_dim", module.embedding_dim)
                if style == "colwise"
                else ("num_embeddings", module.num_embeddings)
            )
        if size % tp:
            raise ValueError(
                f"{flag} does not divide {clean_name(name)}.{dim}={size}, which {style!r} splits. Use a"
                f" tensor_parallel_size that divides {size}, or leave this module out of the plan."
            )
    # Attention heads are split whole: every head count on the way down to this module must divide.
    parts = name.split(".")
    for depth in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:depth]))
        for source in (owner, getattr(owner, "config", None)):
            for attr in _HEAD_ATTRS:
                heads = getattr(source, attr, None)
                if isinstance(heads, int) and not isinstance(heads, bool) and heads % tp:
                    where = clean_name(".".join(parts[:depth])) or type(model).__name__
                    what = f"{where}.config.{attr}" if source is not owner else f"{where}.{attr}"
                    raise ValueError(
                        f"{flag} does not divide {what}={heads}: each rank must hold whole attention heads."
                        f" Use a tensor_parallel_size that divides {heads}."
                    )


def to_styles(model: nn.Module, resolved: Mapping[str, Any], float8_wire: bool = True) -> dict[str, Any]:
    """torch ``ParallelStyle`` objects for a resolved plan, with sequence parallelism's entry and exit;
    torchao's float8 styles for the ``Float8Linear`` layers they suit (``float8_wire``: the tensor-parallel
    backend carries float8 tensors)."""
    sequence = [name for name, style in resolved.items() if style == "sequence"]
    region = _sequence_region(model, sequence) if sequence else []
    inside = tuple(f"{block}." for block in region)
    styles: dict[str, Any] = {}
    for name, style in resolved.items():
        split_seq = name.startswith(inside) if inside else False
        float8 = _float8_styles(model.get_submodule(name), split_seq, float8_wire)
        colwise, rowwise = float8 or (ColwiseParallel, RowwiseParallel)
        if style == "colwise":
            styles[name] = colwise(input_layouts=Shard(1)) if split_seq else colwise()
        elif style == "rowwise":
            styles[name] = rowwise(output_layouts=Shard(1)) if split_seq else rowwise()
        elif style == "sequence":
            styles[name] = SequenceParallel()
        else:
            styles[name] = style
    if region:
        first, last = region[0], region[-1]
        enter: dict[str, Any] = {"input_layouts": (Replicate(),), "desired_input_layouts": (Shard(1),)}
        leave: dict[str, Any] = {"output_layouts": (Shard(1),), "desired_output_layouts": (Replicate(),)}
        if first == last:
            styles[first] = PrepareModuleInputOutput(
                **enter, **leave, use_local_input=True, use_local_output=True
            )
        else:
            styles[first] = PrepareModuleInput(**enter, use_local_output=True)
            styles[last] = PrepareModuleOutput(**leave, use_local_output=True)
    return styles


def _float8_styles(module: nn.Module, split_seq: bool, float8_wire: bool) -> tuple[type, type] | None:
    """torchao's column / row styles for a ``Float8Linear`` (``ShardStrategy(fp8=...)`` converts before the
    split, torchtitan's order), or ``None``: torch's styles.

    They split the weight as torch's do; the layer's input is cast to float8 before its layout changes (with
    sequence parallelism the all-gather of the activations carries float8), and its output gradient is
    cast once, with one scale from its maximum over every rank's slice. torch's styles keep the layer as
    ``Float8Linear`` too, which then casts the split operands itself with scales over every slice: the
    same matmuls, in high precision on the wire. torch's styles are kept where torchao's would change the
    result or cannot run:

    - a layer scaled per row (``'rowwise'`` recipe): torchao's styles assume one scale per tensor;
    - a layer with a bias: the bias gradient would be summed from the float8-cast output gradient
      (``float8_e5m2``, 2 mantissa bits) instead of the high-precision one;
    - a sequence-split input where the backend carries no float8 (gloo: ``RuntimeError: Invalid scalar
      type`` in the all-gather of the float8 activations).
    """
    if type(module).__name__ != "Float8Linear" or getattr(module, "bias", None) is not None:
        return None
    if split_seq and not float8_wire:
        return None
    from torchao.float8.config import ScalingGranularity  # optional dependency (the fp8 extra)
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    config: Any = module.config
    casts = (config.cast_config_input, config.cast_config_grad_output)
    if any(cast.scaling_granularity != ScalingGranularity.TENSORWISE for cast in casts):
        return None
    return Float8ColwiseParallel, Float8RowwiseParallel


def _sequence_region(model: nn.Module, sequence: list[str]) -> list[str]:
    """The names of the repeated blocks that hold ``"sequence"`` modules, in model order."""
    classes = detect_block_classes(model)
    blocks = [name for name, m in model.named_modules() if classes and isinstance(m, classes)]
    region: list[str] = []
    for name in sequence:
        owner = next((b for b in blocks if name.startswith(f"{b}.")), None)
        if owner is None:
            raise ValueError(
                f"ShardStrategy(tensor_parallel_plan=...): {clean_name(name)} is 'sequence' but is not inside"
                " one of the model's repeated blocks. Sequence parallelism runs on the norms inside the blocks"
                " (between their split layers); give modules outside them 'colwise', 'rowwise' or no style."
            )
        region.append(owner)
    ordered = [b for b in blocks if b in set(region)]
    first, last = blocks.index(ordered[0]), blocks.index(ordered[-1])
    if ordered != blocks[first : last + 1]:
        raise ValueError(
            "ShardStrategy(tensor_parallel_plan=...): 'sequence' must cover consecutive blocks (the sequence is"
            f" split on entry to {clean_name(ordered[0])} and gathered after {clean_name(ordered[-1])})."
        )
    return ordered


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: Any, plan: PlanSpec | None, experts_whole: bool = False
) -> dict[str, Any]:
    """Split ``model``'s layers over ``tp_mesh`` (before FSDP2 shards them); returns the resolved plan.
    ``experts_whole``: expert parallelism holds the experts (see :func:`carried_plan`)."""
    resolved = resolve_plan(model, plan, tp_mesh.size(), experts_whole)
    float8_wire = dist.get_backend(tp_mesh.get_group()) != "gloo"  # gloo has no float8 dtype
    parallelize_module(model, tp_mesh, to_styles(model, resolved, float8_wire))
    return resolved


__all__ = [
    "STYLES",
    "apply_tensor_parallel",
    "carried_plan",
    "check_plan_flag",
    "clean_name",
    "resolve_plan",
    "to_styles",
]
