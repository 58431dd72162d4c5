"""The one commit protocol every checkpoint write goes through (sync, async, DeepSpeed, one file).

Every rank writes into ``NAME.tmp``; only once every rank's part is on disk does rank 0 rename it
to ``NAME`` (one ``rename``), replacing an older checkpoint of that name. A crash at any point
leaves the previous checkpoint intact and never exposes a partial one under a final name.

On an object store (:class:`~lightning_shard.checkpoint.storage.Remote`, no rename) the checkpoint is written
in place and committed by its marker written last; ``tmp_path`` is then the final name and ``commit`` has
nothing left to do (see :mod:`.storage`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, overload

import lightning_shard.checkpoint._torch_files as torch_files
from lightning_shard.checkpoint.storage import Location, Remote

TMP_SUFFIX = ".tmp"


@overload
def tmp_path(path: Path) -> Path: ...
@overload
def tmp_path(path: Remote) -> Remote: ...
def tmp_path(path: Location) -> Location:
    """Where ``path`` is written before it is committed (in place on an object store)."""
    return path if isinstance(path, Remote) else path.with_name(path.name + TMP_SUFFIX)


@overload
def begin(path: Path, is_rank0: bool, barrier: Callable[[], None]) -> Path: ...
@overload
def begin(path: Remote, is_rank0: bool, barrier: Callable[[], None]) -> Remote: ...
def begin(path: Location, is_rank0: bool, barrier: Callable[[], None]) -> Location:
    """Step 1 on every rank: a fresh, empty ``NAME.tmp`` directory to write into (a stale one is replaced);
    on an object store, the old checkpoint of that name removed, its marker first."""
    tmp = tmp_path(path)
    if is_rank0:
        remove(tmp)
        if isinstance(tmp, Path):
            tmp.mkdir(parents=True)
    barrier()
    return tmp


def write_committed(
    path: Location, write: Callable[[Any], None], is_rank0: bool, barrier: Callable[[], None]
) -> None:
    """``write(tmp)`` on every rank, then commit ``tmp`` to ``path`` once every rank has written."""
    tmp = begin(path, is_rank0, barrier)
    write(tmp)
    barrier()
    if is_rank0:
        commit(tmp, path)
    barrier()


def commit(tmp: Location, path: Location) -> None:
    """Move a fully written checkpoint to its final name, replacing an older one of that name."""
    if not isinstance(path, Path) or not isinstance(tmp, Path):
        return  # an object store's: written in place, committed by its marker
    if path.exists() or path.is_symlink():
        old = path.with_name(path.name + ".old")
        remove(old)
        os.replace(path, old)
        os.replace(tmp, path)
        remove(old)
    else:
        os.replace(tmp, path)


def save_file(checkpoint: dict[str, Any], path: Location) -> None:
    """``torch.save`` to a temporary file, then rename: a reader never sees a partial file. An object is
    visible only once its upload completes: written in place."""
    if isinstance(path, Remote):
        if path.is_dir():
            path.remove()
        torch_files.save(checkpoint, path)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        shutil.rmtree(path)
    tmp = tmp_path(path)
    torch_files.save(checkpoint, tmp)
    os.replace(tmp, path)


def remove(path: Location) -> None:
    if isinstance(path, Remote):
        path.remove()
    elif path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
