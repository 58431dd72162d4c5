"""``async_checkpoint=True`` under the DeepSpeed engine: DeepSpeed's own save, its files written in the background.

DeepSpeed's ``save_checkpoint`` runs as in a synchronous save, into ``NAME.tmp``, with a checkpoint engine of
ours in place of its ``TorchCheckpointEngine``: each ``save(state_dict, path)`` DeepSpeed makes is *staged*
(a copy the next optimizer step cannot change) and queued; once ``save_checkpoint`` returns, one thread per rank
writes the queued files with the replaced engine's own ``save`` (so the bytes are a synchronous save's), then
the ranks agree on a process group of their own that every file is on disk and rank 0 renames ``NAME.tmp`` to
``NAME`` (:mod:`lightning_shard.checkpoint._commit`, as every other checkpoint).

Staging: on the host the state is deep-copied (``Tensor.__deepcopy__`` copies each storage whole and keeps the
views that share one sharing it; tensors keep their ``requires_grad`` and attributes, so the copy pickles to the
same bytes); elsewhere, or where the state holds an
object that cannot be copied, it is serialized into host memory at once (the device-to-host copy a save needs
anyway) and only the bytes are written later: the same bytes but for the zip's inner folder, torch's ``archive/``
in place of the file's name, which ``torch.load`` reads alike.

Why not DeepSpeed's ``DecoupledCheckpointEngine``: it writes from a spawned process (it sets the ``spawn`` start
method for the whole program and moves the state's storages into shared memory, the live optimizer state
included), through the ``FastCheckpointEngine``'s aio writer, and commits at the next optimizer step, not when
the files are complete; none of which keeps this package's rename-when-complete guarantee.
"""

from __future__ import annotations

import copy
import io
import logging
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.checkpoint._commit import begin, commit, remove
from lightning_shard.checkpoint.async_save import AsyncCheckpointError, new_checkpoint_group

log = logging.getLogger(__name__)


def _stage(state: Any, on_host: bool, zipfile: bool) -> Any:
    """A copy of ``state`` the training step cannot change: the objects (on the host) or their serialized bytes."""
    if on_host:
        try:
            return _host_copy(state)
        except Exception as error:  # noqa: BLE001  (an object without a deep copy: its bytes instead)
            log.debug("Serializing a checkpoint file at once: its state has no deep copy (%r)", error)
    buffer = io.BytesIO()
    torch.save(state, buffer, _use_new_zipfile_serialization=zipfile)
    return buffer.getvalue()


def _host_copy(state: Any) -> Any:
    """``copy.deepcopy(state)``, its tensors taken out of autograd first (DeepSpeed's optimizer state holds views
    that are not graph leaves, which ``Tensor.__deepcopy__`` refuses), with their ``requires_grad`` and attributes.
    Each storage is copied whole, once, and every view of it made on the copy, so ``torch.save`` writes the same
    bytes."""
    memo: dict[Any, Any] = {}
    detached: list[torch.Tensor] = []  # alive until the copy is made: memo is keyed by id()
    _copy_tensors(state, memo, detached)
    return copy.deepcopy(state, memo)


def _copy_tensors(value: Any, memo: dict[Any, Any], detached: list[torch.Tensor]) -> None:
    if torch.is_tensor(value):
        # Parameters and other subclasses are left to deepcopy (a Parameter is a leaf).
        if id(value) not in memo and type(value) is torch.Tensor:
            detached.append(value.detach())
            copied = detached[-1].__deepcopy__(memo)  # memo["__torch__"]: the storages already copied
            copied.requires_grad_(value.requires_grad)
            if value.__dict__:  # attributes DeepSpeed set on it: pickled with the tensor
                copied.__dict__.update(copy.deepcopy(value.__dict__, memo))
            memo[id(value)] = copied
    elif isinstance(value, dict):
        for item in value.values():
            _copy_tensors(item, memo, detached)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _copy_tensors(item, memo, detached)


class _StagingEngine:
    """Stands in for DeepSpeed's checkpoint engine during one ``save_checkpoint``: saves are staged and queued."""

    def __init__(self, inner: Any, on_host: bool) -> None:
        self.inner = inner
        self.on_host = on_host
        self.queued: list[tuple[Any, str]] = []

    def save(self, state_dict: Any, path: str) -> None:
        zipfile = getattr(self.inner, "zipfile_serialization", True)
        self.queued.append((_stage(state_dict, self.on_host, zipfile), path))

    def __getattr__(self, name: str) -> Any:
        # create, commit, makedirs, load, is_decoupled, preserves_storage_sharing: the replaced engine's own.
        return getattr(self.inner, name)


class DeepSpeedAsyncWriter:
    """At most one DeepSpeed save in flight per rank; committed by rank 0 once every rank's files are written."""

    def __init__(self, is_rank0: bool, on_host: bool, timeout: Any = None) -> None:
        self.is_rank0 = is_rank0
        self.on_host = on_host
        self.timeout = timeout
        self.process_group: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepspeed-checkpoint")
        self._future: Future | None = None
        self._path: Path | None = None
        self._lock = threading.Lock()
        self._removals: list[Path] = []
        self._pending = False
        self.last_committed: Path | None = None
        self.closed = False

    def save(self, model: nn.Module, write: Callable[[Path], None], path: Path, barrier: Any) -> None:
        """``write(tmp)`` (DeepSpeed's ``save_checkpoint``) with its files staged; they are written in the
        background and ``tmp`` committed to ``path`` after. Returns once the state is staged."""
        self.wait()
        if self.process_group is None:  # made at the first save, by every rank, once the world exists
            self.process_group = new_checkpoint_group(self.timeout)
        tmp = begin(path, self.is_rank0, barrier)
        staging = _StagingEngine(model.checkpoint_engine, self.on_host)  # type: ignore[union-attr]
        with _swapped_engine(model, staging):
            write(tmp)
        with self._lock:
            self._path, self._pending = path, True
            self._future = self._executor.submit(self._write, staging, tmp, path)

    def _write(self, staging: _StagingEngine, tmp: Path, path: Path) -> None:
        error: BaseException | None = None
        committed = False
        try:
            try:
                for staged, file in staging.queued:
                    if isinstance(staged, bytes):
                        Path(file).write_bytes(staged)
                    else:
                        staging.inner.save(staged, file)
            except BaseException as err:  # noqa: BLE001  (raised below, after every rank has agreed)
                error = err
            staging.queued.clear()  # the staged copies freed as soon as they are on disk
            # Every rank's files on disk (or one failed) before rank 0 renames: a collective of the writer's group.
            if self._all_ok(error is None) and self.is_rank0:
                try:
                    commit(tmp, path)
                except BaseException as err:  # noqa: BLE001
                    error = err
            # Every rank returns only after rank 0's rename, so a load right after the wait finds the checkpoint.
            committed = self._all_ok(error is None)
        finally:
            self._settle(path if committed else None)
        if error is not None:
            raise error
        if not committed:
            raise RuntimeError("another rank's part of the checkpoint could not be written or committed")

    def _all_ok(self, ok: bool) -> bool:
        if self.process_group is None:
            return ok
        failed = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(failed, group=self.process_group)
        return int(failed.item()) == 0

    def _settle(self, committed: Path | None) -> None:
        """The removals requested meanwhile, carried out once the new checkpoint is committed (dropped if it is
        not: the older ones are then the latest intact)."""
        with self._lock:
            self._pending = False
            removals, self._removals = self._removals, []
            if committed is not None:
                self.last_committed = committed
        if committed is not None and self.is_rank0:
            for removal in removals:
                self._remove_now(removal)

    def wait(self) -> None:
        """Block until the pending save is committed; raise its error, if any."""
        with self._lock:
            future, self._future = self._future, None
        if future is None:
            return
        try:
            future.result()
        except BaseException as error:
            raise AsyncCheckpointError.of(self._path, self.last_committed, error) from error

    def remove(self, path: Path) -> None:
        """Remove a checkpoint, or defer that until the pending save has committed."""
        if not self.is_rank0:
            return
        with self._lock:
            if self._pending:
                self._removals.append(path)
                return
        self._remove_now(path)

    def _remove_now(self, path: Path) -> None:
        if path == self.last_committed:
            return
        try:
            remove(path)
        except OSError as err:
            # A failed delete must not fail the commit thread, or a later save's wait would raise for it.
            log.warning("Could not remove old checkpoint %s: %s", path, err)

    def close(self) -> None:
        """Wait for the pending save, then stop the thread and release the group (at teardown and exit)."""
        try:
            self.wait()
        finally:
            self.closed = True
            self._executor.shutdown(wait=True)
            group, self.process_group = self.process_group, None
            # Destroyed on the main thread after the last write (see AsyncCheckpointer.close).
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)


@contextmanager
def _swapped_engine(model: nn.Module, staging: _StagingEngine) -> Generator[None, None, None]:
    model.checkpoint_engine = staging  # type: ignore[assignment]
    try:
        yield
    finally:
        model.checkpoint_engine = staging.inner  # type: ignore[assignment]
