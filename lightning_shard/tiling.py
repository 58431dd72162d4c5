"""Tiled MLP and tiled loss: a long sequence's widest activations computed a tile of tokens at a time.

Context parallelism divides a sequence's activations by the ranks of a group; two of them are still the
largest a layer keeps (ALST's observation, Arctic Long Sequence Training):

- the MLP's hidden units, ``(b, T, 4 d)`` or ``(b, T, 3 i)`` for a gated MLP, per layer;
- the logits, ``(b, T, V)`` in float32 for the loss, and their gradient: with a 128k vocabulary they
  outgrow the whole model's hidden states many times over.

Both are computed per token, so a sequence can be cut into tiles along it with the same result.
``ShardStrategy(tiled_mlp=..., tiled_loss=...)`` does so:

- **tiled MLP**: each MLP (a module named ``mlp``, ``feed_forward`` or ``ffn``, taking and returning
  ``(b, t, d)``) runs tile by tile under ``torch.utils.checkpoint``; forward keeps only its input (a view),
  backward recomputes one tile's hidden units at a time. Tile: as many tokens as the model is wide (ALST's
  rule), or the flag's number.
- **tiled loss**: the output head and the cross-entropy run tile by tile, each tile checkpointed, so only
  one tile's logits exist at a time. For Hugging Face causal LMs (their forward given ``labels`` or
  ``shift_labels``: the decoder's hidden states go to :func:`linear_cross_entropy` in place of ``lm_head``
  and ``loss_function``; ``logits`` is then ``None``), and for any module that computes its loss with
  :func:`linear_cross_entropy` and has a ``loss_tile`` attribute (the demo GPT given ``labels``). Tile:
  ``ceil(N d / V)`` tokens, so one tile's logits are as large as the hidden states (Liger-Kernel's rule),
  and at least 1024 tokens; or the flag's number.

The results equal the untiled ones up to float summation order (the loss is a sum over tiles).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

#: Names of the MLP modules the tiled MLP runs tile by tile (the last part of a module's name).
MLP_NAMES = ("mlp", "feed_forward", "ffn")
#: Hugging Face config attributes that change the logits after the head: the tiled loss cannot compute them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale")
_TILED = "_lightning_shard_tiled"


# --- the loss ------------------------------------------------------------------------------------------------


def linear_cross_entropy(
    hidden: Tensor, head: nn.Module, targets: Tensor, tile: int | None = None, ignore_index: int = -100
) -> Tensor:
    """The sum over targets of ``cross_entropy(head(hidden).float(), targets)`` (``ignore_index`` left
    out), ``hidden (..., d)``, ``targets (...)``: without ``tile`` in one go, with it ``tile`` tokens at a
    time, each tile's logits recomputed in backward instead of kept."""
    h = hidden.reshape(-1, hidden.size(-1))  # (N, d)
    t = targets.reshape(-1)  # (N,)
    if tile is None or tile >= t.numel():
        return _loss_sum(h, t, head, ignore_index)
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, t.numel(), tile):
        part = slice(start, start + tile)
        total = total + checkpoint(_loss_sum, h[part], t[part], head, ignore_index, use_reentrant=False)
    return total


def _loss_sum(h: Tensor, t: Tensor, head: nn.Module, ignore_index: int) -> Tensor:
    return F.cross_entropy(head(h).float(), t, ignore_index=ignore_index, reduction="sum")


#: The fewest tokens of a default loss tile: smaller tiles save little memory and each costs a pass over the
#: head's weight gradient (on CPU, 1024 tokens took 1.25x the untiled step where 33 took 2.2x).
MIN_LOSS_TILE = 1024


def loss_tile(tokens: int, width: int, vocab: int) -> int:
    """The default tile of the tiled loss: one tile's logits (``tile x V``) no larger than the hidden
    states (``N x d``, Liger-Kernel's rule), and at least :data:`MIN_LOSS_TILE` tokens."""
    return max(MIN_LOSS_TILE, math.ceil(tokens * width / vocab))


def mean_cross_entropy(
    hidden: Tensor, head: nn.Module, targets: Tensor, tile: int | bool | None = None
) -> Tensor:
    """The mean over the targets (``-100`` left out) of the head's cross-entropy; ``tile``: ``None`` /
    ``False`` (the logits whole), ``True`` (:func:`loss_tile`) or a number of tokens."""
    if tile is None or tile is False:  # one cross-entropy over the whole logits
        logits = head(hidden).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
    count = (targets != -100).sum()
    return linear_cross_entropy(hidden, head, targets, _tile_size(tile, targets, hidden, head)) / count


def _tile_size(tile: int | bool, targets: Tensor, hidden: Tensor, head: nn.Module) -> int:
    """The flag's number of tokens, or for ``True`` :func:`loss_tile` of this batch and head."""
    if tile is not True:
        return int(tile)
    weight = getattr(head, "weight", None)
    vocab = weight.shape[0] if weight is not None else hidden.size(-1)
    return loss_tile(targets.numel(), hidden.size(-1), vocab)


# --- installing them ------------------------------------------------------------------------------------------


def apply_tiled_mlp(module: nn.Module, tile: int | bool, flag: str) -> list[str]:
    """Run every MLP of ``module`` tile by tile; the names of the MLPs. ``ValueError`` naming the rule where
    there is none."""
    found = [name for name, _ in module.named_modules() if name.rsplit(".", 1)[-1] in MLP_NAMES]
    for name in found:
        sub = module.get_submodule(name)
        if not getattr(sub, _TILED, False):  # a later Trainer call finds it tiled already
            sub.forward = _tiled_mlp_forward(sub.forward, None if tile is True else int(tile), flag, name)
            setattr(sub, _TILED, True)
    if not found:
        raise ValueError(
            f"{flag} found no MLP in {type(module).__name__}: it runs the modules named"
            f" {' / '.join(MLP_NAMES)} (taking and returning (batch, seq, width) tensors) tile by tile. Name the"
            " transformer blocks' MLP one of these, or drop the flag."
        )
    return found


def _tiled_mlp_forward(forward: Any, tile: int | None, flag: str, name: str) -> Any:
    @functools.wraps(forward)
    def tiled(x: Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, DTensor):
            # Sequence parallelism hands the MLP its norm's output split along the sequence; its first
            # layer's style reads a local tensor as that split. Tiles of the local part then go through
            # the layers as the whole part does, token by token, and come back split as it would.
            x = x.to_local()
        if args or kwargs or not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(
                f"{flag} runs {name} tile by tile along the sequence, which needs it called with one (batch,"
                f" seq, width) tensor; it got {_describe(x, args, kwargs)}. Leave this model's MLPs untiled."
            )
        size = tile or x.size(-1)  # as many tokens as the model is wide (ALST's rule)
        if x.size(1) <= size:
            return forward(x)
        parts = []
        for start in range(0, x.size(1), size):
            piece = x[:, start : start + size]
            out = (
                checkpoint(forward, piece, use_reentrant=False) if torch.is_grad_enabled() else forward(piece)
            )
            if not isinstance(out, Tensor):
                raise ValueError(
                    f"{flag} runs {name} tile by tile and joins the tiles' outputs, but it returned a"
                    f" {type(out).__name__}, not a tensor. Leave this model's MLPs untiled."
                )
            parts.append(out)
        return torch.cat(parts, dim=1)

    return tiled


def _describe(x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    first = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
    return first + (f" and {len(args) + len(kwargs)} more argument(s)" if args or kwargs else "")


def apply_tiled_loss(module: nn.Module, tile: int | bool, flag: str) -> list[str]:
    """Compute the loss of ``module``'s language models tile by tile; their names. ``ValueError`` naming
    what to add where there is none."""
    found = []
    for name, sub in module.named_modules():
        if hasattr(sub, "loss_tile"):
            sub.loss_tile = tile
            found.append(name or type(sub).__name__)
        elif _is_hugging_face_lm(sub):
            _check_plain_logits(sub, flag)
            if not getattr(sub, _TILED, False):
                sub.forward = _tiled_lm_forward(sub, sub.forward, tile)
                setattr(sub, _TILED, True)
            found.append(name or type(sub).__name__)
    if not found:
        raise ValueError(
            f"{flag} found no language-model loss it can tile in {type(module).__name__}. Use a Hugging Face"
            " causal LM and call it with labels (model(**batch).loss), or compute the loss with"
            " lightning_shard.tiling.mean_cross_entropy(hidden, head, targets, tile=self.loss_tile) in a module"
            " with a loss_tile attribute, as lightning_shard.demos.gpt.GPT does."
        )
    return found


def _is_hugging_face_lm(module: nn.Module) -> bool:
    return (
        all(
            callable(getattr(module, attr, None))
            for attr in ("get_decoder", "get_output_embeddings", "loss_function")
        )
        and "labels" in inspect.signature(module.forward).parameters
    )


def _check_plain_logits(model: Any, flag: str) -> None:
    config = getattr(model, "config", None)
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"{flag} computes the logits as lm_head(hidden) tile by tile; {type(model).__name__} changes them"
                f" after the head (config.{attr}={value!r}), which it does not. Drop the flag for this model."
            )
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        raise ValueError(
            f"{flag} runs {type(model).__name__}'s output head tile by tile, which must be an nn.Linear (got"
            f" {type(model.get_output_embeddings()).__name__}). Drop the flag for this model."
        )


def _tiled_lm_forward(model: Any, forward: Any, tile: int | bool) -> Any:
    """A Hugging Face causal LM's forward given labels: the decoder, then the head and the loss tile by
    tile (transformers' ``ForCausalLMLoss``: labels shifted unless ``shift_labels`` is given, the sum over
    targets divided by ``num_items_in_batch`` or by their count)."""
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def tiled(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        call = dict(bound.arguments)
        call.update(call.pop("kwargs", {}))
        labels, shift_labels = call.pop("labels", None), call.pop("shift_labels", None)
        if labels is None and shift_labels is None:
            return forward(*args, **kwargs)
        num_items = call.pop("num_items_in_batch", None)
        call.pop("logits_to_keep", None)
        outputs = model.get_decoder()(**call)
        hidden = outputs[0]  # (b, t, d)
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        head = model.get_output_embeddings()
        total = linear_cross_entropy(hidden, head, shift_labels, _tile_size(tile, shift_labels, hidden, head))
        count = num_items if num_items is not None else (shift_labels != -100).sum()
        loss = total / (count.to(total.device) if isinstance(count, Tensor) else count)
        from transformers.modeling_outputs import CausalLMOutputWithPast  # a Hugging Face model brings it

        # The decoder's other outputs (its cache, hidden states, attentions) under their names.
        extra = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
        return CausalLMOutputWithPast(loss=loss, logits=None, **extra)

    return tiled


__all__ = [
    "MLP_NAMES",
    "apply_tiled_loss",
    "apply_tiled_mlp",
    "linear_cross_entropy",
    "loss_tile",
    "mean_cross_entropy",
]
