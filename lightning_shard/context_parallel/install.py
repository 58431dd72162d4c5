"""Context parallelism installed on a model: its attention over the group, global positions fed in.

What a model needs (docs/context_parallel.md):

- attention CP can replace: a Hugging Face model whose ``config._attn_implementation`` is ``'sdpa'`` (the
  default) or ``'eager'`` (its attention interface then calls :func:`hf_attention`, registered under
  :data:`HF_ATTENTION`), or modules with an ``attend(q, k, v, dropout_p=..., scale=...)`` attribute computing
  causal attention on ``(batch, heads, seq, head_dim)`` tensors (the pack's demo GPT);
- a ``position_ids`` argument on the forward that embeds positions: while a step runs, a call that does not
  pass them gets this rank's global positions (a chunk does not start at 0).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from lightning_shard.context_parallel.attention import ContextParallel

#: The name the attention runs under in transformers' ``AttentionInterface``.
HF_ATTENTION = "lightning_shard_context_parallel"
#: Attention implementations computing plain causal softmax attention, which CP computes in their place.
REPLACEABLE = ("sdpa", "eager", HF_ATTENTION)
#: On each module of a Hugging Face model, the group its attention runs over.
_ATTR = "_lightning_shard_context_parallel"
_HOOKED = "_lightning_shard_cp_positions"


def apply_context_parallel(module: nn.Module, cp: ContextParallel, owner: str = "ShardStrategy") -> list[str]:
    """Install ``cp`` on ``module``'s attention and position inputs; the names of the attentions replaced.
    ``ValueError`` naming what to add where the model has no attention CP can replace."""
    flag = f"{owner}(context_parallel_size={cp.size})"
    replaced = [name for name, m in module.named_modules() if _replace_attend(m, cp)]
    replaced += _install_hugging_face(module, cp, flag)
    if not replaced:
        raise ValueError(
            f"{flag} found no attention it can run over the group in {type(module).__name__}. Use a Hugging Face"
            " model with attn_implementation='sdpa' (the default) or 'eager', or give each attention module an"
            " `attend(q, k, v, dropout_p=0.0, scale=None)` attribute computing causal attention on (batch, heads,"
            " seq, head_dim) tensors and call it in forward, as lightning_shard.demos.gpt.CausalSelfAttention"
            " does."
        )
    for m in module.modules():
        _hook_positions(m, cp)
    return replaced


def _replace_attend(module: nn.Module, cp: ContextParallel) -> bool:
    if not callable(getattr(module, "attend", None)):
        return False
    module.attend = cp.attention  # type: ignore[assignment]
    return True


def _install_hugging_face(module: nn.Module, cp: ContextParallel, flag: str) -> list[str]:
    models = [
        (name, m)
        for name, m in module.named_modules()
        if hasattr(getattr(m, "config", None), "_attn_implementation")
        and hasattr(m, "set_attn_implementation")
    ]
    seen: set[int] = set()
    replaced = []
    for name, model in models:
        config = model.config  # type: ignore[union-attr]
        if id(config) in seen:
            continue
        seen.add(id(config))
        implementation = config._attn_implementation
        if implementation not in REPLACEABLE:
            raise ValueError(
                f"{flag} computes causal softmax attention over the group in place of the model's own; "
                f"{type(model).__name__} uses attn_implementation={implementation!r}, which it cannot replace."
                " Load the model with attn_implementation='sdpa' (the default) or 'eager'."
            )
        _register_hugging_face()
        config._attn_implementation = HF_ATTENTION
        for sub in model.modules():
            setattr(sub, _ATTR, cp)
        replaced.append(name or type(model).__name__)
    return replaced


def _register_hugging_face() -> None:
    # transformers is optional: only a Hugging Face model brings it here.
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(HF_ATTENTION, hf_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(HF_ATTENTION, sdpa_mask)  # masks outside a step, as under 'sdpa'


def hf_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-interface signature: ``query (b, h, t, d)``, ``key / value (b, h_kv, t, d)``;
    returns ``(b, t, h, d)``. Outside a step (or on a model CP was not installed on) it is transformers' SDPA."""
    cp: ContextParallel | None = getattr(module, _ATTR, None)
    if cp is None or not cp.active:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # optional dependency

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    for option in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(option) is not None:
            raise ValueError(
                f"context parallelism computes plain causal attention; {type(module).__name__} passes {option}="
                f"{kwargs[option]!r}, which it does not implement. Train this model without context parallelism."
            )
    out = cp.attention(query, key, value, dropout_p=dropout, scale=scaling)  # (b, h, t, d)
    return out.transpose(1, 2).contiguous(), None


def _hook_positions(module: nn.Module, cp: ContextParallel) -> None:
    if getattr(module, _HOOKED, None) is cp:
        return
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return
    if "position_ids" not in params:
        return
    index = params.index("position_ids")

    def give_positions(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not cp.active or kwargs.get("position_ids") is not None:
            return None
        if index < len(args) and args[index] is not None:
            return None
        device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        return args, {**kwargs, "position_ids": cp.positions(device)}

    module.register_forward_pre_hook(give_positions, with_kwargs=True)
    setattr(module, _HOOKED, cp)


__all__ = ["HF_ATTENTION", "REPLACEABLE", "apply_context_parallel", "hf_attention"]
