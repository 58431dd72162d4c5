"""Where things are in a checkpoint: names, and how to tell the kinds apart."""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

META_FILENAME = "meta.pt"
MODEL_KEY = "state_dict"
DEEPSPEED_TAG = "checkpoint"


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
