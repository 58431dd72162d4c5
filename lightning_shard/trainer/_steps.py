"""What ShardStrategy's step hooks add to the session's steps: Lightning's hooks, logging and warnings alone, and
the order of each step over it: the evaluation and prediction hooks (the batch cut, the routed call, or the
pipeline schedule), the backward and optimizer steps (the precision plugin's hooks, the engine's own step, or
Lightning's after the non-finite check)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_shard.core import Session
from lightning_shard.trainer._pipeline import pipeline_eval_step, predict_inputs

log = logging.getLogger(__name__)


def backward_hooks_around(trainer: Any, loss: Tensor, backward: Callable[[], None]) -> None:
    """Lightning's ``on_before_backward`` / ``on_after_backward`` hooks around a backward the strategy runs
    outside Lightning's precision plugin (the pipeline schedule's, whose gradients are added here)."""
    call._call_callback_hooks(trainer, "on_before_backward", loss)
    call._call_lightning_module_hook(trainer, "on_before_backward", loss)
    backward()
    call._call_callback_hooks(trainer, "on_after_backward")
    call._call_lightning_module_hook(trainer, "on_after_backward")


#: The loss each evaluation hook logs under pipeline stages (the schedule computes it in place of the hook).
_EVAL_LOSS = {"validation_step": "val_loss", "test_step": "test_loss"}


def evaluate(
    session: Session, module: Any, plugin: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``validation_step`` / ``test_step`` (``method``) over the session: this rank's cut of the batch, the hook
    through the engine's wrapper in the precision ``plugin``'s context; under pipeline stages, the schedule."""
    if session.pipeline is not None:
        return pipeline_eval_step(session, module, args[0], _EVAL_LOSS[method])
    args, _ = session.cut(args)
    with (plugin.val_step_context if method == "validation_step" else plugin.test_step_context)():
        return session.call(module, method, *args, **kwargs)


def predict(session: Session, module: Any, plugin: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``predict_step`` over the session; ``trainer.predict`` returns what one process would: each output's
    chunks gathered over the context-parallel group."""
    if session.pipeline is not None:
        return session.pipeline_predict_step(predict_inputs(module, args[0]))
    args, _ = session.cut(args)
    with plugin.predict_step_context():
        output = session.call(module, "predict_step", *args, **kwargs)
    return session.gather(output)


def backward(
    session: Session, module: Any, plugin: Any, loss: Tensor, plain: Callable[[Tensor], None]
) -> Tensor:
    """Lightning's backward over the session: the precision ``plugin``'s hooks around the session's backward
    (the engine's own, or ``plain``: Lightning's through the plugin). Under pipeline stages the schedule ran
    every microbatch's backward in ``training_step``: its held gradients are added inside Lightning's hooks."""
    if session.pipeline is not None:
        backward_hooks_around(module.trainer, loss, session.add_held_gradients)
        return loss
    loss = plugin.pre_backward(loss, module)
    session.backward(loss, manual=not module.automatic_optimization, plain=plain)
    return plugin.post_backward(loss, module)


def optimizer_step(
    session: Session,
    module: Any,
    plugin: Any,
    optimizer: Any,
    closure: Callable[[], Any],
    lightning_step: Callable[[Callable[[], Any]], Any],
    owns_step: bool,
) -> Any:
    """One optimizer step: an engine that owns the step takes it after the closure (forward, backward);
    otherwise Lightning's (``lightning_step(closure)``, through the precision ``plugin``), unless the non-finite
    check (``skip_nonfinite``) skips it on every rank. After a manual step the engine gathers again."""
    if owns_step:
        result = closure()
        plugin._after_closure(module, optimizer)
        session.engine_step(optimizer)
        return result
    if session.guard is not None:
        result = closure()
        if session.skips(result, optimizer):
            report_skip(module.trainer, session.skipped_steps, module.trainer.is_global_zero)
            return None
        closure = lambda: result  # noqa: E731  (the closure ran once already)
    result = lightning_step(closure)
    if not module.automatic_optimization:
        session.after_manual_step()
    return result


def report_skip(trainer: Any, total: int, is_global_zero: bool) -> None:
    """``skip_nonfinite``: warn about a skipped step and log the running count as ``shard/skipped_steps``."""
    log.warning(
        "ShardStrategy: non-finite loss or gradient at step %d; skipped the optimizer step on all ranks"
        " (%d skipped so far).",
        trainer.global_step,
        total,
    )
    if is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics({"shard/skipped_steps": float(total)}, step=trainer.global_step)


def warn_recompiles(count: int) -> None:
    if count:
        rank_zero_warn(
            f"ShardStrategy(compile=...): torch.compile recompiled the blocks {count} time(s) after"
            " their first graph. Something they depend on changes between steps (a shape: pad batches to"
            " one length or pass compile={'dynamic': True}; a Python value read in forward). Run with"
            " TORCH_LOGS=recompiles to see the guard."
        )
