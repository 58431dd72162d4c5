"""One run as both doors hold it: the engine, the stage runner, context parallelism, and every step over them.

:func:`~lightning_shard.core.transform.prepare` returns a :class:`Session`; the Trainer door (``ShardStrategy``)
and the Fabric door (``ShardFabricStrategy``) keep it and forward their framework's hooks to it. The steps are
written here once: the batch cut over the context-parallel group and its loss weight, the call routed through
the engine's wrapper, backward (the engine's own, or the precision's between the engine's hooks), the optimizer
step with the non-finite skip, clipping by one norm over every mesh, the pipeline schedule's steps, and the
checkpoints (the stage mark written, the refusal of what stages cannot resume). Each door keeps only what its
framework alone has: Lightning's hooks, logging and loop order; Fabric's explicit calls.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.layout import is_deepspeed_checkpoint
from lightning_shard.checkpoint.storage import Location
from lightning_shard.compile import recompiles
from lightning_shard.config import ShardConfig
from lightning_shard.context_parallel import ContextParallel
from lightning_shard.context_parallel.batch import cut_for_rank, cut_pair, gather_outputs
from lightning_shard.core.nonfinite import NonFiniteGuard
from lightning_shard.engines import Engine, ReplicaSync, TrainSettings
from lightning_shard.fault_tolerance.replicas import ReplicaGroups
from lightning_shard.parallel import clip_grad_norm_
from lightning_shard.pipeline import StageRunner
from lightning_shard.precision import PrecisionPolicy

#: In the checkpoints of a run with pipeline stages: how many.
PIPELINE_KEY = "lightning_shard_pipeline_parallel_size"


@dataclass
class Session:
    """What :func:`~lightning_shard.core.transform.prepare` hands back to the door, and the steps over it."""

    model: nn.Module
    """What runs: the engine's wrapper (DDP, DeepSpeed) or the module itself, sharded in place."""
    engine: Engine
    config: ShardConfig
    """The flags as resolved on the module (the block classes detected for a pipeline cut)."""
    pipeline: StageRunner | None
    """This rank's pipeline stages and their schedule (``None`` without pipeline stages)."""
    precision: PrecisionPolicy
    context_parallel: ContextParallel | None
    """This rank's context-parallel group (``None``: ``context_parallel_size=1``)."""
    device: torch.device
    pipeline_stages: int = 1
    """The pipeline mesh size: clipping sums the squared norms of every stage."""
    guard: NonFiniteGuard | None = None
    """``skip_nonfinite=True``: the steps skipped together on every rank."""
    _held: list[tuple[Tensor, Tensor | None]] | None = field(default=None, repr=False)
    loss_weight: float = 1.0
    """What a loop's backward multiplies the loss by after :meth:`cut_batch`: this rank's share of the cut
    batch's targets (1 outside a cut batch)."""
    cut_by_loop: bool = False
    """Whether the loop cut the batch itself (:meth:`cut_batch`): pipeline steps, which cut it, then refuse."""
    replicas: ReplicaGroups | None = None
    """``fault_tolerance``: this process's replica group, once joined (``core.replica_groups``)."""

    def __post_init__(self) -> None:
        if self.guard is None and self.config.skip_nonfinite:
            self.guard = NonFiniteGuard(self.config.max_skipped)

    def carry_over(self, earlier: Session | None) -> None:
        """What outlives one Trainer call, from the session of the call before: the count of skipped steps and
        the replica group."""
        if earlier is None:
            return
        self.replicas = earlier.replicas
        if earlier.guard is not None:
            self.guard = earlier.guard

    # --- the optimizers ------------------------------------------------------------------------------

    def setup_optimizers(
        self, optimizers: list[Optimizer], schedulers: list[Any], settings: TrainSettings
    ) -> list[Optimizer]:
        """The engine takes the optimizers (DeepSpeed wraps the model with them): what runs may change."""
        self.model, optimizers = self.engine.setup_optimizers(self.model, optimizers, schedulers, settings)
        return optimizers

    # --- forward -------------------------------------------------------------------------------------

    def cut(self, args: tuple[Any, ...], owner: str = "ShardStrategy") -> tuple[tuple[Any, ...], float]:
        """Context parallelism: the batch (the first argument) cut to this rank's chunks of each sequence, and
        the weight of this rank's mean loss (:mod:`lightning_shard.context_parallel.batch`). The group's
        sequence stays set until the next cut: a recompute during backward needs it."""
        cp = self.context_parallel
        if cp is None or not args:
            return args, 1.0
        batch, weight = cut_for_rank(cp, args[0], owner=owner)
        return (batch, *args[1:]), weight

    def cut_batch(self, batch: Any, owner: str) -> Any:
        """A loop's own cut (Fabric's ``cut_batch``): :meth:`cut` of one batch, its weight kept for
        :meth:`weigh` until :meth:`end_cut`; a batch that cannot be cut leaves no earlier sequence behind."""
        self.end_cut()
        (cut,), self.loss_weight = self.cut((batch,), owner=owner)
        self.cut_by_loop = True
        return cut

    def weigh(self, loss: Tensor) -> Tensor:
        """``loss`` times :attr:`loss_weight` (the rank's share of the loop's cut batch's targets)."""
        return loss if self.loss_weight == 1.0 else loss * self.loss_weight

    def call(self, module: nn.Module, method: str, *args: Any, **kwargs: Any) -> Any:
        """``module.<method>(...)``, routed through the wrapper's forward where the engine acts there
        (parameters gathered, gradients reduced); a framework calls ``training_step``, not ``forward``."""
        if self.engine.routes_through_forward(self.model, module):
            return self.engine.forward_redirection(self.model, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    def gather(self, output: Any) -> Any:
        """A prediction cut over the context-parallel group, gathered back to whole sequences."""
        cp = self.context_parallel
        if cp is None or cp.seq_len is None:
            return output
        return gather_outputs(output, cp.seq_len, cp.group, cp.size)

    def gated(
        self, optimizer_step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any] | None = None
    ) -> Any:
        """``optimizer_step(closure)``; under fault tolerance only if the step commits on every participating
        replica group (else ``None``, the gradients dropped). With ``closure`` (the Trainer's forward and
        backward), the closure runs inside the step's quorum first; without, the loop ran its backward already
        and the commit is decided now. One gate for both doors."""
        run = closure if closure is not None else (lambda: None)
        if self.replicas is None:
            return optimizer_step(run)
        if closure is not None:
            return self.replicas.step(closure, optimizer_step)
        return optimizer_step(run) if self.replicas.commits() else None

    def writes_checkpoints(self) -> bool:
        """Whether this process writes the run's checkpoints: always, and under fault tolerance in the lowest
        live replica group only."""
        return self.replicas is None or self.replicas.writes_checkpoints()

    def replica_sync(self) -> ReplicaSync:
        """What fault tolerance needs of the engine for this model (its in-group reduction, its own state)."""
        return self.engine.replica_sync(self.model)

    def end_cut(self) -> None:
        """The model runs whole sequences again, as on one process, and a loop's loss is no longer weighted."""
        if self.context_parallel is not None:
            self.context_parallel.end()
        self.loss_weight, self.cut_by_loop = 1.0, False

    # --- backward and the optimizer step ---------------------------------------------------------------

    def pre_backward(self, loss: Tensor, manual: bool) -> None:
        self.engine.pre_backward(self.model, loss, manual=manual)

    def post_backward(self, manual: bool) -> None:
        self.engine.post_backward(self.model, manual=manual)

    def backward(self, loss: Tensor, manual: bool, plain: Callable[[Tensor], Any]) -> None:
        """The engine's own backward where it owns the step; else ``plain(loss)`` (the precision's backward)
        between the engine's hooks. ``loss`` already carries the precision's scale."""
        if self.engine.owns_step:
            self.engine.backward(self.model, loss, manual=manual)
            return
        self.pre_backward(loss, manual)
        plain(loss)
        self.post_backward(manual)

    def engine_step(self, optimizer: Optimizer) -> None:
        """The step of an engine that owns it (DeepSpeed): clipping, the loss scale and the step inside."""
        self.engine.step(self.model, optimizer)

    def skips(self, loss: Tensor | None, optimizer: Optimizer) -> bool:
        """``skip_nonfinite``: whether every rank skips this step (a non-finite loss or gradient on any rank);
        the gradients are then dropped. With a loss scaler, inf gradients are the scaler's business."""
        if self.guard is None:
            return False
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.guard.should_skip(loss, params, self.device, check_grads=self.precision.scaler is None):
            return False
        optimizer.zero_grad(set_to_none=True)
        return True

    @property
    def skipped_steps(self) -> int:
        return 0 if self.guard is None else self.guard.total

    def after_manual_step(self) -> None:
        self.engine.after_manual_step(self.model)

    def clip_norm(self, parameters: Iterable[Tensor], max_norm: float) -> Tensor:
        """Clip by the 2-norm of the whole model's gradient: one all-reduce of squared norms over every mesh."""
        return clip_grad_norm_(list(parameters), max_norm, pipeline_stages=self.pipeline_stages)

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        with self.engine.no_sync(self.model):
            yield

    @property
    def recompiles(self) -> int:
        """``compile=...``: blocks dynamo compiled again after their first graph, since set-up, on this rank."""
        baseline = self.engine.compile_baseline
        return 0 if baseline is None else recompiles() - baseline

    # --- pipeline stages -------------------------------------------------------------------------------

    def pipeline_train_step(
        self, inputs: tuple[Any, ...], target: Any, scale: float, hold: bool = False
    ) -> Tensor:
        """Forward and backward of one batch through this rank's stages; this rank's loss, weighted by its share
        of the targets under context parallelism (the group's mean of it is the whole sequences' loss).

        ``scale`` multiplies the gradients (``1 / accumulate``); ``16-mixed``'s loss scale is applied here, as
        a backward would apply it. ``hold``: the gradients the schedule makes wait aside until
        :meth:`add_held_gradients` (a loop that zeroes gradients between the step and its backward).
        """
        assert self.pipeline is not None
        scaler = self.precision.scaler
        if scaler is not None:  # scale() of a one: the scaler's current scale (its first call creates it)
            scale *= float(scaler.scale(torch.ones((), device=self.device)))
        inputs, target, weight = cut_pair(self.context_parallel, inputs, target)
        with self.precision.forward_context():
            # The schedule's loss is the mean over microbatches of this rank's own mean loss (it divides the
            # scale back out); weighted, as a step without stages returns it.
            if not hold:
                return self.pipeline.train_step(inputs, target, float(scale * weight)) * weight
            params = [p for p in self.model.parameters() if p.requires_grad]
            kept = [p.grad for p in params]
            for p in params:
                p.grad = None
            try:
                loss = self.pipeline.train_step(inputs, target, float(scale * weight))
                self._held = [(p, p.grad) for p in params]
            finally:
                for p, grad in zip(params, kept, strict=True):
                    p.grad = grad
            return loss * weight

    def add_held_gradients(self) -> None:
        held, self._held = self._held or [], None
        for p, grad in held:
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)

    def pipeline_eval_step(self, inputs: tuple[Any, ...], target: Any) -> Tensor:
        """Forward only through this rank's stages; this rank's loss, weighted as in training."""
        assert self.pipeline is not None
        inputs, target, weight = cut_pair(self.context_parallel, inputs, target)
        with torch.no_grad(), self.precision.forward_context():
            return self.pipeline.eval_step(inputs, target) * weight

    def pipeline_predict_step(self, inputs: tuple[Any, ...]) -> Any:
        """The last stage's output for whole sequences (cut over the context-parallel group and gathered)."""
        assert self.pipeline is not None
        inputs = cut_pair(self.context_parallel, inputs, None)[0]
        with torch.no_grad(), self.precision.forward_context():
            output = self.pipeline.predict_step(inputs)
        if self.context_parallel is None or self.context_parallel.seq_len is None:
            return output
        # The last stage's output arrives on the CPU; the group's collectives run on the rank's device.
        return move_data_to_device(self.gather(move_data_to_device(output, self.device)), "cpu")

    # --- state and checkpoints -------------------------------------------------------------------------

    @property
    def full(self) -> bool:
        return self.config.checkpoint == "full"

    def model_state(self) -> dict[str, Any]:
        return self.engine.model_state_dict(self.model, full=self.full)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.engine.optimizer_state_dict(self.model, optimizer, full=self.full)

    def save(
        self,
        optimizers: list[Optimizer],
        checkpoint: dict[str, Any],
        location: Location,
        exception: bool = False,
    ) -> None:
        """Write a checkpoint through the engine. With pipeline stages every stage writes its own parameters and
        optimizer state, keyed by name; the mark says how many stages wrote it."""
        if self.pipeline is not None:
            checkpoint[PIPELINE_KEY] = self.config.pipeline_parallel_size
        self.engine.save_checkpoint(self.model, optimizers, checkpoint, location, exception=exception)

    def load(
        self, optimizers: list[Optimizer], location: Any, weights_only: bool | None, owner: str, call: str
    ) -> dict[str, Any]:
        """Read a checkpoint into the model and optimizers; what else it holds comes back."""
        self._refuse_unsharded(location, owner, call)
        return self.engine.load_checkpoint(self.model, optimizers, location, weights_only)

    def _refuse_unsharded(self, path: Any, owner: str, call: str) -> None:
        """With pipeline stages only sharded checkpoints resume (each stage reads its own parameters by name)."""
        if self.pipeline is None or not (path.is_file() or is_deepspeed_checkpoint(path)):
            return
        kind = "a one-file checkpoint" if path.is_file() else "a DeepSpeed checkpoint"
        raise ValueError(
            f"{owner}(pipeline_parallel_size={self.config.pipeline_parallel_size}) resumes sharded checkpoints"
            f" only, and {call}={str(path)!r} is {kind}. Resume it once without pipeline stages and save it"
            f" sharded ({owner}(checkpoint='sharded')), or start from its weights"
            " (lightning_shard.checkpoint.load_model_weights)."
        )
