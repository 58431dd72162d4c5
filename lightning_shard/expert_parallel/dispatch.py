"""Token dispatch over an expert-parallel group: each (token, expert) pair travels to the rank that holds the
expert, the experts run there, and the results travel back to be combined with the routing weights.

Rank ``r`` of a group of ``ep`` ranks holds the contiguous block of experts ``r * E/ep .. (r + 1) * E/ep - 1``
(:class:`ExpertShard`). One layer, with ``T`` tokens of width ``H`` on this rank and ``k`` experts per token:

1. the ``S = T * k`` pairs are sorted by expert id (stable), which groups them by owner rank;
2. the per-expert counts ``[E]`` go by an equal-split all-to-all: each rank learns how many rows every other
   rank sends to each of its ``E/ep`` experts (``received``, ``[ep, E/ep]``); this is the layer's one host sync;
3. the rows go by an uneven all-to-all: ``[S, H]`` out, ``[R, H]`` in, source rank by source rank, and within a
   source expert by expert;
4. the received rows are regrouped expert by expert (``[R, H]``), the local experts run (the ``compute``
   callback: grouped GEMM or a loop, :mod:`.grouped`), and the rows go back to source-rank order;
5. the reverse uneven all-to-all returns ``[S, H]`` in the sorted order of step 1; unsorted to (token, slot)
   order, each row is multiplied by its routing weight and the ``k`` rows of a token summed: ``[T, H]``, what the
   unsharded experts module returns.

Dropless: every pair is sent (no capacity factor). Both token all-to-alls are :class:`_AllToAll`, whose backward
is the reverse all-to-all, so the gradients of the rows return to the ranks that sent them and every expert's
gradient sums the contributions of every rank's tokens. The routing weights are applied on the sender, so their
gradient (the router's) never leaves the rank.

gloo: ``all_to_all_single`` with uneven split sizes works on CPU tensors (checked with torch 2.13: uneven and
zero-size splits, float32 / bfloat16 / float16 / int64 rows, 2 ranks), so gloo and NCCL take the same path;
no padding to the largest split and no send/recv emulation is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

#: ``compute(rows, counts) -> out``: ``rows`` ``[R, H]`` grouped expert by expert (``counts[e]`` rows for local
#: expert ``e``, in order), ``out`` ``[R, H_out]`` the experts' outputs in the same order, before routing weights.
ExpertCompute = Callable[[Tensor, list[int]], Tensor]


@dataclass
class ExpertShard:
    """The experts one rank holds: ``num_experts`` in all, split whole over the 1-D ``mesh``.

    ``received`` is filled by each forward: ``[ep, E/ep]``, how many rows each source rank sent to each local
    expert (the load-balance metric, and the proof that tokens crossed ranks).
    """

    num_experts: int
    mesh: DeviceMesh
    received: Tensor | None = field(default=None, repr=False)
    gradient_scale: float = 1.0
    """What the experts' weight gradients are multiplied by in backward (the local gradient sums every rank of
    the group's tokens; under a data-parallel mean over the ranks left, ``1 / ep`` makes it the mean over
    every data-parallel rank's batch, as the other parameters' is)."""

    @property
    def group(self) -> Any:
        return self.mesh.get_group()

    @property
    def ep_size(self) -> int:
        return self.mesh.size()

    @property
    def ep_rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        """Global id of this rank's first expert."""
        return self.ep_rank * self.num_local


class Traffic:
    """Bytes this process has put into the expert all-to-alls (the per-expert counts, the token rows forward and
    their gradients backward): ``bytes`` every chunk, ``crossed_bytes`` the chunks addressed to other ranks (the
    chunk a rank sends itself is a local copy). Read by benchmarks/bench_moe.py, as ``engines._gloo.traffic``
    counts the FSDP all-gathers."""

    def __init__(self) -> None:
        self.bytes = self.crossed_bytes = 0

    def reset(self) -> None:
        self.bytes = self.crossed_bytes = 0


#: This process's expert all-to-all bytes.
traffic = Traffic()


def _all_to_all_single(
    out: Tensor, rows: Tensor, out_sizes: list[int] | None, in_sizes: list[int] | None, group: Any
) -> None:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    own = rows.shape[0] // size if in_sizes is None else in_sizes[rank]  # rows this rank sends itself
    traffic.bytes += rows.nbytes
    traffic.crossed_bytes += rows.nbytes - own * (rows.nbytes // max(rows.shape[0], 1))
    dist.all_to_all_single(out, rows, out_sizes, in_sizes, group=group)


def _exchange(rows: Tensor, out_sizes: list[int], in_sizes: list[int], group: Any) -> Tensor:
    out = rows.new_empty((sum(out_sizes), *rows.shape[1:]))
    _all_to_all_single(out, rows.contiguous(), out_sizes, in_sizes, group)
    return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, differentiable: the backward sends the gradient rows back
    the way the rows came.

    torch has two: ``torch.distributed.nn.functional.all_to_all_single`` does the same with autograd but is
    deprecated in torch 2.13 (a warning on every call), and its named replacement,
    ``torch.distributed._functional_collectives.all_to_all_single_autograd``, is private and returns an
    asynchronous tensor that must be waited on before a kernel reads it (transformers met null pointers there,
    huggingface/transformers#49421). This one is the public eager collective and ten lines.
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, out_sizes: list[int], in_sizes: list[int], group: Any) -> Tensor:
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        return _exchange(rows, out_sizes, in_sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_sizes, in_sizes = ctx.sizes
        return _exchange(grad, in_sizes, out_sizes, ctx.group), None, None, None


def all_to_all(rows: Tensor, out_sizes: list[int], in_sizes: list[int], group: Any = None) -> Tensor:
    """Send ``rows[sum(in_sizes[:j]) : sum(in_sizes[:j+1])]`` to rank ``j`` of ``group``; receive
    ``out_sizes[j]`` rows from rank ``j``, concatenated in rank order. Differentiable."""
    out: Tensor = _AllToAll.apply(rows, out_sizes, in_sizes, group)
    return out


def _inverse(order: Tensor) -> Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


# Eager under compile=...: its shapes follow the routing (counts read on the host between the collectives), so
# a compiled block runs the rest of itself as graphs around this call.
@torch.compiler.disable
def dispatch_combine(
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    compute: ExpertCompute,
    shard: ExpertShard,
) -> Tensor:
    """The experts' output for this rank's tokens, computed by the ranks that hold the experts.

    ``hidden_states`` ``[..., H]``, ``top_k_index`` / ``top_k_weights`` ``[..., k]`` (global expert ids and their
    weights, as the model's router gave them); returns ``[..., H_out]`` in ``hidden_states``'s dtype. Every rank of
    ``shard.mesh`` must call it, once per layer, in the same order (it runs three collectives).
    """
    ep, local, group = shard.ep_size, shard.num_local, shard.group
    width, k = hidden_states.shape[-1], top_k_index.shape[-1]
    tokens = hidden_states.reshape(-1, width)  # [T, H]
    expert_ids = top_k_index.reshape(-1)  # [S], S = T * k
    order = torch.argsort(expert_ids, stable=True)  # [S] pairs by expert, hence by owner rank
    send_counts = torch.bincount(expert_ids, minlength=shard.num_experts)  # [E]
    if send_counts.numel() != shard.num_experts:
        raise ValueError(
            f"expert parallelism: the router chose expert {int(expert_ids.max())}, but the experts module holds"
            f" {shard.num_experts} experts (ids 0..{shard.num_experts - 1})."
        )
    recv_counts = torch.empty_like(send_counts)
    _all_to_all_single(recv_counts, send_counts, None, None, group)  # [E] = [ep (source), E/ep]
    received = recv_counts.view(ep, local)
    shard.received = received.detach()
    send_host, recv_host = torch.stack([send_counts.view(ep, local), received]).tolist()  # the one host sync
    send_sizes, recv_sizes = [sum(row) for row in send_host], [sum(row) for row in recv_host]
    per_expert = [sum(column) for column in zip(*recv_host, strict=True)]  # [E/ep] rows per local expert

    rows = all_to_all(tokens.index_select(0, order // k), recv_sizes, send_sizes, group)  # [R, H]
    local_ids = torch.arange(local, device=rows.device).repeat(ep)  # [ep * E/ep]: source-major blocks
    local_ids = local_ids.repeat_interleave(received.reshape(-1), output_size=rows.shape[0])  # [R]
    by_expert = torch.argsort(local_ids, stable=True)  # [R] rows expert by expert, source order within one
    out = compute(rows.index_select(0, by_expert), per_expert)  # [R, H_out]
    out = out.index_select(0, _inverse(by_expert))  # [R, H_out] back in source-rank order
    back = all_to_all(out, send_sizes, recv_sizes, group)  # [S, H_out] in `order`
    pairs = back.index_select(0, _inverse(order))  # [S, H_out] in (token, slot) order
    pairs = pairs.view(tokens.shape[0], k, back.shape[-1])  # [T, k, H_out]
    combined = (pairs * top_k_weights.reshape(-1, k, 1)).sum(dim=1).to(hidden_states.dtype)  # [T, H_out]
    shape = (*hidden_states.shape[:-1], back.shape[-1])
    # Not a view of a fresh tensor where no reshape is needed: FSDP2 warns on a view returned by a module it
    # wraps (an in-place op on it would skip its pre-backward hook).
    return combined if combined.shape == shape else combined.reshape(shape)
