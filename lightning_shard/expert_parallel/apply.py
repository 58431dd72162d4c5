"""Expert parallelism on an unchanged model: each rank keeps ``E/ep`` whole experts of every experts module and
reaches the others' through :func:`.dispatch.dispatch_combine`.

Which modules: ``plan=None`` reads the plan a Hugging Face model carries (``config.base_model_ep_plan``: the
``"ep_dispatch_experts"`` entries, e.g. Mixtral's ``layers.*.mlp.experts``, anchored at the base model); a
``plan`` maps module-name patterns (``*`` is one name component; a pattern matches a module's full name or its
tail) to ``"experts"`` (3-D expert weights, :mod:`.experts`) or ``"router"`` (named for completeness: the router
stays the model's own and replicated).

How the experts are held: every parameter with the expert on dim 0 becomes an ``nn.Parameter`` holding a
``DTensor`` placed ``Shard(0)`` on the 1-D expert-parallel ``DeviceMesh``; its local tensor is this rank's
``[E/ep, ...]`` block, its global shape the model's ``[E, ...]``. Why not a plain ``[E/ep, ...]`` tensor: the
state dict then says where each block sits in the whole (DCP reshards a checkpoint between expert-parallel
sizes and to/from runs without EP from that alone; transformers and torchtitan hold experts the same way, so
their checkpoints line up), FSDP2 can shard the blocks further over the data-parallel ranks left (a DTensor
parameter on a sibling mesh, as with tensor parallelism), and a norm over the gradients (clipping) counts each
expert once and fails loudly when mixed with plain tensors instead of silently counting one rank's experts only.
The cost: a clip across the experts and the rest must reduce per mesh (as ``lightning_shard.parallel`` does for
tensor parallelism), and ``foreach=True`` optimizers refuse the mix (torch's default ``foreach=None`` steps it).

The experts module's forward is replaced (an instance attribute: the class and every other module of the model
are untouched); routing, its normalisation, aux / z losses, shared experts and the activation stay the model's.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_shard.expert_parallel.dispatch import ExpertShard, dispatch_combine
from lightning_shard.expert_parallel.experts import ExpertLayout
from lightning_shard.expert_parallel.grouped import COMPUTE_MODES, ComputeMode

log = logging.getLogger(__name__)

ROLES = ("experts", "router")
# transformers' plan styles: the experts module, and the parameters it splits on dim 0.
_HF_EXPERTS, _HF_PARAM = "ep_dispatch_experts", "grouped_gemm"
# Wrappers that insert a name component without changing what the model is (kept in step with
# lightning_shard.parallel.plan, a sibling package this one may not import).
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def apply_expert_parallel(
    model: nn.Module,
    group_or_mesh: DeviceMesh | Any | None = None,
    plan: Mapping[str, str] | None = None,
    *,
    compute: ComputeMode = "auto",
    gradient_scale: float = 1.0,
) -> dict[str, ExpertShard]:
    """Split every experts module of ``model`` over the expert-parallel group, in place.

    ``group_or_mesh``: a 1-D ``DeviceMesh`` (or one with an ``"ep"`` dimension), a process group, or ``None``
    (the default group). Every rank must hold the same whole model when this is called (same seed or the same
    loaded weights): each keeps its own block. ``compute`` picks the local experts' products (:mod:`.grouped`).
    ``gradient_scale`` multiplies the experts' weight gradients (:attr:`ExpertShard.gradient_scale`: ``1 / ep``
    under a data-parallel mean over the other ranks, as the strategy sets it).
    Returns ``{module name: ExpertShard}``; each experts module also carries its shard as ``module.expert_shard``.
    """
    if compute not in COMPUTE_MODES:
        raise ValueError(
            f"apply_expert_parallel(compute={compute!r}): use one of {', '.join(map(repr, COMPUTE_MODES))}."
        )
    found = []  # every module checked before any is changed
    for name, module, params in _experts_modules(model, plan):
        layout = ExpertLayout.of(module, name)
        wanted = set(params) - set(layout.expert_parameters)
        if wanted:
            raise ValueError(
                f"expert parallelism: the plan splits {sorted(wanted)} of {name} ({type(module).__name__}), which"
                f" are not among its expert weights {list(layout.expert_parameters)}."
            )
        for p in layout.expert_parameters:
            held = getattr(module, p)
            if isinstance(held, DTensor):
                raise ValueError(
                    f"expert parallelism: {name}.{p} is already a DTensor ({held.placements} on"
                    f" {held.device_mesh}): apply expert parallelism once, before any other sharding."
                )
        found.append((name, module, layout, layout.num_experts(module, name)))
    if not found:
        raise ValueError(
            f"apply_expert_parallel(plan={plan!r}) names no experts module of {type(model).__name__}: give at"
            ' least one pattern the role "experts".'
        )
    mesh = _ep_mesh(model, group_or_mesh)
    for name, module, _, num_experts in found:
        if num_experts % mesh.size():
            raise ValueError(
                f"expert parallelism over {mesh.size()} ranks cannot split {name} ({type(module).__name__}):"
                f" {num_experts} experts are not divisible by {mesh.size()}. Use an expert-parallel size that"
                f" divides {num_experts}."
            )
    shards: dict[str, ExpertShard] = {}
    for name, module, layout, num_experts in found:
        shard = ExpertShard(num_experts, mesh, gradient_scale=gradient_scale)
        for p in layout.expert_parameters:
            _keep_block(module, p, shard)
        module.forward = functools.partial(_experts_forward, module, layout, shard, compute)
        module.expert_shard = shard  # type: ignore[assignment]  # a plain attribute, neither Tensor nor Module
        shards[name] = shard
    return shards


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """The experts modules :func:`apply_expert_parallel` split, by module name."""
    return {
        name: module.expert_shard
        for name, module in model.named_modules()
        if isinstance(getattr(module, "expert_shard", None), ExpertShard)
    }


def planned_experts(model: nn.Module, plan: Mapping[str, str] | None = None) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every experts module :func:`apply_expert_parallel` would split with ``plan`` (the
    model's own where ``None``), without splitting anything or needing a process group (the planner reads it)."""
    return [(name, module) for name, module, _ in _experts_modules(model, plan)]


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules :func:`apply_expert_parallel` split, in module order."""
    return [m for m in model.modules() if isinstance(getattr(m, "expert_shard", None), ExpertShard)]


def _experts_forward(
    module: nn.Module,
    layout: ExpertLayout,
    shard: ExpertShard,
    mode: ComputeMode,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
) -> Tensor:
    def compute(rows: Tensor, counts: list[int]) -> Tensor:
        return layout.compute(module, rows, counts, mode, shard.gradient_scale)

    return dispatch_combine(hidden_states, top_k_index, top_k_weights, compute, shard)


def _keep_block(module: nn.Module, name: str, shard: ExpertShard) -> None:
    full = module._parameters[name]
    assert full is not None
    block = full.detach().narrow(0, shard.first, shard.num_local).clone()  # [E/ep, ...]
    local = DTensor.from_local(
        block, shard.mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
    )
    module._parameters[name] = nn.Parameter(local, requires_grad=full.requires_grad)


def _ep_mesh(model: nn.Module, group_or_mesh: Any) -> DeviceMesh:
    if isinstance(group_or_mesh, DeviceMesh):
        names = group_or_mesh.mesh_dim_names or ()
        if group_or_mesh.ndim == 1:
            return group_or_mesh
        if "ep" in names:
            return group_or_mesh["ep"]
        raise ValueError(
            f"apply_expert_parallel: the mesh has {group_or_mesh.ndim} dimensions {names or ''} and none named"
            " 'ep'. Pass its expert-parallel dimension, e.g. mesh['ep'], or a process group."
        )
    if not dist.is_initialized():
        raise ValueError(
            "apply_expert_parallel needs an initialised process group (dist.init_process_group)."
        )
    devices = {p.device.type for p in model.parameters()} - {"meta"}
    if devices:
        device_type = devices.pop()
    else:  # a model on the meta device: the backend says where it will live
        device_type = "cuda" if "nccl" in str(dist.get_backend(group_or_mesh)) else "cpu"
    if group_or_mesh is None or group_or_mesh is dist.group.WORLD:
        return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("ep",))
    return DeviceMesh.from_group(group_or_mesh, device_type, mesh_dim_names=("ep",))


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _regex(pattern: str, anchored: bool) -> re.Pattern[str]:
    body = r"[^.]+".join(re.escape(part) for part in pattern.split("*"))
    return re.compile(("^" if anchored else r"(?:^|.*\.)") + body + "$")


def _experts_modules(
    model: nn.Module, plan: Mapping[str, str] | None
) -> list[tuple[str, nn.Module, list[str]]]:
    """(name, module, parameters the plan names for splitting) for every experts module."""
    anchored = plan is None
    params: dict[str, list[str]] = {}
    if plan is None:
        plan, params = _carried_plan(model)
    else:
        _check_plan(plan)
    named = [(name, _clean(name), module) for name, module in model.named_modules()]  # "" is the model itself
    found: dict[str, tuple[nn.Module, list[str]]] = {}
    for pattern, role in plan.items():
        hits = [(name, module) for name, clean, module in named if _regex(pattern, anchored).match(clean)]
        if not hits:
            examples = [clean for _, clean, m in named if any(p.dim() == 3 for p in m.parameters(False))][:4]
            raise ValueError(
                f"expert parallelism: the plan's pattern {pattern!r} ({role!r}) matches no module of"
                f" {type(model).__name__}. '*' stands for one name component; modules holding 3-D weights are"
                f" {', '.join(examples) or '(none)'}."
            )
        if role == "experts":
            for name, module in hits:
                found[name] = (module, params.get(pattern, []))
    return [(name, module, names) for name, (module, names) in found.items()]


def _check_plan(plan: Mapping[str, str]) -> None:
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(
            f"apply_expert_parallel(plan={plan!r}) must be a non-empty mapping of module-name patterns to"
            ' "experts" or "router", e.g. {"blocks.*.moe.experts": "experts"}.'
        )
    for pattern, role in plan.items():
        if role not in ROLES:
            raise ValueError(
                f"apply_expert_parallel(plan={{{pattern!r}: {role!r}}}): unknown role {role!r}. Use 'experts'"
                " for a module holding 3-D expert weights, or 'router'."
            )


def _carried_plan(model: nn.Module) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The plan a model carries: an ``expert_parallel_plan`` attribute (module-name patterns -> ``"experts"``, as
    the example GPT carries), or a Hugging Face model's ``base_model_ep_plan``; experts patterns anchored at the
    module that carries it, and the parameters each one's plan splits."""
    for name, module in model.named_modules():
        own = getattr(module, "expert_parallel_plan", None)
        if isinstance(own, Mapping) and own:
            _check_plan(own)
            prefix = _clean(name)
            return {f"{prefix}.{k}" if prefix else k: v for k, v in own.items()}, {}
    for name, module in model.named_modules():
        base = getattr(module, "base_model_prefix", None)
        hf_plan = getattr(getattr(module, "config", None), "base_model_ep_plan", None)
        if not (isinstance(base, str) and isinstance(hf_plan, Mapping) and hf_plan):
            continue
        prefix = _clean(name)
        if base and hasattr(module, base):
            prefix = f"{prefix}.{base}" if prefix else base
        plan: dict[str, str] = {}
        params: dict[str, list[str]] = {}
        for pattern, style in hf_plan.items():
            full = f"{prefix}.{pattern}" if prefix else pattern
            if style == _HF_EXPERTS:
                plan[full] = "experts"
            elif style == _HF_PARAM:
                owner, _, param = full.rpartition(".")
                params.setdefault(owner, []).append(param)
            else:  # tensor-parallel styles of dense layers some plans carry: not expert parallelism's
                log.debug("expert parallelism: %s (%r) left as it is", full, style)
        if plan:
            return plan, params
    raise ValueError(
        f"apply_expert_parallel(plan=None): {type(model).__name__} carries no expert-parallel plan (no"
        " expert_parallel_plan attribute, no Hugging Face config.base_model_ep_plan with 'ep_dispatch_experts'"
        " entries). Pass"
        ' plan={"<pattern of the experts modules>": "experts"}, e.g. {"layers.*.mlp.experts": "experts"}.'
    )
