"""Context parallelism in a Fabric loop: one explicit call cuts each batch, ``fabric.backward`` weights the loss.

The Trainer cuts the batch in its step hooks (:mod:`lightning_shard.trainer._steps`); a Fabric loop has none,
so it hands each batch to ``fabric.strategy.cut_batch(batch)`` before the forward. That returns this rank's
chunks of every sequence tensor (:func:`~lightning_shard.context_parallel.split_batch`: labels shifted on
the whole sequence first and passed on as ``shift_labels``) and sets the group's sequence, so the model's
attention runs over the group and its positions are the chunks' global ones.

``fabric.backward(loss)`` multiplies the loss, which must be the mean over this rank's targets, by
``c x n_r / N`` (``n_r`` targets on this rank, ``N`` in the group): the gradient reduction averages over the
group's ``c`` ranks, so the gradients are those of the mean over every target of the group, one process's.

The sequence stays set until the next ``cut_batch`` or :meth:`~FabricContextParallel.end_cut` (a recompute
during backward needs it); after ``end_cut`` the model runs whole sequences as on one process.

With pipeline stages the loop hands whole batches to ``fabric.strategy.pipeline_step``, which cuts them
itself (:func:`~lightning_shard.context_parallel.batch.cut_pair`), as the Trainer's pipeline steps do.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_shard.config import ShardConfig
from lightning_shard.context_parallel import ContextParallel
from lightning_shard.context_parallel.batch import cut_for_rank


class FabricContextParallel:
    """What :class:`~lightning_shard.fabric.ShardFabricStrategy` adds for ``context_parallel_size > 1``."""

    config: ShardConfig
    context_parallel: ContextParallel | None
    _model: nn.Module | None
    _cut_weight: float = 1.0
    _cut_by_loop: bool = False

    def cut_batch(self, batch: Any) -> Any:
        """This rank's part of ``batch`` (each rank of a context-parallel group calls it on the same batch).

        Every tensor of the batch (in dicts, lists, tuples) whose dim 1 has the sequence length ``T`` keeps
        this rank's two chunks of ``T / 2c`` tokens; a dict batch with ``labels`` gains ``shift_labels``.
        The model then runs its attention over the group, and ``fabric.backward`` weights the loss of this
        batch (:attr:`loss_weight`). Without context parallelism the batch comes back as it is, so one loop
        serves every ``context_parallel_size``.
        """
        cp = self.context_parallel
        if cp is None:
            if self.config.context_parallel_size > 1:
                raise RuntimeError(
                    f"ShardFabricStrategy(context_parallel_size={self.config.context_parallel_size}).cut_batch"
                    " needs the context-parallel group: call it after fabric.launch() and fabric.setup(model)."
                )
            return batch
        if self._model is None:
            raise RuntimeError(
                f"ShardFabricStrategy(context_parallel_size={cp.size}).cut_batch cuts batches for the model's"
                " attention over the group, which fabric.setup installs: set the model up first."
            )
        self.end_cut()  # a batch that cannot be cut leaves no earlier sequence behind
        cut, self._cut_weight = cut_for_rank(cp, batch, owner="ShardFabricStrategy")
        self._cut_by_loop = True
        return cut

    def end_cut(self) -> None:
        """The model runs whole sequences again, as on one process (evaluation after training, say), and
        ``fabric.backward`` stops weighting the loss, until the next :meth:`cut_batch`."""
        if self.context_parallel is not None:
            self.context_parallel.end()
        self._cut_weight, self._cut_by_loop = 1.0, False

    @property
    def loss_weight(self) -> float:
        """What ``fabric.backward`` multiplies the loss by: ``c x n_r / N`` for the last cut batch (1 for a
        tuple batch, whose chunks hold equal numbers of targets; 1 outside a cut batch). The rank's loss
        times it, averaged over the group (``fabric.all_reduce``), is the group's mean loss."""
        return self._cut_weight

    def _weigh_loss(self, loss: Tensor) -> Tensor:
        return loss if self._cut_weight == 1.0 else loss * self._cut_weight
