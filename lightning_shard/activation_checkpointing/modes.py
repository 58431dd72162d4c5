"""What a checkpointed block can do in one training call, and who decides it: the types the modules share.

A block runs in one of three modes. The mode is fixed per block, or chosen on the first training
call by a :class:`ModeChooser` (the ``memory_budget`` planner in :mod:`.budget`). The wrapper asks the
chooser through this interface only, so the wrapper does not depend on the planner that measures it.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

BlockMode = Literal["none", "selective", "full"]
"""``none``: keep every activation; ``selective``: keep the saved ops' outputs; ``full``: keep the inputs."""


class ModeChooser(Protocol):
    """Decides a block's mode from its first training call (its real input shapes)."""

    def mode_for(self, wrapper: Any, args: tuple, kwargs: dict) -> BlockMode:
        """The mode for the block behind ``wrapper`` (a ``CheckpointedForward``), called with ``args``."""
        ...
