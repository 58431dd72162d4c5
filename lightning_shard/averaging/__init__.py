"""Weight averaging for sharded models: an EMA each rank keeps for the weights it holds.

Modules: :mod:`.ema` (the :class:`EMA` callback: schedule, swaps, checkpoint state), :mod:`._layouts`
(which tensors a rank averages, for each kind of optimizer), :mod:`._hooks` (optimizer hooks that carry
the averages in the optimizer's state).
"""

from lightning_shard.averaging.ema import EMA

__all__ = ["EMA"]
