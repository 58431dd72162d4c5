"""Where a checkpoint lives: a local (or mounted) path, or an object store reached through fsspec.

``resolve(path, flag)`` turns what the user gave (``ModelCheckpoint(dirpath=...)``, ``ckpt_path``, the
``consolidate`` arguments) into a :class:`~pathlib.Path` or a :class:`Remote`. A URL is never turned into a local
path (``pathlib`` reads ``"s3://bucket/run"`` as the relative path ``s3:/bucket/run``): a scheme the pack can
write goes to fsspec, any other is refused with the fix.

:class:`Remote` offers the few ``Path`` methods the checkpoint code uses (``/``, ``name``, ``parent``,
``with_name``, ``exists``, ``is_dir``, ``is_file``, ``stat().st_size``), so checks read the same for both.

**Commit on a store without rename.** An object store has no atomic rename of a directory, so a sharded
checkpoint is written in place under its final prefix and committed by a marker written last: ``meta.pt``,
written by rank 0 only after DCP has written ``.metadata``, which DCP's coordinator writes only after every
rank's shards are stored. A prefix without ``meta.pt`` is not a checkpoint: resuming from it is refused ("its
save never finished"). Re-saving under an existing name first deletes the old marker, then the old objects,
then writes: a reader sees the old checkpoint, no checkpoint, or the new one, never a mix. A one-file
checkpoint is one object, which the store makes visible only once its upload completes. A second name for the
same step (``last.ckpt``) is an *alias object*: a small file naming the checkpoint it points at, written after
that checkpoint is committed, and followed by every reader.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import fsspec
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from lightning_shard.checkpoint._dcp_metadata import RestrictedMetadata

#: Schemes whose fsspec file systems write objects (tested against an S3 API; the others use the same calls).
WRITABLE_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}
#: What an alias object starts with, before the name of the checkpoint it points at.
ALIAS_HEADER = b"lightning-shard alias\n"
_EXTRA = {"s3": "lightning-shard[s3]", "gcs": "gcsfs", "azure": "adlfs"}


@dataclass(frozen=True)
class _Stat:
    st_size: int


class Remote:
    """A location in an object store: ``s3://bucket/run/epoch=0-step=2.ckpt``."""

    def __init__(self, url: str, fs: Any = None) -> None:
        self.url = url.rstrip("/")
        self.fs = fs if fs is not None else fsspec.core.url_to_fs(self.url)[0]
        self.key = self.fs._strip_protocol(self.url)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Remote) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> Remote:
        return Remote(f"{self.url}/{name}", self.fs)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> Remote:
        return Remote(self.url.rsplit("/", 1)[0], self.fs)

    def with_name(self, name: str) -> Remote:
        return self.parent / name

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_dir(self) -> bool:
        self.fs.invalidate_cache(self.key)
        return bool(self.fs.isdir(self.key))

    def is_file(self) -> bool:
        self.fs.invalidate_cache(self.key)
        return bool(self.fs.isfile(self.key))

    def is_symlink(self) -> bool:
        return False

    def stat(self) -> _Stat:
        return _Stat(int(self.fs.size(self.key)))

    def open(self, mode: str = "rb") -> IO[bytes]:
        return self.fs.open(self.key, mode)

    def remove(self) -> None:
        """Delete the object or every object under the prefix; ``meta.pt`` (the commit marker) first."""
        if self.is_file():
            self.fs.rm_file(self.key)
        elif self.is_dir():
            marker = self / "meta.pt"
            if marker.is_file():
                self.fs.rm_file(marker.key)
            self.fs.rm(self.key, recursive=True)
        self.fs.invalidate_cache()

    def write_alias(self, target: Remote) -> None:
        with self.open("wb") as f:
            f.write(ALIAS_HEADER + target.name.encode())


Location = Path | Remote


def resolve(path: str | os.PathLike | Remote, flag: str) -> Location:
    """``path`` as a local path, or a :class:`Remote` for a URL of a scheme the pack can write."""
    if isinstance(path, Remote):
        return path
    text = os.fspath(path)
    scheme, sep, rest = text.partition("://")
    if not sep or "/" in scheme:
        return Path(text)
    if scheme == "file":
        return Path(rest)
    protocol = WRITABLE_SCHEMES.get(scheme)
    if protocol is None:
        raise ValueError(
            f"{flag}={text!r}: ShardStrategy cannot write checkpoints to {scheme}:// URLs (it writes to local or"
            f" mounted paths and to object stores: {', '.join(sorted(s + '://' for s in WRITABLE_SCHEMES))})."
            " Use a local path, a mounted directory, or one of those URLs."
        )
    try:  # the store's file system (s3fs, gcsfs, adlfs) is an optional extra
        fsspec.get_filesystem_class(protocol)
    except ImportError as err:
        raise ImportError(
            f"{flag}={text!r} needs fsspec's {scheme}:// file system, which is not installed: pip install"
            f" '{_EXTRA[protocol]}'."
        ) from err
    return Remote(text)


def is_remote(path: Any) -> bool:
    return isinstance(path, Remote)


def storage_writer(path: Location) -> Any:
    """DCP's writer for ``path``: fsspec's for an object store, ``None`` (DCP's file-system default) otherwise."""
    return FsspecWriter(path.url) if isinstance(path, Remote) else None


def follow_alias(path: Location) -> Location:
    """The checkpoint an alias object names, or ``path`` itself."""
    if not isinstance(path, Remote) or not path.is_file() or path.stat().st_size > 4096:
        return path
    with path.open("rb") as f:
        content = f.read()
    if not content.startswith(ALIAS_HEADER):
        return path
    return path.with_name(content[len(ALIAS_HEADER) :].decode())


def newest_last(directory: Remote) -> Remote | None:
    """The newest committed ``last*.ckpt`` under ``directory`` (what ``ckpt_path="last"`` means), aliases
    followed and checkpoints without their marker skipped; ``None`` when there is none."""
    found: list[tuple[float, Remote]] = []
    for key in directory.fs.ls(directory.key, detail=False, refresh=True) if directory.is_dir() else []:
        entry = directory / key.rstrip("/").rsplit("/", 1)[-1]
        if not re.fullmatch(r"last(-v?\d+)?\.ckpt", entry.name):
            continue
        target = follow_alias(entry)
        if not isinstance(target, Remote):
            continue
        stamp = target / "meta.pt" if target.is_dir() else target
        if stamp.is_file():
            found.append((stamp.fs.modified(stamp.key).timestamp(), entry))
    return max(found, key=lambda item: item[0])[1] if found else None


def remote_metadata_reader(path: Remote, weights_only: bool | None) -> FsspecReader:
    """DCP's fsspec reader for ``path``; ``.metadata`` through the restricted unpickler unless
    ``weights_only=False`` (as :func:`~lightning_shard.checkpoint.layout.metadata_reader` on disk)."""
    if weights_only is False:
        return FsspecReader(path.url)
    return RemoteMetadataReader(path.url)


class RemoteMetadataReader(RestrictedMetadata, FsspecReader):
    """DCP's fsspec reader whose ``.metadata`` is unpickled with the restricted unpickler."""
