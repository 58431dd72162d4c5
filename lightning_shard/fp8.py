"""``ShardStrategy(fp8=...)``: float8 training of the large ``nn.Linear`` layers through torchao.

torchao's ``convert_to_float8_training`` swaps each chosen ``nn.Linear`` for a ``Float8Linear``: its three
matmuls (output, input gradient, weight gradient) run in float8 through ``torch._scaled_mm`` with scales
computed from the operands' absolute maxima each step (dynamic scaling), while the weight itself, its
gradient and the optimizer state stay in high precision. Checkpoints therefore hold plain weights: a run
saved with fp8 resumes without it and the other way round.

Which layers (the size rule, ``filter="auto"``): an ``nn.Linear`` is converted when

1. ``in_features`` and ``out_features`` are multiples of 16 (``torch._scaled_mm`` needs it), and
2. it is large enough to gain from the float8 matmul: with K = ``in_features``, N = ``out_features``,
   tensorwise: not (K <= 4096 and N <= 1024); rowwise: N > 2048 and K > 1024 and not (N <= 4096 and
   K <= 2048) -- torchao's H100 measurements, below which the casts cost more than the matmul saves, and
3. it is not the output head: a Linear whose weight is an ``nn.Embedding``'s (tied), or whose name ends in
   ``head``, ``lm_head``, ``output``, ``classifier`` or ``score`` (the logits' precision is the loss's).

``filter="all"`` keeps rules 1 and 3 only (small models, tests); ``modules=[patterns]`` converts exactly
the Linears whose qualified names match (``fnmatch``; rule 1 still applies); ``skip=[patterns]`` keeps
more layers in high precision; ``filter="package.module.function"`` names a ``(module, name) -> bool``
filter of your own. A model left with no eligible layer warns.

FSDP (stages 2-3) gathers the converted weights in float8 (``enable_fsdp_float8_all_gather``, tensorwise
only): each rank casts its shard with one scale from the weight's absolute maximum over every shard, so
the gathered bytes are exactly the full weight's cast, in 1 byte per element instead of 2 (bf16) or 4
(fp32). The scales for the next step's gathers are computed after each optimizer step in one all-reduce
(torchao's ``precompute_float8_dynamic_scale_for_fsdp``), and again after weights are loaded.

Tensor parallelism splits the converted layers (the conversion comes first, torchtitan's order) with
torchao's float8 styles where they keep the result of one process (see ``parallel.plan._float8_styles``).
With it the gathers' scales are also computed once at set-up: torchao's cast at the gather reduces the
maximum over the data-parallel shards only, not over the tensor-parallel slices.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import importlib.util
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

log = logging.getLogger(__name__)

Fp8Recipe = Literal["tensorwise", "rowwise"]
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
#: The last part of the names the size rule treats as the output head.
HEAD_NAMES: tuple[str, ...] = ("head", "lm_head", "output", "classifier", "score")
#: ``Float8LinearConfig`` options ``fp8={...}`` passes through (its plain-typed fields).
TORCHAO_OPTIONS: tuple[str, ...] = (
    "enable_fsdp_float8_all_gather",
    "pad_inner_dim",
    "emulate",
    "round_scales_to_power_of_2",
)
_OWN_KEYS: tuple[str, ...] = ("recipe", "filter", "modules", "skip", "precompute_scales")
_INSTALL = "pip install 'lightning-shard[fp8]' (torchao>=0.18)"
#: Set on a module once its layers are converted (a later Trainer call finds them converted).
_CONVERTED = "_lightning_shard_fp8"


@dataclass(frozen=True)
class Fp8Settings:
    """``fp8=`` validated: which Linears become ``Float8Linear`` and how they cast."""

    recipe: Fp8Recipe = "tensorwise"
    """torchao's recipe: ``'tensorwise'`` (one scale per tensor; the fastest) or ``'rowwise'`` (a scale per
    row; more accurate)."""
    filter: str = "auto"
    """``'auto'`` (the size rule), ``'all'`` (every Linear with dimensions multiple of 16 but the head), or
    the import path of a ``(module, qualified_name) -> bool`` function."""
    modules: tuple[str, ...] | None = None
    """Module-name patterns (``fnmatch``) to convert, instead of ``filter``."""
    skip: tuple[str, ...] = ()
    """Module-name patterns kept in high precision, whatever the filter says."""
    all_gather: bool = False
    """FSDP gathers the converted weights in float8 (stages 2-3, tensorwise)."""
    precompute_scales: bool = True
    """With ``all_gather``: the weights' scales computed in one all-reduce after each optimizer step (else
    one all-reduce per weight at each gather)."""
    options: tuple[tuple[str, bool], ...] = ()
    """Other ``Float8LinearConfig`` options (``pad_inner_dim``, ``emulate``, ``round_scales_to_power_of_2``)."""

    def as_flag(self) -> dict[str, Any]:
        """The ``fp8={...}`` dict these settings come from (checked again when passed as the flag)."""
        return {
            "recipe": self.recipe,
            "filter": self.filter,
            "modules": None if self.modules is None else list(self.modules),
            "skip": list(self.skip),
            "enable_fsdp_float8_all_gather": self.all_gather,
            "precompute_scales": self.precompute_scales,
            **dict(self.options),
        }

    def torchao_config(self) -> Any:
        """torchao's ``Float8LinearConfig`` for these settings."""
        from torchao.float8 import Float8LinearConfig  # optional dependency (the fp8 extra)

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        changes = dict(self.options, enable_fsdp_float8_all_gather=self.all_gather)
        return dataclasses.replace(config, **changes)


def check_fp8(value: Any, stage: Any, tensor_parallel_size: int) -> Fp8Settings | None:
    """``fp8=`` as :class:`Fp8Settings` (``False`` / ``None``: off); ``ValueError`` naming the fix."""
    if value is None or value is False:
        return None
    if value is True:
        given: dict[str, Any] = {}
    elif isinstance(value, Fp8Settings):
        given = value.as_flag()
    elif isinstance(value, str):
        given = {"recipe": value}
    elif isinstance(value, dict) and all(isinstance(k, str) for k in value):
        given = dict(value)
    else:
        raise ValueError(
            f"ShardStrategy(fp8={value!r}) must be True, 'tensorwise', 'rowwise' or a dict of options, e.g."
            " fp8={'recipe': 'rowwise', 'skip': ['blocks.0.*']}."
        )
    unknown = sorted(set(given) - set(_OWN_KEYS) - set(TORCHAO_OPTIONS))
    if unknown:
        raise ValueError(
            f"ShardStrategy(fp8={value!r}) has {unknown}, which are not fp8 options. Use keys of"
            f" {list(_OWN_KEYS + TORCHAO_OPTIONS)}."
        )
    recipe = given.pop("recipe", "tensorwise")
    if recipe not in RECIPES:
        raise ValueError(
            f"ShardStrategy(fp8={value!r}): recipe {recipe!r} is unknown. Use one of {list(RECIPES)}."
        )
    settings = _settings(value, recipe, given)
    settings = _with_all_gather(value, settings, given.get("enable_fsdp_float8_all_gather"), stage)
    if settings.all_gather and not settings.precompute_scales and tensor_parallel_size > 1:
        raise ValueError(
            f"ShardStrategy(fp8={value!r}, tensor_parallel_size={tensor_parallel_size}): the float8 all-gather"
            " without precompute_scales casts each weight with the maximum over its data-parallel shards only,"
            " so each tensor-parallel slice would get a scale of its own. Drop precompute_scales=False, or set"
            " enable_fsdp_float8_all_gather=False."
        )
    return settings


def _settings(value: Any, recipe: str, given: dict[str, Any]) -> Fp8Settings:
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"ShardStrategy(fp8={value!r}) needs torchao, which is not installed: {_INSTALL}.")
    filter_ = given.pop("filter", "auto")
    if not isinstance(filter_, str) or not filter_:
        raise ValueError(
            f"ShardStrategy(fp8={value!r}): filter must be 'auto', 'all' or the import path of a"
            " (module, name) -> bool function; to name the layers themselves, use modules=[...]."
        )
    if filter_ not in ("auto", "all"):
        _import_filter(filter_, value)  # an unknown path fails now, before any process starts
    modules, skip = (
        _patterns(given.pop(key, default), key, value) for key, default in (("modules", None), ("skip", ()))
    )
    precompute = given.pop("precompute_scales", True)
    for key, option in [("precompute_scales", precompute), *given.items()]:
        if not isinstance(option, bool):
            raise ValueError(f"ShardStrategy(fp8={value!r}): {key} must be True or False (got {option!r}).")
    options = tuple(sorted((k, v) for k, v in given.items() if k != "enable_fsdp_float8_all_gather"))
    return Fp8Settings(
        recipe=recipe,  # type: ignore[arg-type]
        filter=filter_,
        modules=modules,
        skip=skip or (),
        precompute_scales=precompute,
        options=options,
    )


def _with_all_gather(value: Any, settings: Fp8Settings, asked: bool | None, stage: Any) -> Fp8Settings:
    """Float8 all-gather: on by default where FSDP gathers parameters (stages 2-3) and the recipe is
    tensorwise (torchao casts the weight's shards with one scale only then)."""
    gathers = stage in (2, 3)  # stage="auto" may resolve to 0-1: on there only when asked
    if asked and settings.recipe != "tensorwise":
        raise ValueError(
            f"ShardStrategy(fp8={value!r}): enable_fsdp_float8_all_gather needs the 'tensorwise' recipe (torchao"
            f" casts a weight's shards with one scale only there), got {settings.recipe!r}. Drop one of them."
        )
    if asked and stage in (0, 1):
        raise ValueError(
            f"ShardStrategy(stage={stage}, fp8={value!r}): enable_fsdp_float8_all_gather applies where FSDP"
            " gathers parameters, at stages 2-3; at stages 0-1 every rank holds them whole. Use stage=2 or 3,"
            " or drop the option."
        )
    on = asked if asked is not None else gathers and settings.recipe == "tensorwise"
    return dataclasses.replace(settings, all_gather=bool(on))


def _patterns(value: Any, key: str, flag: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"ShardStrategy(fp8={flag!r}): {key} must be a list of module-name patterns, e.g. ['blocks.*.mlp.0']."
        )
    return tuple(value)


def _import_filter(path: str, flag: Any) -> Callable[[nn.Module, str], bool]:
    module_name, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError):
        fn = None
    if not callable(fn):
        raise ValueError(
            f"ShardStrategy(fp8={flag!r}): filter {path!r} is neither 'auto', 'all' nor the import path of a"
            " (module, name) -> bool function (e.g. 'my_project.fp8.keep')."
        )
    return fn  # type: ignore[no-any-return]


# --- the size rule ---------------------------------------------------------------------------------------


def fits_scaled_mm(linear: nn.Linear) -> bool:
    """Both dimensions multiples of 16, as ``torch._scaled_mm`` needs."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def large_enough(linear: nn.Linear, recipe: str) -> bool:
    """torchao's measured break-even on H100 (rule 2 of the module's docstring)."""
    k, n = linear.in_features, linear.out_features
    if recipe == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    return not (k <= 4096 and n <= 1024)


def head_names(module: nn.Module) -> set[str]:
    """The qualified names of ``module``'s output heads: Linears tied to an embedding, or named as one."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return {
        name
        for name, sub in module.named_modules()
        if isinstance(sub, nn.Linear)
        and (id(sub.weight) in embeddings or name.rsplit(".", 1)[-1] in HEAD_NAMES)
    }


def choose(module: nn.Module, settings: Fp8Settings) -> list[str]:
    """The qualified names of the Linears ``settings`` converts, in module order."""
    heads = head_names(module)
    custom = (
        _import_filter(settings.filter, settings.filter)
        if settings.filter not in ("auto", "all") and settings.modules is None
        else None
    )
    chosen = []
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.Linear) or _is_float8(sub) or not fits_scaled_mm(sub):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in settings.skip):
            continue
        if settings.modules is not None:
            keep = any(fnmatch.fnmatchcase(name, p) for p in settings.modules)
        elif custom is not None:
            keep = bool(custom(sub, name))
        else:
            keep = name not in heads and (settings.filter == "all" or large_enough(sub, settings.recipe))
        if keep:
            chosen.append(name)
    return chosen


def _is_float8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


# --- the run side --------------------------------------------------------------------------------------


def convert(module: nn.Module, settings: Fp8Settings, owner: str = "ShardStrategy") -> list[str]:
    """Swap the chosen Linears of ``module`` for torchao's ``Float8Linear`` (once per module); their names.

    Runs before ``torch.compile`` and ``fully_shard`` (torchtitan's order), on real or meta parameters."""
    if getattr(module, _CONVERTED, None) is not None:
        return list(getattr(module, _CONVERTED))
    chosen = set(choose(module, settings))
    if not chosen:
        warnings.warn(
            f"{owner}(fp8=...) found no Linear layer to convert in {type(module).__name__}: the size rule keeps"
            " layers with a dimension not a multiple of 16, small layers and the output head in high precision."
            " The run trains without fp8. Name layers with fp8={'modules': [...]} or use fp8={'filter': 'all'}"
            " (docs/fp8.md).",
            stacklevel=2,
        )
    else:
        from torchao.float8 import convert_to_float8_training  # optional dependency (the fp8 extra)

        convert_to_float8_training(
            module,
            module_filter_fn=lambda _, name: name in chosen,
            config=settings.torchao_config(),
        )
        log.info("%s: fp8 (%s) on %d Linear layers: %s", owner, settings.recipe, len(chosen), sorted(chosen))
    names = [name for name, sub in module.named_modules() if _is_float8(sub)]
    setattr(module, _CONVERTED, tuple(names))
    return names


def converted(module: nn.Module) -> list[str]:
    """The qualified names of ``module``'s ``Float8Linear`` layers."""
    return [name for name, sub in module.named_modules() if _is_float8(sub)]


def plain_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each float8-gathered weight as the plain high-precision tensor it wraps (DTensor or
    not), so that checkpoints and exports hold ordinary weights, readable without torchao."""
    from torch.distributed.tensor import DTensor

    from lightning_shard._dtensor import laid_out_as

    plain = {}
    for key, value in state.items():
        local = value._local_tensor if isinstance(value, DTensor) else value
        if type(local).__name__ == _GATHERED:
            inner = local._tensor  # type: ignore[union-attr]  # the high-precision shard
            if isinstance(value, DTensor):
                inner = laid_out_as(inner, value)
            value = inner
        plain[key] = value
    return plain


#: torchao's weight wrapper under ``enable_fsdp_float8_all_gather`` (casts at the gather).
_GATHERED = "WeightWithDynamicFloat8CastTensor"


def precompute_scales(module: nn.Module) -> None:
    """The float8 gathers' scales for the weights as they are now, in one all-reduce (torchao's)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # optional dependency (fp8 extra)

    precompute_float8_dynamic_scale_for_fsdp(module)


def precompute_after_steps(module: nn.Module, optimizers: list[Any]) -> None:
    """Recompute the gathers' scales after each step of ``optimizers`` (the weights just changed)."""

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        precompute_scales(module)

    for optimizer in optimizers:
        optimizer.register_step_post_hook(hook)


__all__ = ["Fp8Recipe", "Fp8Settings", "check_fp8", "choose", "convert", "converted", "precompute_scales"]
