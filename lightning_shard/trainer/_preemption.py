"""SIGTERM (preemption) acted on by every rank at the same training step.

SLURM, Kubernetes and torchrun send SIGTERM before they kill a job. Lightning's own SIGTERM handler
runs a collective inside the signal handler, which interleaves with whatever collective the rank
was about to run (FSDP's all-gathers, the next step's broadcast) and can hang the job; and its loops
read each rank's own flag, so ranks signalled at different moments stop at different steps.

Here the handler only records the signal (and forwards it to the ranks Lightning's launcher
started). Once per training step, before the step, the ranks all-reduce their flags; if any rank
was signalled, every rank sets Lightning's ``received_sigterm`` at that same point, so every rank
finishes the same step and raises Lightning's ``SIGTERMException`` there: ``on_exception`` hooks
(``OnExceptionCheckpoint``) run, the strategy commits checkpoints, and teardown releases the
process groups.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from lightning_shard.trainer import _compat as trainer_compat

log = logging.getLogger(__name__)


class Preemption:
    """One Trainer call's SIGTERM state: ``install`` at train start, ``agree`` before each step."""

    def __init__(self) -> None:
        self.signalled = False
        self.agreed = False
        self._trainer: Any = None

    def install(self, trainer: Any) -> None:
        self.signalled = self.agreed = False
        self._trainer = trainer
        if not trainer_compat.replace_sigterm_notifier(trainer, self._on_sigterm):
            log.warning(
                "ShardStrategy: this Lightning release composes its SIGTERM handler differently; SIGTERM is"
                " left to Lightning's own handling."
            )

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # A signal handler: no collectives, no locks. Forward once to the ranks this process started.
        if not self.signalled:
            launcher = getattr(self._trainer.strategy, "launcher", None)
            if launcher is not None and getattr(launcher, "procs", None):
                launcher.kill(signum)
        self.signalled = True

    def agree(self, device: torch.device) -> None:
        """Every rank learns whether any rank was signalled, at the same point of the same step."""
        if self.agreed or self._trainer is None:
            return
        signalled = self.signalled
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1 if self.signalled else 0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signalled = bool(flag.item())
        if signalled:
            self.agreed = True
            log.warning(
                "ShardStrategy: SIGTERM received; every rank stops after step %d and on_exception hooks run.",
                self._trainer.global_step,
            )
            trainer_compat.mark_sigterm_received(self._trainer)
