"""Why a checkpoint cannot be resumed, said on every rank at once.

Resuming fails in a handful of ways that each used to surface as a bare library error naming no
checkpoint (``UnpicklingError`` from a cut-short ``.metadata``, DCP's "Missing key", a silent
partial load when the checkpoint holds *more* layers than the model). Here each is checked before
any state is read, with the checkpoint's path and the fix in the message.

A resume runs on every rank, and a rank that raised alone would leave the others blocked in their
next collective until the process-group timeout (30 minutes by default). :func:`on_every_rank`
therefore has every rank report its outcome in one ``all_gather_object`` and raise together.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_shard._compat import flatten_state_dict
from lightning_shard.checkpoint.storage import Location

T = TypeVar("T")
_SHOWN = 3  # mismatching keys named in a message; the rest are counted

Shapes = Mapping[str, tuple[int, ...] | None]


class CheckpointLoadError(ValueError):
    """A checkpoint cannot be resumed: damaged, incomplete, of another engine, or of another model."""


def on_every_rank(
    path: Location, fn: Callable[[], T], error_class: type[Exception] = CheckpointLoadError
) -> T:
    """``fn()``, run on every rank; if it raises on any rank, every rank raises.

    A failing rank raises its own ``error_class`` (default :class:`CheckpointLoadError`) or
    ``FileNotFoundError``, and wraps any other exception in one that names ``path``; the others raise an
    ``error_class`` with the first failing rank's message. ``fn`` must not enter a collective that could leave a
    failed rank behind (DCP's own collectives are fine: DCP re-raises a rank's failure on all ranks).
    """
    error: BaseException | None = None
    result: T | None = None
    try:
        result = fn()
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        error = err
    message = None if error is None else describe(path, error, error_class)
    messages = [message]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
    if isinstance(error, (error_class, FileNotFoundError)):
        raise error
    if error is not None:
        raise error_class(message) from error
    failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if failed:
        rank, text = failed[0]
        raise error_class(f"{text} (rank {rank} failed; every rank stops)")
    return result  # type: ignore[return-value]


def describe(path: Location, error: BaseException, known: type[Exception] = CheckpointLoadError) -> str:
    if isinstance(error, (known, FileNotFoundError)):
        return str(error)
    return (
        f"Loading checkpoint {str(path)!r} failed: {summary(error)}. Check that every rank can read the checkpoint,"
        " or resume from another checkpoint."
    )


def summary(error: BaseException) -> str:
    """One line for an exception; DCP's ``CheckpointException`` is cut down to its first rank's cause."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = next(iter(sorted(error.failures.items(), key=lambda item: item[0])))
        return f"{_first_sentence(cause)} (on rank {rank})"
    return _first_sentence(error)


def _first_sentence(error: BaseException) -> str:
    # torch's zip reader appends a paragraph of advice to its one-line cause; the message here gives its own.
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if len(text) > 120 and ". " in text:
        text = text[: text.index(". ") + 1]
    return f"{type(error).__name__}: {text}"


def unreadable(path: Location, file: str, error: BaseException) -> CheckpointLoadError:
    text = str(error)
    refused = "Weights only load failed" in text or "weights_only loading refuses" in text
    if isinstance(error, pickle.UnpicklingError) and refused:
        # weights_only loading refused a global: a pickle that would run code, or a class nobody allowed
        # (torch's words, then those of the restricted readers in _pickles).
        named = re.search(r"(?:GLOBAL|global) ([\w.]+)", text) or re.search(r"names ([\w.]+)", text)
        what = f"it names {named.group(1)}" if named else summary(error)
        return CheckpointLoadError(
            f"Checkpoint {str(path)!r}: {file} was refused by weights_only loading ({what}). Loading"
            " never runs code from a checkpoint unless you opt in. If you trust this checkpoint's source, pass"
            " weights_only=False (trainer.fit(model, ckpt_path=..., weights_only=False)), or allow the class"
            " with torch.serialization.add_safe_globals([...])."
        )
    return CheckpointLoadError(
        f"Checkpoint {str(path)!r} is damaged: {file} cannot be read ({summary(error)}). The file was cut short"
        " or overwritten after the save (a copy, sync or disk that did not finish). Copy the checkpoint again in"
        " full, or resume from another checkpoint."
    )


def check_files(path: Location, metadata: Metadata) -> None:
    """Every shard file ``.metadata`` refers to exists and is at least as long as the bytes it names there."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size < size:
            problems.append(f"{name} has {file.stat().st_size} bytes, .metadata expects at least {size}")
    if problems:
        raise CheckpointLoadError(
            f"Checkpoint {str(path)!r} is incomplete: {_listed(problems)}. Shards were lost or cut short after"
            " the save (a copy or sync that did not finish). Copy the whole checkpoint directory again, or"
            " resume from another checkpoint."
        )


def saved_shapes(metadata: Metadata) -> dict[str, tuple[int, ...] | None]:
    return {
        key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


def target_shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Keys and global shapes of a state dict, flattened the way DCP's planner flattens it."""
    flat, _ = flatten_state_dict(dict(state))
    return {key: tuple(value.size()) if torch.is_tensor(value) else None for key, value in flat.items()}


def check_state(
    path: Location, saved: Shapes, wanted: Shapes, prefix: str, what: str, strict: bool, fix: str
) -> None:
    """Raise unless the checkpoint holds every key of ``wanted`` under ``prefix`` with the same shape.

    ``strict`` also refuses keys the checkpoint has and the model lacks: DCP reads only the keys asked
    for, so a checkpoint of a deeper model would otherwise load into a shallower one without a word.
    """
    saved = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
    wanted = {k[len(prefix) :]: v for k, v in wanted.items() if k.startswith(prefix)}
    differ = [
        f"{k} is {_shape(saved[k])} in the checkpoint but {_shape(wanted[k])} here"
        for k in wanted
        if k in saved and saved[k] is not None and wanted[k] is not None and saved[k] != wanted[k]
    ]
    missing = [k for k in wanted if k not in saved]
    extra = [k for k in saved if k not in wanted] if strict else []
    if not (differ or missing or extra):
        return
    parts = [_listed(differ)] if differ else []
    if missing:
        parts.append(f"missing from the checkpoint: {_listed(missing)}")
    if extra:
        parts.append(f"in the checkpoint but not in the model: {_listed(extra)}")
    raise CheckpointLoadError(
        f"Checkpoint {str(path)!r} does not fit the {what} being resumed: {'; '.join(parts)}.{fix}"
    )


def model_fix(saved_hparams: Mapping[str, Any] | None, model: Any) -> str:
    return (
        f"{hparams_hint(saved_hparams, model)} Resume with the model configuration the checkpoint was saved with;"
        " to start a changed model from its weights, load what fits (lightning_shard.checkpoint.load_model_weights)"
        " into it and fit without ckpt_path."
    )


OPTIMIZER_FIX = (
    " Resume with the optimizer configure_optimizers() returned when it was saved; to change optimizers, load"
    " its weights only (lightning_shard.checkpoint.load_model_weights) and fit without ckpt_path."
)


def hparams_hint(saved: Mapping[str, Any] | None, model: Any) -> str:
    """`` It was saved with d_model=32; this model has d_model=48.``, or ``""`` when that says nothing."""
    module = getattr(model, "module", model)
    current = getattr(module, "hparams", None)
    if not saved or not current:
        return ""
    differ = [k for k in saved if k in current and _differs(saved[k], current[k])]
    if not differ:
        return ""
    then = ", ".join(f"{k}={saved[k]!r}" for k in differ[:_SHOWN])
    now = ", ".join(f"{k}={current[k]!r}" for k in differ[:_SHOWN])
    return f" It was saved with {then}; this model has {now}."


def wrong_engine(path: Location, kind: str, engine: str, fix: str) -> CheckpointLoadError:
    return CheckpointLoadError(
        f"Checkpoint {str(path)!r} is {kind}, which ShardStrategy(engine={engine!r}) cannot resume. {fix}"
    )


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except Exception:  # noqa: BLE001  (values without a plain ==, e.g. tensors: not worth naming)
        return False


def _shape(shape: tuple[int, ...] | None) -> str:
    return "a non-tensor value" if shape is None else str(tuple(shape))


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown if len(items) <= _SHOWN else f"{shown} and {len(items) - _SHOWN} more"
