"""The op-level ("selective") recompute policy: which op outputs to keep, which to recompute.

Selective activation checkpointing runs a block's forward under a dispatch mode that stores the
outputs of a chosen set of ops; in backward, the block is re-run and every stored op returns its
stored output instead of being recomputed (``torch.utils.checkpoint.create_selective_checkpoint_contexts``).

Which ops to store: the ones whose outputs are expensive to recompute relative to their size.
A matmul ``(m, k) @ (k, n)`` costs ``2mkn`` FLOPs for ``mn`` output elements, i.e. ``2k`` FLOPs per
stored element; a layer norm, GELU or residual add costs a handful of FLOPs per element. So the
default list keeps matmuls, attention kernels (quadratic in sequence length) and collectives
(recomputing them would repeat network traffic), and recomputes everything elementwise. An op
that draws random numbers in a call (attention with ``dropout_p > 0``) is recomputed even when listed:
see :func:`draws_random_numbers`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

SaveMatmuls = Literal["all", "every_other"]

# The matmul family: counted together when ``save_matmuls="every_other"``.
MATMUL_OPS: tuple[str, ...] = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten._scaled_mm.default",
)
ATTENTION_OPS: tuple[str, ...] = (
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
)
# Tensor-parallel collectives: recomputing them would repeat the communication in backward.
COLLECTIVE_OPS: tuple[str, ...] = (
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_reduce.default",
)
DEFAULT_SAVE_OPS: tuple[str, ...] = MATMUL_OPS + ATTENTION_OPS + COLLECTIVE_OPS

OpSpec = str | torch._ops.OpOverload


def op_from_string(name: str, flag: str) -> torch._ops.OpOverload:
    """``"aten.mm.default"`` (optionally prefixed ``"torch.ops."``) -> ``torch.ops.aten.mm.default``."""
    path = name.removeprefix("torch.ops.")
    parts = path.split(".")
    if len(parts) != 3:
        raise ValueError(
            f"{flag} entry {name!r} is not an op name of the form 'namespace.op.overload'."
            " Write e.g. 'aten.mm.default' (the overload is part of the name: 'aten.mm' alone is ambiguous)."
        )
    namespace, op, overload = parts
    try:
        resolved = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError) as err:
        raise ValueError(
            f"{flag} entry {name!r} is not a registered torch op ({err}). Check the spelling against"
            " torch.ops, e.g. 'aten.mm.default', 'aten._scaled_dot_product_flash_attention.default'."
        ) from err
    if not isinstance(resolved, torch._ops.OpOverload):
        raise ValueError(f"{flag} entry {name!r} resolved to {resolved!r}, not an op overload.")
    return resolved


def resolve_save_ops(spec: Iterable[OpSpec] | None, flag: str) -> frozenset[torch._ops.OpOverload]:
    """The user's ``save_ops`` (op overloads or their names) as a set of overloads; None = the default list."""
    if spec is None:
        # Some default ops exist only in some builds (e.g. no collectives without distributed).
        return frozenset(op for op in (_try_op(name) for name in DEFAULT_SAVE_OPS) if op is not None)
    if isinstance(spec, (str, torch._ops.OpOverload)):
        spec = [spec]
    ops: set[torch._ops.OpOverload] = set()
    for entry in spec:
        if isinstance(entry, str):
            ops.add(op_from_string(entry, flag))
        elif isinstance(entry, torch._ops.OpOverload):
            ops.add(entry)
        elif isinstance(entry, torch._ops.OpOverloadPacket):
            raise ValueError(
                f"{flag} entry {entry!r} is an op packet, not an overload. Name the overload,"
                f" e.g. torch.ops.{entry._qualified_op_name.replace('::', '.')}.default."
            )
        else:
            raise ValueError(f"{flag} entry {entry!r} is neither a torch op overload nor an op name string.")
    if not ops:
        raise ValueError(
            f"{flag}=[] saves nothing, which is policy='full'. Use policy='full' or name some ops."
        )
    return frozenset(ops)


def _try_op(name: str) -> torch._ops.OpOverload | None:
    try:
        return op_from_string(name, "DEFAULT_SAVE_OPS")
    except ValueError:
        return None


MATMUL_OVERLOADS = frozenset(op for op in (_try_op(name) for name in MATMUL_OPS) if op is not None)


class _SavePolicy:
    """``policy_fn`` for one checkpointed call: a fresh instance per call, so the matmul count restarts."""

    def __init__(self, save_ops: frozenset[torch._ops.OpOverload], save_matmuls: SaveMatmuls) -> None:
        self.save_ops = save_ops
        self.every_other = save_matmuls == "every_other"
        self.matmuls_seen = {False: 0, True: 0}  # keyed by ctx.is_recompute: both passes must agree

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op not in self.save_ops or draws_random_numbers(op, args, kwargs):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if self.every_other and op in MATMUL_OVERLOADS:
            self.matmuls_seen[ctx.is_recompute] += 1
            # Recompute the 2nd, 4th, ... matmul: halves the stored matmul outputs for half the matmul recompute.
            if self.matmuls_seen[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE


def draws_random_numbers(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``op`` consumes the random stream: such an op is recomputed, never stored.

    The recompute replays the block from the random state its forward started with. A stored op is
    skipped there, so it would not advance the generator, and every random op after it in the block
    (a dropout after the attention) would draw a different mask than in the forward: wrong gradients,
    no error. Seen with fused attention and ``dropout_p > 0`` on CUDA (GPT-2's default attention
    dropout). Fused attention kernels are tagged as seeded whether or not they drop anything, so for
    them the ``dropout_p`` argument decides: at 0 they draw nothing and are stored as usual.
    """
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    names = [argument.name for argument in op._schema.arguments]
    if "dropout_p" not in names:
        return True
    index = names.index("dropout_p")
    p = kwargs.get("dropout_p", args[index] if index < len(args) else 0.0)
    return bool(p)


def selective_contexts(
    save_ops: frozenset[torch._ops.OpOverload], save_matmuls: SaveMatmuls
) -> tuple[AbstractContextManager, AbstractContextManager]:
    """The (forward, recompute) context pair for one selectively checkpointed call."""
    return create_selective_checkpoint_contexts(_SavePolicy(save_ops, save_matmuls))


def op_names(ops: Sequence[torch._ops.OpOverload] | frozenset[torch._ops.OpOverload]) -> list[str]:
    """Sorted display names (``"aten.mm.default"``) of a set of op overloads."""
    return sorted(f"{op.namespace}.{op._opname}.{op._overloadname}" for op in ops)
