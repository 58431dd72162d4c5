"""Asynchronous sharded checkpoints: stage to host memory, write in the background, commit atomically.

A save blocks the training loop only while ``torch.distributed.checkpoint.async_save`` copies the
state off the accelerator (a CPU copy; pinned memory on CUDA); the write runs in a background
thread on a process group of its own, so its collectives never interleave with training's.

Commit protocol, per checkpoint ``NAME``:

1. every rank writes its shards into ``NAME.tmp``; DCP's coordinator writes ``.metadata`` only
   after gathering every rank's write results, so rank 0's write finishing means all ranks' did;
2. rank 0 then writes ``meta.pt`` and renames ``NAME.tmp`` to ``NAME`` (one ``rename``);
3. only then are removals requested meanwhile (top-k pruning of older checkpoints) carried out,
   and aliases of the same step (``last.ckpt``) pointed at ``NAME``.

So a crash at any point leaves the previous checkpoint intact and never exposes a partial one
under a final name. The next save and teardown wait for the pending one; an error in the
background write is raised there, with the checkpoint path.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import Any, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import lightning_shard.checkpoint._torch_files as torch_files
from lightning_shard.checkpoint._commit import begin, commit, remove, save_file, tmp_path
from lightning_shard.checkpoint.layout import META_FILENAME
from lightning_shard.checkpoint.storage import Location, Remote, storage_writer

log = logging.getLogger(__name__)


class AsyncCheckpointError(RuntimeError):
    """A background checkpoint write failed."""

    @classmethod
    def of(cls, path: Any, last_committed: Any, error: BaseException) -> AsyncCheckpointError:
        """The error for ``path``'s failed write, naming the checkpoint left intact (both engines' writers)."""
        return cls(
            f"Writing checkpoint {str(path)!r} in the background failed: {error!r}. The previous checkpoint"
            f" ({str(last_committed) if last_committed else 'none'}) is intact; check free space and"
            " permissions of the checkpoint directory."
        )


class AsyncCheckpointer:
    """At most one background save in flight; commits, aliases and deferred removals after it."""

    def __init__(self, is_rank0: bool, process_group: Any = None) -> None:
        self.is_rank0 = is_rank0
        self.process_group = process_group
        self._future: Future | None = None
        self._path: Location | None = None
        self._step: int | None = None
        self._meta: dict[str, Any] = {}
        self._committed = threading.Event()
        self._committed.set()
        self._lock = threading.Lock()
        self._aliases: list[Location] = []
        self._removals: list[Location] = []
        self._error: BaseException | None = None
        self.last_committed: Location | None = None
        self.closed = False

    def save(
        self, state: dict[str, Any], meta: dict[str, Any], path: Location, barrier: Any, alias: bool = True
    ) -> None:
        """Start writing ``state`` to ``path``; returns once the state is staged in host memory.

        ``alias=False`` always writes the bytes (an exception checkpoint: a link to a checkpoint that
        top-k pruning may remove later would leave it pointing at nothing).
        """
        step = meta.get("global_step")
        same_step = self._path is not None and step is not None and step == self._step and path != self._path
        if alias and same_step:
            # Same training step saved under a second name (ModelCheckpoint's last.ckpt): alias the
            # checkpoint being written instead of writing the same bytes twice. The later call's metadata
            # wins: the callbacks' state there already names this save (ModelCheckpoint's last_model_path), so a
            # run resumed from either name keeps writing to it, as after two plain saves.
            with self._lock:
                if self._committed.is_set():
                    self._rewrite_meta(meta)
                    self._make_alias(path)
                else:
                    self._meta = meta
                    self._aliases.append(path)
            return
        self.wait()
        tmp = begin(path, self.is_rank0, barrier)
        self._committed.clear()
        self._path, self._step, self._aliases, self._meta = path, step, [], meta
        # Thread mode returns a plain Future (AsyncSaveResponse only comes with async staging).
        future = cast(
            Future,
            dcp.async_save(
                state,
                checkpoint_id=str(tmp),
                storage_writer=storage_writer(tmp),
                process_group=self.process_group,
            ),
        )
        self._future = future
        future.add_done_callback(lambda f: self._finish(f, tmp, path))

    def _finish(self, future: Future, tmp: Location, path: Location) -> None:
        try:
            future.result()
            if self.is_rank0:
                with self._lock:
                    meta = self._meta  # the latest, an alias's included
                torch_files.save(meta, tmp / META_FILENAME)
                commit(tmp, path)
                with self._lock:
                    if meta is not self._meta:  # an alias's metadata arrived during the commit
                        self._rewrite_meta(self._meta)
                    self.last_committed = path
                    for alias in self._aliases:
                        self._make_alias(alias)
                    for removal in self._removals:
                        self._remove_now(removal)
                    self._removals = []
        except BaseException as err:  # surfaced at the next save or teardown, never swallowed
            self._error = err
        finally:
            self._committed.set()

    def wait(self) -> None:
        """Block until the pending save is committed; raise its error, if any."""
        self._committed.wait()
        self._future = None  # drop the finished write (and what it references) promptly
        error, self._error = self._error, None
        if error is not None:
            path, self._path = self._path, None
            raise AsyncCheckpointError.of(path, self.last_committed, error) from error

    def remove(self, path: Location) -> None:
        """Remove a checkpoint, or defer that until the pending save has committed."""
        if not self.is_rank0:
            return
        with self._lock:
            if not self._committed.is_set():
                self._removals.append(path)
                return
            self._remove_now(path)

    def _remove_now(self, path: Location) -> None:
        if path == self.last_committed or path == self._path:
            return
        try:
            remove(path)
        except OSError as err:
            # A failed delete must not kill the commit thread, or later commits would never happen.
            log.warning("Could not remove old checkpoint %s: %s", path, err)

    def _rewrite_meta(self, meta: dict[str, Any]) -> None:
        """Replace the committed checkpoint's ``meta.pt`` whole (a rename locally; one object remotely)."""
        if not self.is_rank0 or self._path is None:
            return
        self._meta = meta
        save_file(meta, self._path / META_FILENAME)

    def _make_alias(self, alias: Location) -> None:
        if not self.is_rank0 or self._path is None:
            return
        target = self._path
        if isinstance(alias, Remote) or isinstance(target, Remote):
            assert isinstance(alias, Remote) and isinstance(target, Remote)
            remove(alias)
            alias.write_alias(target)  # one object: visible whole, after the checkpoint it names committed
            return
        tmp_link = tmp_path(alias.with_name(alias.name + ".link"))
        remove(tmp_link)
        os.symlink(os.path.relpath(target, alias.parent), tmp_link)
        if alias.is_dir() and not alias.is_symlink():
            remove(alias)
        os.replace(tmp_link, alias)

    def close(self) -> None:
        """Wait for the pending save, then release the checkpoint process group (at teardown)."""
        try:
            self.wait()
        finally:
            self.closed = True
            group, self.process_group = self.process_group, None
            # Destroyed explicitly, on the main thread, after the last write: a gloo group torn down
            # at interpreter exit while its threads are still joinable aborts the process.
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)


def new_checkpoint_group(timeout: Any = None) -> Any:
    """A gloo group for background checkpoint collectives (gloo: they run on host memory), waiting at
    most ``timeout`` (the strategy's flag) like every other group."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=timeout)
