"""Mixture-of-experts models in the plan: the experts a model holds, and what expert parallelism changes per device.

A mixture-of-experts (MoE) model has ``E`` experts in each of its ``L_moe`` experts modules, routes each token
to ``k`` of them (top-k), and holds ``Ψ_E`` of its ``Ψ`` parameters in the experts' weights. Read from a module
(the experts modules ``ShardStrategy(expert_parallel_size=...)`` would split, found by its own plan discovery,
no process group needed), or estimated from a parameter count: each block's MLP replaced by ``E`` MLPs of the
same shape and a router (:func:`block_params`).

Under ``ShardStrategy(expert_parallel_size=e)`` (docs/expert_parallel.md) ``e`` ranks carved from the shard
dimension of ``N`` ranks (the data-parallel ranks of one shard group, context-parallel ranks included) each hold
``E / e`` whole experts, and at stages 2-3 FSDP2 shards each rank's expert block over the ``N / e`` ranks left::

    expert parameters per device    stages 0-1:  Ψ_E / e        stages 2-3:  (Ψ_E / e) / (N / e) = Ψ_E / N

and their gradients and optimizer state alike (the other ``Ψ - Ψ_E`` as without experts), except that stage 1
partitions each block's optimizer state over the ``N / e`` ranks holding the block (as ZeRO-1 partitions the
rest over all ``N``): ``Ψ_E / N`` of it per device. So at stages 0-1 expert parallelism divides the experts'
parameters and gradients by ``e``; at stages 2-3 the state per device is the same, but what a device gathers
is: its ``E / e`` experts of a unit, not all ``E``.

Each MoE layer sends every token's ``k`` rows to the experts' ranks and back by all-to-all. What autograd
keeps of them (each pair's routed input and output, ``k h (r + c)`` per token and layer) an MoE block keeps
without expert parallelism too, as its experts' gathered rows (:func:`.activations.block_activation_bytes`). What
expert parallelism adds is the exchange itself: while one layer dispatches, the send buffer and the receive
buffer of its ``T k`` rows exist together, in the residual stream's dtype (``r`` bytes: fp32 under autocast,
whose layer norms run in fp32); the combine and the backward's exchanges move the same rows in ``c <= r``::

    all-to-all buffers = 2 x T x k x h x r                  (one layer at a time: a working buffer)

Active parameters: a token uses ``k`` of ``E`` experts, so ``Ψ_active = Ψ - Ψ_E + Ψ_E x k / E``, and a training
step does ``6 Ψ_active + 12 L h T`` FLOPs per token (PaLM's formula, as ``MFUMonitor``'s docstring derives it:
2 per multiply-add forward, twice that backward, plus attention's scores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from lightning_shard.expert_parallel import ExpertLayout, planned_experts
from lightning_shard.units import PlanInputError

# The router's top-k as models name it: HF configs (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss), the
# example GPT's MoE blocks and hyperparameters.
TOP_K_NAMES = ("num_experts_per_tok", "top_k", "moe_top_k", "experts_per_token")


@dataclass(frozen=True)
class ExpertCount:
    """What a module's experts modules hold (see the module docstring)."""

    experts: int
    """E, common to every experts module (their greatest common divisor if they differ)."""
    params: int
    """Ψ_E: the parameters of every experts module's expert weights (split by expert on dim 0)."""
    modules: int
    """L_moe: the experts modules."""
    up_width: int
    """One expert's first projection's outputs (``2I`` for gated experts' ``gate_up_proj``)."""


def count_experts(module: nn.Module) -> tuple[ExpertCount | None, str]:
    """The experts ``expert_parallel_size`` would split in ``module`` (found as the strategy finds them: the
    model's ``expert_parallel_plan`` or Hugging Face ``base_model_ep_plan``), or None and why not."""
    try:  # the strategy's own discovery (no process group): the planner and the strategy split the same modules
        layouts = [(name, sub, ExpertLayout.of(sub, name)) for name, sub in planned_experts(module)]
        counts = [layout.num_experts(sub, name) for name, sub, layout in layouts]
    except ValueError as err:
        return None, str(err)
    if not layouts:
        return None, f"{type(module).__name__} has no experts modules"
    _, sub, layout = layouts[0]
    up = getattr(sub, layout.up)
    return (
        ExpertCount(
            experts=math.gcd(*counts),
            params=sum(getattr(s, p).numel() for _, s, lay in layouts for p in lay.expert_parameters),
            modules=len(layouts),
            up_width=int(up.shape[2] if layout.transposed else up.shape[1]),
        ),
        "",
    )


def check_flags(
    experts: object, top_k: object, expert_parallel_size: object, model_given: bool, cli: bool = False
) -> None:
    """``experts`` / ``top_k`` / ``expert_parallel_size`` as given, before any model is read, named as
    ``plan(...)`` or the CLI takes them. Without a model (a parameter count) E and k come together."""

    def named(name: str) -> str:
        return f"--{name.replace('_', '-')}" if cli else f"{name}="

    def flag(name: str, value: object) -> str:
        return f"--{name.replace('_', '-')} {value}" if cli else f"plan({name}={value!r})"

    for name, value in (("experts", experts), ("top_k", top_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlanInputError(f"{flag(name, value)} must be a whole number >= 1.")
    e = expert_parallel_size
    if e not in (None, "auto") and (isinstance(e, bool) or not isinstance(e, int) or e < 1):
        raise PlanInputError(
            f"{flag('expert_parallel_size', e)} must be a whole number >= 1 (1: off), or 'auto' to search it."
        )
    if not model_given and (experts is None) != (top_k is None):
        given, missing = ("experts", "top_k") if top_k is None else ("top_k", "experts")
        value = experts if top_k is None else top_k
        raise PlanInputError(
            f"{flag(given, value)} needs {named(missing)} too: a mixture of experts is planned from E experts per layer"
            f" and the k each token is routed to, e.g. {flag('experts', 8)} and {flag('top_k', 2)}."
        )
    if not model_given and experts is None and isinstance(e, int) and e > 1:
        raise PlanInputError(
            f"{flag('expert_parallel_size', e)} splits experts, and a parameter count has none: give"
            f" {named('experts')} and {named('top_k')} for a mixture of experts."
        )
    if isinstance(experts, int) and isinstance(top_k, int) and top_k > experts:
        raise PlanInputError(
            f"{flag('top_k', top_k)} routes each token to more experts than the {experts} there are"
            f" ({flag('experts', experts)}). Use a top_k between 1 and {experts}."
        )
    if isinstance(e, int) and isinstance(experts, int) and experts % e:
        raise PlanInputError(
            f"{flag('expert_parallel_size', e)} does not divide the {experts} experts ({flag('experts', experts)}):"
            f" each rank holds E / e whole experts. Use one of {_divisors(experts)}."
        )


def check_fixed(expert_parallel_size: int, experts: int, ranks: int, source: str) -> None:
    """A fixed ``expert_parallel_size`` must find experts to split, and divide them and the shard group's ranks."""
    e = expert_parallel_size
    if e > 1 and not experts:
        raise PlanInputError(
            f"plan(expert_parallel_size={e}) splits experts, and the model ({source}) has none. Give experts= and"
            " top_k= (--experts, --top-k) for a mixture of experts, or expert_parallel_size=1."
        )
    if experts and experts % e:
        raise PlanInputError(
            f"plan(expert_parallel_size={e}) does not divide the {experts} experts of {source}: each rank holds"
            f" E / e whole experts. Use one of {_divisors(experts)}."
        )
    if ranks % e:
        raise PlanInputError(
            f"plan(expert_parallel_size={e}) does not divide the {ranks} ranks of a shard group (world_size /"
            " (tensor_parallel_size x replicate_size x pipeline_parallel_size)), which the expert-parallel"
            f" groups are carved from. Use one of {[d for d in _divisors(ranks) if not experts or experts % d == 0]}."
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parallel_sizes(
    ranks: int, experts: int, fixed: int | str = "auto", limit: int | None = None
) -> tuple[int, ...]:
    """The ``expert_parallel_size`` values to weigh for a shard dimension of ``ranks``: ``fixed`` if it divides
    them (else none), or every ``e`` dividing both the ranks and ``E``, at most ``limit`` (a node: the
    all-to-all of every layer wants the node's fast links). A dense model (``E = 0``) has only ``e = 1``."""
    if fixed != "auto":
        assert isinstance(fixed, int)
        return (fixed,) if ranks % fixed == 0 else ()
    if experts < 2:
        return (1,)
    return tuple(e for e in _divisors(ranks) if experts % e == 0 and (limit is None or e <= limit))


def block_params(hidden: int, width: int, experts: int) -> tuple[int, int]:
    """(one block's parameters, of which its experts') for a GPT-2-style block whose MLP of inner ``width``
    (two matrices, two biases: ``2 h f + f + h``) is, with ``experts`` = E > 0, E such MLPs and a router
    ``h x E``. Attention and the two layer norms are ``4 h^2 + 8 h`` either way."""
    mlp = 2 * hidden * width + width + hidden
    attention = 4 * hidden * hidden + 8 * hidden
    if not experts:
        return attention + mlp, 0
    return attention + hidden * experts + experts * mlp, experts * mlp


def all_to_all_bytes(tokens: float, top_k: int, hidden: int, r: int) -> float:
    """``2 x T x k x h x r``: one layer's send and receive buffers of the dispatch (module docstring)."""
    return 2 * tokens * top_k * hidden * r


__all__ = [
    "TOP_K_NAMES",
    "ExpertCount",
    "all_to_all_bytes",
    "block_params",
    "check_fixed",
    "check_flags",
    "count_experts",
    "parallel_sizes",
]
