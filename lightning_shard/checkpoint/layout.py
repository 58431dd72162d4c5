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


def read_metadata(path: str | os.PathLike) -> Metadata:
    return FileSystemReader(str(path)).read_metadata()


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    """A directory written by the DeepSpeed engine (``DeepSpeedEngine.save_checkpoint``)."""
    tag_dir = Path(path) / DEEPSPEED_TAG
    return tag_dir.is_dir() and any(tag_dir.glob("*mp_rank_00_model_states.pt"))
