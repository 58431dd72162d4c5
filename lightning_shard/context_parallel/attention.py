"""Causal attention over a sequence spread across the ranks of a context-parallel group.

Each rank holds the queries, keys and values of its own tokens (two chunks, :mod:`.batch`), shapes
``(b, h, t, d)`` with ``t = T / c``. Two methods run on any backend, gloo included:

- ``"allgather"`` (Llama 3's): keys and values are all-gathered over the group (``(b, h_kv, T, d)``, rank
  after rank); each rank computes its queries against all of them under the causal mask of the global
  positions. The all-gather's backward reduce-scatters the keys' and values' gradients: each rank's keys
  receive the gradient of every rank's queries.
- ``"ulysses"`` (DeepSpeed's): an all-to-all trades the sequence split for a head split (each rank then holds
  ``h / c`` heads over the whole sequence), attention runs as on one process, and a second all-to-all trades
  back. The all-to-all's backward is the reverse all-to-all. Needs the query and key/value head counts
  divisible by ``c``.

``"ring"`` is torch's ring attention (``torch.distributed.tensor.experimental``), on CUDA only.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shard import _compat
from lightning_shard.context_parallel.batch import chunk_positions, group_positions

ContextParallelMethod = Literal["allgather", "ulysses", "ring"]
METHODS: tuple[str, ...] = ("allgather", "ulysses", "ring")


class ContextParallel:
    """This rank's context-parallel group, the method, and the sequence of the step now running.

    ``seq_len`` is set by the strategy when it cuts a batch (:meth:`begin`) and cleared after the step: a
    model called outside a step (one process's whole sequence) runs its attention unchanged.
    """

    def __init__(self, group: Any, size: int, rank: int, method: str, mesh: Any = None) -> None:
        self.group, self.size, self.rank, self.method, self.mesh = group, size, rank, method, mesh
        self.seq_len: int | None = None
        self._ring: nn.Module | None = None
        self._mask: tuple[tuple[Any, ...], Tensor] | None = None

    def causal_mask(self, device: Any, dtype: torch.dtype) -> Tensor:
        """The additive causal mask of this rank's queries over the group's keys, ``(T / c, T)``: 0 where
        query ``i`` sees key ``j`` (``k_pos[j] <= q_pos[i]``), -inf elsewhere.

        One tensor for every layer of the step: SDPA keeps its mask for backward (on CPU it turns a bool
        mask into one of the query's dtype), so a mask built per layer would be kept once per layer.
        """
        assert self.seq_len is not None
        key = (self.seq_len, self.size, self.rank, str(device), dtype)
        if self._mask is None or self._mask[0] != key:
            q_pos = chunk_positions(self.seq_len, self.size, self.rank, device)
            k_pos = group_positions(self.seq_len, self.size, device)
            allowed = k_pos[None, :] <= q_pos[:, None]
            mask = torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill_(
                ~allowed, float("-inf")
            )
            self._mask = (key, mask)
        return self._mask[1]

    def begin(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def end(self) -> None:
        self.seq_len = None

    @property
    def active(self) -> bool:
        return self.seq_len is not None

    def positions(self, device: Any) -> Tensor:
        """The global positions of this rank's tokens in the step now running, ``(1, T / c)``."""
        assert self.seq_len is not None
        return chunk_positions(self.seq_len, self.size, self.rank, device)[None]

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, scale: float | None = None
    ) -> Tensor:
        """Causal attention of this rank's queries over the group's whole sequence: ``q (b, h, t, d)``,
        ``k, v (b, h_kv, t, d)`` with ``h_kv`` dividing ``h``; returns ``(b, h, t, d)``."""
        if not self.active:
            return _local(q, k, v, dropout_p, scale)
        assert self.seq_len is not None
        if q.size(2) * self.size != self.seq_len:
            raise RuntimeError(
                f"context parallelism: attention got {q.size(2)} tokens on this rank, but the step's batch was cut"
                f" to {self.seq_len} / {self.size}. Attention must run on the sequence as the strategy cut it (in"
                " a Fabric loop, call fabric.strategy.end_cut() before running whole sequences)."
            )
        if self.method == "ulysses":
            return _ulysses(self, q, k, v, dropout_p, scale)
        if self.method == "ring":
            return self._ring_attention(q, k, v, dropout_p, scale)
        return _allgather(self, q, k, v, dropout_p, scale)

    def _ring_attention(
        self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float | None
    ) -> Tensor:
        if self._ring is None:
            self._ring = _compat.ring_attention_module(_RingSDPA(), self.mesh)
        k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        return self._ring(q, k, v, dropout_p=dropout_p, scale=scale)


class _RingSDPA(nn.Module):
    """The SDPA call torch's context-parallel style wraps (its inputs become sequence-sharded DTensors)."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, scale: float | None = None
    ) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)


def _local(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float | None) -> Tensor:
    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)


def _masked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout_p: float, scale: float | None) -> Tensor:
    """Attention under an additive mask ``(t_q, t_k)`` (:meth:`ContextParallel.causal_mask`)."""
    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def _repeat_kv(x: Tensor, heads: int) -> Tensor:
    """Grouped-query attention: each key/value head serves ``heads / h_kv`` consecutive query heads."""
    return x if x.size(1) == heads else x.repeat_interleave(heads // x.size(1), dim=1)


# --- all-gathered keys and values ------------------------------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2) over the group; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, size: int) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.size = group, size
        x = x.contiguous()
        out = x.new_empty((size * x.size(0), *x.shape[1:]))
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(out, x, group=group)
        out = out.view(size, *x.shape)  # (c, b, h, t, d)
        return out.permute(1, 2, 0, 3, 4).flatten(2, 3)  # (b, h, c t, d), rank after rank

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        b, h, total, d = grad.shape
        parts = grad.reshape(b, h, ctx.size, total // ctx.size, d).permute(2, 0, 1, 3, 4).contiguous()
        out = parts.new_empty(parts.shape[1:])
        # Every rank's queries attended to this rank's keys: their gradients are summed here.
        _reduce_scatter(out, parts.flatten(0, 1), ctx.group)
        return out, None, None


def _reduce_scatter(out: Tensor, parts: Tensor, group: Any) -> None:
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, parts, group=group)


def _allgather(
    cp: ContextParallel, q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float | None
) -> Tensor:
    assert cp.seq_len is not None
    k_all = _GatherSequence.apply(k, cp.group, cp.size)  # (b, h_kv, T, d)
    v_all = _GatherSequence.apply(v, cp.group, cp.size)
    return _masked(q, k_all, v_all, cp.causal_mask(q.device, q.dtype), dropout_p, scale)


# --- Ulysses: all-to-all between a sequence split and a head split ---------------------------------


class _AllToAll(torch.autograd.Function):
    """``(b, h, t, d)`` split by sequence -> ``(b, h / c, c t, d)`` split by heads (rank after rank along the
    sequence) when ``to_heads``, else the reverse; backward: the other direction."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, size: int, to_heads: bool) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.size, ctx.to_heads = group, size, to_heads
        return (_to_heads if to_heads else _to_sequence)(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return (_to_sequence if ctx.to_heads else _to_heads)(grad, ctx.group, ctx.size), None, None, None


def _to_heads(x: Tensor, group: Any, size: int) -> Tensor:
    b, h, t, d = x.shape
    send = x.reshape(b, size, h // size, t, d).transpose(0, 1).contiguous()  # (c [to rank], b, h/c, t, d)
    recv = torch.empty_like(send)  # (c [from rank], b, h/c, t, d)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)


def _to_sequence(x: Tensor, group: Any, size: int) -> Tensor:
    b, hc, total, d = x.shape
    send = x.reshape(b, hc, size, total // size, d).permute(2, 0, 1, 3, 4).contiguous()  # (c [to rank], ...)
    recv = torch.empty_like(send)  # (c [from rank: its head group], b, h/c, t, d)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, size * hc, total // size, d)


def _ulysses(
    cp: ContextParallel, q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float | None
) -> Tensor:
    assert cp.seq_len is not None
    for name, heads in (("query", q.size(1)), ("key/value", k.size(1))):
        if heads % cp.size:
            raise ValueError(
                f"context_parallel_method='ulysses' splits the heads over the {cp.size} ranks of the group, but"
                f" this attention has {heads} {name} heads on this rank (after tensor parallelism's split, if any),"
                f" not divisible by {cp.size}. Use"
                " context_parallel_method='allgather', or a context_parallel_size that divides the head counts."
            )
    q, k, v = (_AllToAll.apply(x, cp.group, cp.size, True) for x in (q, k, v))  # (b, h/c, T, d), group order
    # In the order of the positions the causal mask is the plain lower triangle: no (T, T) mask is built
    # or kept for backward, only the permutation.
    order = torch.argsort(group_positions(cp.seq_len, cp.size, q.device))  # group index of position p
    q, k, v = (x.index_select(2, order) for x in (q, k, v))
    out = _local(q, k, v, dropout_p, scale)  # (b, h/c, T, d), position order
    out = out.index_select(2, torch.argsort(order))
    return _AllToAll.apply(out, cp.group, cp.size, False)


__all__ = ["METHODS", "ContextParallel", "ContextParallelMethod"]
