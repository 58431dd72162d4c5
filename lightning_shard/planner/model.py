"""What the planner knows about a model: its parameter count and transformer shape.

A shape comes from a real module (counted; layers, hidden size, heads and vocabulary read off its
attributes and layers), from a class path built on the meta device (no memory, no weights), or from a
bare parameter count (shape inferred, GPT-3 proportions). Activation bytes follow from the shape
(:mod:`.activations`).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

from lightning_shard._modules import detect_block_classes, find_blocks
from lightning_shard.planner.experts import TOP_K_NAMES, block_params, count_experts
from lightning_shard.planner.shards import TensorTable, tensor_table
from lightning_shard.units import PlanInputError, parse_count

Checkpointing = Literal["none", "selective", "full"]

_HIDDEN = ("hidden_size", "d_model", "n_embd", "embed_dim")
_HEADS = ("num_attention_heads", "n_heads", "n_head", "num_heads")
_VOCAB = ("vocab_size", "n_vocab")
_SEQ = ("seq_len", "max_position_embeddings", "n_positions", "block_size", "max_seq_len", "n_ctx")
# GPT-3's family keeps hidden / layers near 128 (e.g. 4096 / 32, 12288 / 96): a fair guess of a shape.
_ASPECT = 128


@dataclass(frozen=True)
class ModelShape:
    """The numbers the plan needs. ``layers`` is 0 for a model without repeated blocks."""

    params: int
    """Parameters, tied ones counted once."""
    trainable: int
    """Parameters with ``requires_grad``: they get gradients and optimizer state."""
    layers: int
    """Repeated blocks (transformer layers): the units of activation checkpointing and sharding."""
    block_params: int
    """Parameters of one block (with experts, the largest); the rest (embeddings, final norm, head) is
    ``params - layers * block_params``."""
    hidden: int
    heads: int
    ffn: int
    """Width of the MLP's inner layer a token passes through (4 x hidden in GPT-2; with experts, its k experts'
    first projections together)."""
    vocab: int
    seq_len: int | None
    """The sequence length the model was built for, if it says (position embeddings); else None."""
    source: str
    inferred: bool = False
    """True when layers / hidden were guessed from the parameter count."""
    experts: int = 0
    """E, the experts of each experts module (mixture of experts); 0 for a dense model."""
    top_k: int = 0
    """k, the experts each token is routed to; 0 for a dense model."""
    expert_params: int = 0
    """Ψ_E: parameters in the experts' weights (the part ``expert_parallel_size`` splits), of ``params``."""
    moe_layers: int = 0
    """Experts modules (MoE layers): each exchanges its tokens by all-to-all under expert parallelism."""
    tensors: TensorTable | None = field(default=None, repr=False, compare=False)
    """Every parameter's shape and split (:mod:`.shards`), read off a module; None for a parameter count."""

    @property
    def root_params(self) -> int:
        return max(0, self.params - self.layers * self.block_params)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: ``Ψ - Ψ_E + Ψ_E x k / E`` (all of them in a dense model)."""
        if not self.experts:
            return self.params
        return self.params - self.expert_params + self.expert_params * self.top_k // self.experts

    def flops_per_token(self, seq_len: int | None) -> int:
        """Training FLOPs per token, ``6 Ψ_active + 12 L h T`` (:mod:`.experts`): only k of E experts count."""
        return 6 * self.active_params + 12 * self.layers * self.hidden * (seq_len or 0)


def _find_int(module: nn.Module, names: tuple[str, ...], deep: bool = False) -> int | None:
    """First positive int attribute in ``names`` on the model, its ``config`` or its ``hparams``.

    Only the model and its direct children are read unless ``deep``: an attribute such as ``dim`` or
    ``embed_dim`` deep inside means something else (a softmax axis, one attention layer's width).
    """
    holders = list(module.modules()) if deep else [module, *module.children()]
    for sub in holders:
        for holder in (sub, getattr(sub, "config", None), getattr(sub, "hparams", None)):
            if holder is None:
                continue
            for name in names:
                value = holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def _position_embedding_rows(module: nn.Module) -> int | None:
    """Rows of a learned position embedding (``pos_emb``, ``wpe``, ``position_embeddings``): the max length."""
    for name, sub in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(sub, nn.Embedding) and ("pos" in leaf or leaf == "wpe"):
            return sub.num_embeddings
    return None


def _vocab_of(module: nn.Module, embeddings: list[nn.Embedding]) -> int:
    """The output head's width (a Linear named head / lm_head / output), else the largest embedding that is
    not a position table: with sequences longer than the vocabulary that one is the largest."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) and name.rsplit(".", 1)[-1] in _HEAD_NAMES:
            return sub.out_features
    named = {id(m): name for name, m in module.named_modules()}
    tokens = [m for m in embeddings if not any(p in named[id(m)].lower() for p in ("pos", "wpe"))]
    return (tokens or embeddings)[0].num_embeddings if embeddings else 0


_HEAD_NAMES = ("head", "lm_head", "output")


def shape_from_module(module: nn.Module, source: str | None = None) -> ModelShape:
    """Count ``module``'s parameters and read its transformer shape (works on the meta device)."""
    params = list(module.parameters())  # a tied parameter is yielded once
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    classes = detect_block_classes(module)
    blocks = find_blocks(module, classes) if classes else []
    block_params = sum(p.numel() for p in blocks[0].parameters()) if blocks else 0
    embeddings = sorted(
        (m for m in module.modules() if isinstance(m, nn.Embedding)), key=lambda m: -m.weight.numel()
    )
    hidden = _find_int(module, _HIDDEN)
    if hidden is None and blocks:
        norms = [m for m in blocks[0].modules() if isinstance(m, nn.LayerNorm)]
        hidden = int(norms[0].normalized_shape[0]) if norms else None
    if hidden is None and embeddings:
        hidden = embeddings[0].embedding_dim
    hidden = hidden or 0
    vocab = _find_int(module, _VOCAB) or _vocab_of(module, embeddings)
    heads = _find_int(module, _HEADS, deep=True) or max(1, hidden // 128)
    linears = [m for m in (blocks[0].modules() if blocks else ()) if isinstance(m, nn.Linear)]
    ffn = max((m.out_features for m in linears if m.in_features == hidden), default=4 * hidden)
    moe, _ = count_experts(module)
    top_k = (_find_int(module, TOP_K_NAMES, deep=True) or 1) if moe else 0
    if moe:  # a token's k experts' first projections, not the router's or attention's widths
        ffn = top_k * moe.up_width
        # the unit FSDP gathers is a block with experts, and some models start with dense ones (DeepSeek-V3)
        block_params = max(sum(p.numel() for p in block.parameters()) for block in blocks) if blocks else 0
    return ModelShape(
        params=total,
        trainable=trainable,
        layers=len(blocks),
        block_params=block_params,
        hidden=hidden,
        heads=heads,
        ffn=max(ffn, hidden),
        vocab=vocab,
        seq_len=_find_int(module, _SEQ) or _position_embedding_rows(module),
        source=source or type(module).__name__,
        experts=moe.experts if moe else 0,
        top_k=top_k,
        expert_params=moe.params if moe else 0,
        moe_layers=moe.modules if moe else 0,
        tensors=tensor_table(module),
    )


def shape_from_params(
    params: int | None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    vocab: int | None = None,
    ffn: int | None = None,
    experts: int = 0,
    top_k: int = 0,
) -> ModelShape:
    """A GPT-2-style shape for a parameter count, or a parameter count for a shape.

    A GPT-2 block has ``12 h^2 + 13 h`` parameters (qkv 3h^2, projection h^2, MLP 8h^2, biases and two
    layer norms 13h); the embeddings add ``V h``. Given only the count Ψ, solve ``12 L h^2 = Ψ`` with
    ``h = 128 L`` (GPT-3's proportions), h rounded to a multiple of 64: 7e9 gives L = 33, h = 4224; 175e9
    gives L = 96, h = 12352 (GPT-3: 96, 12288).

    With ``experts`` = E > 0 (routing ``top_k`` = k each token) each block's MLP is E MLPs of ``ffn`` (one
    expert's width) and a router (:func:`.experts.block_params`): ``(4 + 8E) h^2`` per block in place of 12,
    so 47e9 with E = 8 gives L = 35, h = 4416 (Mixtral 8x7B: 32, 4096), 93% of it in the experts.
    """
    if params is None and not (layers and hidden):
        raise PlanInputError(
            "The planner needs a model size: give --params (e.g. 7e9) or --model CLASS_PATH, or both"
            " --layers and --hidden."
        )
    inferred = not (layers and hidden)
    vocab = 32000 if vocab is None else vocab
    per_h2 = 4 + 8 * max(1, experts)  # a block's h^2 terms with the MLP 4h wide: attention 4, each MLP 8
    if inferred:
        assert params is not None
        if layers is None:
            layers = (
                max(1, round((params / (per_h2 * _ASPECT**2)) ** (1 / 3)))
                if hidden is None
                else max(1, round(params / (per_h2 * hidden**2)))
            )
        if hidden is None:
            hidden = max(64, round(math.sqrt(params / (per_h2 * layers)) / 64) * 64)
    assert layers is not None and hidden is not None
    width = ffn or 4 * hidden
    block, expert_block = block_params(hidden, width, experts)
    if params is None:
        params = layers * block + vocab * hidden + 2 * hidden
    block = min(block, params // layers)
    return ModelShape(
        params=params,
        trainable=params,
        layers=layers,
        block_params=block,
        hidden=hidden,
        heads=heads or max(1, hidden // 128),
        ffn=width * max(1, top_k if experts else 1),
        vocab=vocab,
        seq_len=None,
        source="parameter count",
        inferred=inferred,
        experts=experts,
        top_k=top_k if experts else 0,
        # the experts' share of each block, kept when the block is cut down to the count given
        expert_params=round(layers * block * expert_block / block_params(hidden, width, experts)[0]),
        moe_layers=layers if experts else 0,
    )


def model_shape(
    module: nn.Module | None,
    model: str | None,
    init_args: dict[str, Any] | None,
    params: Any,
    dims: dict[str, Any],
    experts: int | None = None,
    top_k: int | None = None,
) -> ModelShape:
    """The shape of ``module``, else of class path ``model`` built on meta, else of the count ``params``;
    ``params`` (a count that wins over the counted one, the experts' share kept), ``dims`` and ``top_k``
    override what the model says. A module's experts are its own: ``experts`` must agree with them."""
    if module is None and model is not None:
        module = build_on_meta(model, init_args)
    if module is None:
        count = parse_count(params, "params") if params is not None else None
        return shape_from_params(count, **dims, experts=experts or 0, top_k=top_k or 0)  # type: ignore[arg-type]
    shape = shape_from_module(module, model)
    if (experts is not None or top_k is not None) and not shape.experts:
        _, why = count_experts(module)
        given = ", ".join(f"{k}={v}" for k, v in (("experts", experts), ("top_k", top_k)) if v is not None)
        raise PlanInputError(
            f"plan({given}): {shape.source} has no experts the strategy can split ({why.rstrip('.')}). Plan it by its"
            " parameter count with experts= and top_k= instead of the module."
        )
    if experts is not None and experts != shape.experts:
        raise PlanInputError(
            f"plan(experts={experts}) disagrees with the {shape.experts} experts of each experts module of"
            f" {shape.source}. Drop experts= (the model's are used), or fix it."
        )
    if top_k is not None:
        if top_k > shape.experts:
            raise PlanInputError(f"plan(top_k={top_k}) is more than the model's {shape.experts} experts.")
        shape = replace(shape, top_k=top_k, ffn=shape.ffn * top_k // shape.top_k)
    if params is not None:
        count = parse_count(params, "params")
        share = shape.expert_params / shape.params if shape.params else 0.0
        # a count given for the model wins over its tensors: the even split of that count
        shape = replace(
            shape, params=count, trainable=count, expert_params=round(count * share), tensors=None
        )
    overrides: dict[str, Any] = {k: v for k, v in dims.items() if v is not None}
    if overrides:  # a shape given for the model wins over its tensors too
        overrides["tensors"] = None
    return replace(shape, **overrides)


def build_on_meta(
    class_path: str,
    init_args: dict[str, Any] | None = None,
    argv: list[str] | None = None,
    flag: str = "--model",
) -> nn.Module:
    """Import ``class_path``, check it is an ``nn.Module``, and build it on the meta device (no memory).

    Constructor arguments come as ``init_args`` (a dict) or as jsonargparse command-line arguments
    (``argv=["--model.n_layers", "12"]``), and are type-checked against the signature as LightningCLI does.
    """
    from jsonargparse import ArgumentParser  # start-up cost: jsonargparse, only for --model class paths

    module_name, _, class_name = class_path.rpartition(".")
    if not module_name:
        raise PlanInputError(
            f"{flag}={class_path!r} is not an import path. Give a dotted path such as lightning_shard.demos.GPT."
        )
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise PlanInputError(
            f"{flag}={class_path!r} could not be imported ({err}). Check the dotted path, and run from the"
            " directory that holds the package or put it on PYTHONPATH."
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise PlanInputError(f"{flag}={class_path!r} is {cls!r}, not an nn.Module subclass.")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(nn.Module, "model", required=True)
    given = " ".join(argv) if argv else str(init_args or {})
    try:
        if argv:
            config = parser.parse_args(["--model", class_path, *argv])
        else:
            config = parser.parse_object({"model": {"class_path": class_path, "init_args": init_args or {}}})
        with torch.device("meta"):
            return getattr(parser, "instantiate", parser.instantiate_classes)(config).model
    except Exception as err:  # jsonargparse's error types vary by version; all of them mean bad arguments
        # jsonargparse lists every Union member it tried; the first problem is the one that matters.
        detail = " ".join(str(err).split()).split(" - Expected a <class 'NoneType'>")[0]
        raise PlanInputError(
            f"{flag}={class_path!r} could not be built with {given}: {detail}. Check the constructor's"
            " argument names and types."
        ) from err
