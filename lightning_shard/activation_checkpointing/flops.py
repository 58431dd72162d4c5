"""Counting the forward FLOPs that checkpointed blocks re-run inside backward.

:func:`count_recompute_flops` pushes a tally; a block checkpointed while a tally is open counts, in
its recompute context, the ops that really re-run (``torch.utils.flop_counter`` formulas). Both the
wrapper (:mod:`.wrap`, which enters the counting) and :func:`~.measure.measure` (which opens the
tally) use this module; neither imports the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


class _FlopTally(TorchDispatchMode):
    """Adds up the FLOPs (``torch.utils.flop_counter`` formulas) of the ops that run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


class RecomputeFlops:
    """What :func:`count_recompute_flops` yields: ``.flops`` re-run by checkpointed blocks in backward."""

    def __init__(self) -> None:
        self.flops = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count one recompute; a fresh dispatch mode each time (modes are not reentrant)."""
        tally = _FlopTally()
        try:
            with tally:
                yield
        finally:
            self.flops += tally.flops


# measure() pushes a tally here; blocks checkpointed while it is set count what they recompute.
_RECOMPUTE_TALLIES: list[RecomputeFlops] = []


@contextlib.contextmanager
def count_recompute_flops() -> Iterator[RecomputeFlops]:
    """Count FLOPs that checkpointed blocks re-run in backward, for forwards run inside this context."""
    tally = RecomputeFlops()
    _RECOMPUTE_TALLIES.append(tally)
    try:
        yield tally
    finally:
        _RECOMPUTE_TALLIES.remove(tally)


def current_tally() -> RecomputeFlops | None:
    """The innermost open :func:`count_recompute_flops` tally, if any."""
    return _RECOMPUTE_TALLIES[-1] if _RECOMPUTE_TALLIES else None
