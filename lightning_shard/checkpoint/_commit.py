"""The one commit protocol every checkpoint write goes through (sync, async, DeepSpeed, one file).

Every rank writes into ``NAME.tmp``; only once every rank's part is on disk does rank 0 rename it
to ``NAME`` (one ``rename``), replacing an older checkpoint of that name. A crash at any point
leaves the previous checkpoint intact and never exposes a partial one under a final name.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning_shard.checkpoint._torch_files as torch_files

TMP_SUFFIX = ".tmp"


def tmp_path(path: Path) -> Path:
    """Where ``path`` is written before it is committed."""
    return path.with_name(path.name + TMP_SUFFIX)


def begin(path: Path, is_rank0: bool, barrier: Callable[[], None]) -> Path:
    """Step 1 on every rank: a fresh, empty ``NAME.tmp`` directory to write into (a stale one is replaced)."""
    tmp = tmp_path(path)
    if is_rank0:
        remove(tmp)
        tmp.mkdir(parents=True)
    barrier()
    return tmp


def write_committed(
    path: Path, write: Callable[[Path], None], is_rank0: bool, barrier: Callable[[], None]
) -> None:
    """``write(tmp)`` on every rank, then commit ``tmp`` to ``path`` once every rank has written."""
    tmp = begin(path, is_rank0, barrier)
    write(tmp)
    barrier()
    if is_rank0:
        commit(tmp, path)
    barrier()


def commit(tmp: Path, path: Path) -> None:
    """Move a fully written checkpoint to its final name, replacing an older one of that name."""
    if path.exists() or path.is_symlink():
        old = path.with_name(path.name + ".old")
        remove(old)
        os.replace(path, old)
        os.replace(tmp, path)
        remove(old)
    else:
        os.replace(tmp, path)


def save_file(checkpoint: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a temporary file, then rename: a reader never sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        shutil.rmtree(path)
    tmp = tmp_path(path)
    torch_files.save(checkpoint, tmp)
    os.replace(tmp, path)


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
