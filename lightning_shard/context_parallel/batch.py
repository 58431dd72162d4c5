"""A batch as Lightning hands it, cut along the sequence for this rank of its context-parallel group.

Load balance for causal attention: the sequence of length ``T`` is cut into ``2c`` chunks of ``T / 2c``
tokens and rank ``r`` of the ``c`` ranks keeps chunks ``r`` and ``2c - 1 - r`` (a head and a tail). A query
at position ``p`` attends to ``p + 1`` keys, so the head chunks are cheap and the tail chunks dear; one of
each gives every rank the same work (``sum = (2c - 1 - r) + r``, the same for every ``r``).

What is cut: every tensor of the batch (nested in dicts, lists and tuples) whose dim 1 has the batch's
sequence length. The keys Hugging Face models read are checked first:

- ``labels`` (aligned with ``input_ids``, the model shifts them): shifted on the whole sequence before the
  cut (``shift_labels = labels[:, 1:]`` padded with -100), so no target is lost at a chunk border, and
  handed on as ``shift_labels`` (transformers' causal-LM loss reads them instead of shifting again);
- ``attention_mask``: must be all ones (no padding): the attention computed under context parallelism is
  causal over the whole sequence;
- ``position_ids``: must count ``0 .. T-1`` (packed sequences are not split).

A tuple batch (``(inputs, targets)``, targets already aligned as in the demo GPT) is cut as it is.

Outputs go the other way: :func:`gather_outputs` puts the group's chunks of each output back into one
sequence, in position order (``predict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def chunk_positions(seq_len: int, size: int, rank: int, device: Any = None) -> Tensor:
    """The global positions rank ``rank`` of ``size`` holds: chunks ``rank`` and ``2 size - 1 - rank``."""
    chunk = seq_len // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail_start = (2 * size - 1 - rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])


def group_positions(seq_len: int, size: int, device: Any = None) -> Tensor:
    """The positions of the whole group, rank after rank (the order an all-gather returns them in)."""
    return torch.cat([chunk_positions(seq_len, size, r, device) for r in range(size)])


@dataclass
class SplitBatch:
    """This rank's part of a batch."""

    batch: Any
    seq_len: int
    """The whole sequence length (each rank holds ``seq_len / size`` tokens)."""
    local_targets: int | None
    """Targets (labels other than -100) on this rank; ``None`` where the batch names no ``labels``."""
    group_targets: int | None
    """Targets of the whole group."""

    def loss_weight(self, size: int) -> float:
        """``c x n_r / N``: the rank's mean loss times it, averaged over the ``c`` ranks (as the gradient
        reduction does), is the mean over every target of the group."""
        if self.local_targets is None or not self.group_targets:
            return 1.0  # equal chunks, every token a target: the plain mean is already right
        return size * self.local_targets / self.group_targets


def split_batch(batch: Any, size: int, rank: int, owner: str = "ShardStrategy") -> SplitBatch:
    """Cut ``batch`` for rank ``rank`` of ``size`` (see the module docstring); ``ValueError`` naming the fix
    where it cannot be cut."""
    seq_len = _sequence_length(batch, owner, size)
    if seq_len % (2 * size):
        raise ValueError(
            f"{owner}(context_parallel_size={size}) cuts each sequence into 2 x {size} = {2 * size} chunks (a head"
            f" and a tail per rank, for causal load balance), but the batch's sequence length {seq_len} is not"
            f" divisible by {2 * size}. Pad the sequences to a multiple of {2 * size} (labels -100 at the padding)."
        )
    index = chunk_positions(seq_len, size, rank)
    local = group = None
    if isinstance(batch, Mapping):
        batch = dict(batch)
        _check_mask(batch.get("attention_mask"), owner, size)
        _check_positions(batch.get("position_ids"), seq_len, owner, size)
        if isinstance(batch.get("labels"), Tensor) and "shift_labels" not in batch:
            batch["shift_labels"] = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
        targets = batch.get("shift_labels")
        if isinstance(targets, Tensor):
            group, local = _targets(targets), _targets(targets.index_select(1, index.to(targets.device)))
    return SplitBatch(_cut(batch, seq_len, index), seq_len, local, group)


def _cut(value: Any, seq_len: int, index: Tensor) -> Any:
    if isinstance(value, Tensor):
        if value.dim() >= 2 and value.size(1) == seq_len:
            return value.index_select(1, index.to(value.device))
        return value
    if isinstance(value, Mapping):
        return {key: _cut(item, seq_len, index) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_cut(item, seq_len, index) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cut(item, seq_len, index) for item in value)
    return value


def _sequence_length(batch: Any, owner: str, size: int) -> int:
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
        first: Tensor | None = batch["input_ids"]
    else:
        first = _first_sequence(batch)
    if first is None or first.dim() < 2:
        raise ValueError(
            f"{owner}(context_parallel_size={size}) cuts the batch along dim 1 (batch, sequence, ...), but the"
            f" batch ({type(batch).__name__}) holds no tensor with a sequence dimension. Hand the training step"
            " (batch, sequence) tensors: input ids, labels, ..."
        )
    return first.size(1)


def _first_sequence(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value if value.dim() >= 2 else None
    items = (
        value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    )
    for item in items:
        found = _first_sequence(item)
        if found is not None:
            return found
    return None


def _check_mask(mask: Any, owner: str, size: int) -> None:
    if mask is None:
        return
    if not isinstance(mask, Tensor) or mask.dim() != 2 or not bool(mask.bool().all()):
        what = "a padding mask (zeros in it)" if isinstance(mask, Tensor) and mask.dim() == 2 else "this mask"
        raise ValueError(
            f"{owner}(context_parallel_size={size}) cannot split {what}: attention under context parallelism is"
            " causal over the whole sequence, with no other mask. Pack the sequences to full length (labels -100"
            " where there is no target) and pass attention_mask=None or all ones, or train without context"
            " parallelism."
        )


def _check_positions(positions: Any, seq_len: int, owner: str, size: int) -> None:
    if positions is None:
        return
    expected = torch.arange(seq_len, device=positions.device).expand_as(positions)
    if positions.dim() != 2 or not torch.equal(positions, expected):
        raise ValueError(
            f"{owner}(context_parallel_size={size}) gives the model the positions 0 .. T-1 of each chunk it"
            " cuts; the batch's position_ids count otherwise (packed sequences?), which context parallelism"
            " cannot split. Drop position_ids from the batch (the strategy supplies them)."
        )


def scale_loss(output: Any, weight: float) -> Any:
    """``training_step``'s output with its loss times ``weight`` (a tensor, or a dict with ``"loss"``)."""
    if weight == 1.0:
        return output
    if isinstance(output, Tensor):
        return output * weight
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": output["loss"] * weight}
    return output


def target_weight(target: Any, cut: Any, size: int) -> float:
    """``c x n_r / N`` for a target tensor ``(b, T, ...)`` and this rank's cut of it ``(b, T / c, ...)``: the
    targets other than -100 the rank holds over the group's (:meth:`SplitBatch.loss_weight`). 1 for a target
    that is not an integer tensor, or that was not cut (no sequence dimension)."""
    if not isinstance(target, Tensor) or not isinstance(cut, Tensor) or target.is_floating_point():
        return 1.0
    if cut.shape == target.shape:
        return 1.0
    targets = SplitBatch(cut, target.size(1), _targets(cut), _targets(target))
    return targets.loss_weight(size)


def _targets(labels: Tensor) -> int:
    return int((labels != IGNORE_INDEX).sum())


def gather_sequence(tensor: Tensor, group: Any, size: int) -> Tensor:
    """The whole sequence of a tensor cut as :func:`split_batch` cuts (this rank's head and tail chunks
    along dim 1, ``(b, T / c, ...)``), from every rank of ``group``, in position order: ``(b, T, ...)``.
    Outputs only: no gradient flows back."""
    tensor = tensor.detach().contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    gathered = torch.cat(parts, dim=1)  # rank after rank: group_positions' order
    order = torch.argsort(group_positions(gathered.size(1), size, gathered.device))
    return gathered.index_select(1, order)


def gather_outputs(value: Any, seq_len: int, group: Any, size: int) -> Any:
    """``value`` (nested in dicts, lists and tuples) with every tensor whose dim 1 is this rank's share of
    the sequence, ``seq_len / size``, gathered to the whole sequence (:func:`gather_sequence`)."""
    if isinstance(value, Tensor):
        if value.dim() >= 2 and value.size(1) * size == seq_len:
            return gather_sequence(value, group, size)
        return value
    if isinstance(value, Mapping):
        return {key: gather_outputs(item, seq_len, group, size) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(gather_outputs(item, seq_len, group, size) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(gather_outputs(item, seq_len, group, size) for item in value)
    return value


def cut_for_rank(cp: Any, batch: Any, owner: str = "ShardStrategy") -> tuple[Any, float]:
    """``batch`` cut to this rank's chunks of each sequence, with the group's sequence set on ``cp`` (a
    :class:`~lightning_shard.context_parallel.ContextParallel`) until the next cut: a recompute during
    backward needs it; and the weight of this rank's mean loss (:meth:`SplitBatch.loss_weight`). Both doors
    cut here, per step."""
    split = split_batch(batch, cp.size, cp.rank, owner)
    cp.begin(split.seq_len)
    return split.batch, split.loss_weight(cp.size)


def cut_pair(cp: Any, inputs: tuple[Any, ...], target: Any) -> tuple[tuple[Any, ...], Any, float]:
    """Pipeline stages: ``(inputs, target)`` cut by :func:`cut_for_rank` (``cp`` ``None``: nothing cut), and
    the weight of this rank's mean loss counted on the target (:func:`target_weight`). The stages'
    activations then carry ``T / c`` tokens, the shapes a schedule infers on its first step."""
    if cp is None:
        return inputs, target, 1.0
    (cut_inputs, cut_target), _ = cut_for_rank(cp, (inputs, target))
    return cut_inputs, cut_target, target_weight(target, cut_target, cp.size)


def group_mean(cp: Any, loss: Tensor) -> Tensor:
    """A rank's weighted loss averaged over its context-parallel group: the loss of the whole sequences, what
    one process computes (without context parallelism, the loss itself)."""
    if cp is None:
        return loss
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=cp.group)
    return loss / cp.size
