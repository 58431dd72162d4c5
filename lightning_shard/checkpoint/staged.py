"""Checkpoints a library writes as local files only (DeepSpeed's), kept on an object store.

DeepSpeed opens its files itself, by local path. On an object store (:class:`~.storage.Remote`) each rank
therefore writes into a local staging directory of its own, uploads the files it wrote under the final prefix,
and the checkpoint is committed as the FSDP engine's are (:mod:`.storage`): the old checkpoint of that name is
removed first (its marker first), and rank 0 writes the marker ``meta.pt`` only after every rank's upload has
finished. A prefix without its marker is not a checkpoint: resuming from it is refused ("its save never
finished"), and ``ckpt_path="last"`` skips it.

Which rank writes which file is DeepSpeed's choice (rank 0: ``latest`` and, below ZeRO-3, the module; each
rank: its own ZeRO partitions); the staging directories together hold exactly the files a shared directory
would. Loading downloads the whole prefix to a local temporary directory on every rank: DeepSpeed's load reads
every rank's optimizer partitions, not only its own.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning_shard.checkpoint._torch_files as torch_files
from lightning_shard.checkpoint._commit import begin
from lightning_shard.checkpoint._errors import CheckpointLoadError, on_every_rank
from lightning_shard.checkpoint.layout import META_FILENAME
from lightning_shard.checkpoint.storage import Remote

#: What the marker of a staged checkpoint holds (Lightning's entries are in DeepSpeed's own files).
MARKER = {"format": "deepspeed"}


def write_staged(
    path: Remote, write: Callable[[Path], None], is_rank0: bool, barrier: Callable[[], None]
) -> None:
    """``write(local_dir)`` on every rank, every rank's files uploaded under ``path``, then the marker."""
    begin(path, is_rank0, barrier)
    with tempfile.TemporaryDirectory(prefix="lightning-shard-staging-") as staging:
        write(Path(staging))
        upload(Path(staging), path)
    barrier()  # every rank's files are stored
    if is_rank0:
        torch_files.save(MARKER, path / META_FILENAME)
    barrier()


def upload(local: Path, path: Remote) -> None:
    """Every file under ``local`` to the same relative name under ``path``."""
    for file in sorted(f for f in local.rglob("*") if f.is_file()):
        target = path / file.relative_to(local).as_posix()
        path.fs.put_file(str(file), target.key)
    path.fs.invalidate_cache()


@contextmanager
def downloaded(path: Remote, every_rank: bool = True) -> Iterator[Path]:
    """A local copy of the committed checkpoint at ``path``, removed on exit. One that is not complete is
    refused: on every rank (``every_rank``: all ranks call this), or in this process alone."""
    if every_rank:
        on_every_rank(path, lambda: check_committed(path))
    else:
        check_committed(path)
    with tempfile.TemporaryDirectory(prefix="lightning-shard-download-") as tmp:
        local = Path(tmp) / path.name
        local.mkdir()
        path.fs.get(path.key + "/", str(local) + "/", recursive=True)
        yield local


def check_committed(path: Remote) -> None:
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    if not (path / META_FILENAME).is_file():
        raise CheckpointLoadError(
            f"{str(path)!r} is not a complete checkpoint (missing {META_FILENAME}, the marker written after every"
            " rank's files): its save never finished, or it is not a checkpoint. Resume from a checkpoint whose"
            " save finished."
        )
