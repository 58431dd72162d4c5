"""Context parallelism in a Fabric loop: one explicit call cuts each batch, ``fabric.backward`` weights the loss.

The Trainer cuts the batch in its step hooks (:mod:`lightning_shard.trainer._steps`); a Fabric loop has none,
so it hands each batch to ``fabric.strategy.cut_batch(batch)`` before the forward. That returns this rank's
chunks of every sequence tensor (:func:`~lightning_shard.context_parallel.split_batch`: labels shifted on
the whole sequence first and passed on as ``shift_labels``) and sets the group's sequence, so the model's
attention runs over the group and its positions are the chunks' global ones.

``fabric.backward(loss)`` multiplies the loss, which must be the mean over this rank's targets, by
``c x n_r / N`` (``n_r`` targets on this rank, ``N`` in the group): the gradient reduction averages over the
group's ``c`` ranks, so the gradients are those of the mean over every target of the group, one process's.

The sequence stays set until the next ``cut_batch`` or :meth:`~lightning_shard.fabric.ShardFabricStrategy.end_cut` (a recompute
during backward needs it); after ``end_cut`` the model runs whole sequences as on one process.

With pipeline stages the loop hands whole batches to ``fabric.strategy.pipeline_step``, which cuts them
itself (:func:`~lightning_shard.context_parallel.batch.cut_pair`), as the Trainer's pipeline steps do.
"""

from __future__ import annotations

from lightning_shard.config import ShardConfig
from lightning_shard.context_parallel import ContextParallel


def cuts(config: ShardConfig, cp: ContextParallel | None, model_set_up: bool) -> bool:
    """Whether ``cut_batch`` cuts: with a context-parallel group and the model set up; a clear error where the
    flag asks for a group that is not there yet."""
    if cp is None:
        if config.context_parallel_size > 1:
            raise RuntimeError(
                f"ShardFabricStrategy(context_parallel_size={config.context_parallel_size}).cut_batch"
                " needs the context-parallel group: call it after fabric.launch() and fabric.setup(model)."
            )
        return False
    if not model_set_up:
        raise RuntimeError(
            f"ShardFabricStrategy(context_parallel_size={cp.size}).cut_batch cuts batches for the model's"
            " attention over the group, which fabric.setup installs: set the model up first."
        )
    return True
