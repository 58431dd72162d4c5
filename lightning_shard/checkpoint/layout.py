"""Where things are in a checkpoint: names, and how to tell the kinds apart."""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

META_FILENAME = "meta.pt"
MODEL_KEY = "state_dict"
DEEPSPEED_TAG = "checkpoint"


def local_path(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a local (or mounted) file-system path; a URL is refused, never turned into a local path.

    ``pathlib`` reads ``"s3://bucket/run"`` as the relative path ``s3:/bucket/run``: a checkpoint would land in a
    local directory named ``s3:`` while the job looks fine and nothing reaches the bucket.
    """
    text = os.fspath(path)
    scheme, sep, rest = text.partition("://")
    if not sep or "/" in scheme:
        return Path(text)
    if scheme == "file":
        return Path(rest)
    raise ValueError(
        f"{flag}={text!r} is a {scheme}:// URL, and ShardStrategy writes and reads checkpoints on a local or"
        " mounted file system only: the URL would become a local directory named"
        f" {scheme + ':'!r}. Use a local path, or the bucket mounted as a directory."
    )


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / META_FILENAME).is_file()


def metadata_reader(path: str | os.PathLike, weights_only: bool | None = None) -> FileSystemReader:
    """DCP's reader for ``path``; its ``.metadata`` unpickled with the restricted unpickler unless
    ``weights_only=False`` (DCP's own reader uses plain ``pickle``, which runs what a planted file names)."""
    from lightning_shard.checkpoint._pickles import MetadataReader

    return FileSystemReader(str(path)) if weights_only is False else MetadataReader(str(path))


def read_metadata(path: str | os.PathLike, weights_only: bool | None = None) -> Metadata:
    return metadata_reader(path, weights_only).read_metadata()


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    """A directory written by the DeepSpeed engine (``DeepSpeedEngine.save_checkpoint``)."""
    tag_dir = Path(path) / DEEPSPEED_TAG
    return tag_dir.is_dir() and any(tag_dir.glob("*mp_rank_00_model_states.pt"))
