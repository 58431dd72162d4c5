"""How ShardStrategy runs a step: Lightning's hooks routed to the engine.

Backward (the engine's own where it owns the step), the training / evaluation steps routed through the
wrapper's forward (where its hooks gather parameters and reduce gradients), the optimizer step with
non-finite skipping and manual optimization, and accumulation without gradient sync. Kept apart from
the strategy's set-up and flags (:mod:`lightning_shard.trainer.strategy`) and its checkpoints
(:mod:`lightning_shard.trainer._checkpoint`).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_shard.compile import recompiles
from lightning_shard.context_parallel import scale_loss
from lightning_shard.context_parallel.batch import cut_for_rank, gather_outputs
from lightning_shard.core.processes import guarded
from lightning_shard.engines import Engine
from lightning_shard.trainer._preemption import Preemption
from lightning_shard.trainer._processes import ProcessGroupStrategy
from lightning_shard.trainer.nonfinite import NonFiniteGuard


class EngineSteps(ProcessGroupStrategy):
    """Lightning's step hooks, delegated to one :class:`~lightning_shard.engines.Engine`."""

    _engine: Engine | None
    _engine_class: type[Engine]
    _guard: NonFiniteGuard | None
    _preemption: Preemption

    @property
    def _lm(self) -> L.LightningModule:
        assert self.lightning_module is not None
        return self.lightning_module

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError(
                "ShardStrategy.engine is only available once the Trainer has set the model up."
            )
        return self._engine

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # An engine that owns the step counts micro-batches itself and steps at the boundary.
        return self._engine_class.owns_step

    @override
    @guarded
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if not self.engine.owns_step:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self._lm)
        assert self.model is not None
        self.engine.backward(self.model, closure_loss, manual=not self._lm.automatic_optimization)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self._lm)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._engine is not None and self.model is not None:
            self._engine.pre_backward(self.model, closure_loss, manual=not self._lm.automatic_optimization)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self._engine is not None and self.model is not None:
            self._engine.post_backward(self.model, manual=not self._lm.automatic_optimization)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # Wrappers act in the model's forward, but Lightning calls training_step (and the others):
        # the engine says when a step must be routed through forward (parameters gathered, gradients
        # reduced).
        module, model = self._lm, self.model
        assert model is not None
        if self.engine.routes_through_forward(model, module):
            return self.engine.forward_redirection(model, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    def _cut_batch(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], float]:
        """Context parallelism: the batch (the step's first argument) cut to this rank's chunks of each
        sequence, and the weight of this rank's mean loss (:mod:`lightning_shard.context_parallel.batch`).
        The group's sequence stays set until the next step: a recompute during backward needs it."""
        cp = self.context_parallel
        if cp is None or not args:
            return args, 1.0
        batch, weight = cut_for_rank(cp, args[0])
        return (batch, *args[1:]), weight

    @override
    @guarded
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._preemption.agree(self.root_device)
        args, weight = self._cut_batch(args)
        with self.precision_plugin.train_step_context():
            return scale_loss(self._redirect("training_step", *args, **kwargs), weight)

    @override
    @guarded
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        args, _ = self._cut_batch(args)
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    @override
    @guarded
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        args, _ = self._cut_batch(args)
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    @override
    @guarded
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        args, _ = self._cut_batch(args)
        with self.precision_plugin.predict_step_context():
            output = self._redirect("predict_step", *args, **kwargs)
        cp = self.context_parallel
        if cp is None or cp.seq_len is None:
            return output
        # trainer.predict returns what one process would: each output's chunks gathered over the group.
        return gather_outputs(output, cp.seq_len, cp.group, cp.size)

    @override
    @guarded
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.engine.owns_step:
            result = closure()
            self.precision_plugin._after_closure(self._lm, optimizer)
            assert self.model is not None
            self.engine.step(self.model, optimizer)
            return result
        result = self._guarded_step(optimizer, closure, model, **kwargs)
        if not self._lm.automatic_optimization:
            assert self.model is not None
            self.engine.after_manual_step(self.model)
        return result

    def _guarded_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._guard is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        result = closure()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # With a loss scaler, inf gradients are the scaler's business (it backs off and skips).
        check_grads = getattr(self.precision_plugin, "scaler", None) is None
        if self._guard.should_skip(result, params, self.root_device, check_grads):
            optimizer.zero_grad(set_to_none=True)
            self._guard.report(self._lm.trainer, self.is_global_zero)
            return None
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    @property
    def recompiles(self) -> int:
        """``compile=...``: blocks dynamo compiled again after their first graph, since set-up, on this rank."""
        baseline = None if self._engine is None else self._engine.compile_baseline
        return 0 if baseline is None else recompiles() - baseline

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.recompiles:
            rank_zero_warn(
                f"ShardStrategy(compile=...): torch.compile recompiled the blocks {self.recompiles} time(s) after"
                " their first graph. Something they depend on changes between steps (a shape: pad batches to"
                " one length or pass compile={'dynamic': True}; a Python value read in forward). Run with"
                " TORCH_LOGS=recompiles to see the guard."
            )

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because of non-finite values (``skip_nonfinite=True``)."""
        return self._guard.total if self._guard is not None else 0

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self._engine is None or self.model is None:
            yield
            return
        with self._engine.no_sync(self.model):
            yield
