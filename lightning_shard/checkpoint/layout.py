"""Where things are in a checkpoint: names, and how to tell the kinds apart."""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from lightning_shard.checkpoint._dcp_metadata import MetadataReader
from lightning_shard.checkpoint.storage import Location, Remote, remote_metadata_reader, resolve

META_FILENAME = "meta.pt"
MODEL_KEY = "state_dict"
DEEPSPEED_TAG = "checkpoint"
#: Expert parallelism under the DeepSpeed engine: the entry of its model-states file that names the expert
#: blocks, and the file (in the tag folder) of the fp32 blocks of expert-parallel rank ``r``.
DEEPSPEED_EXPERTS = "expert_parallel"


def expert_blocks_file(rank: int) -> str:
    return f"expert_blocks_ep_rank_{rank:02d}.pt"


def local_path(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a local (or mounted) file-system path; any URL is refused with the fix (for writers that open
    files by local path only, where the object stores :func:`~lightning_shard.checkpoint.storage.resolve` accepts
    are not wanted)."""
    location = resolve(path, flag)
    if isinstance(location, Remote):
        raise ValueError(
            f"{flag}={str(path)!r}: this writer needs a local or mounted path (it opens its files by local path)."
            " Use a local path or the bucket mounted as a directory."
        )
    return location


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: str | os.PathLike | Remote) -> bool:
    path = _location(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / META_FILENAME).is_file()


def metadata_reader(path: str | os.PathLike | Remote, weights_only: bool | None = None) -> FileSystemReader:
    """DCP's reader for ``path``; its ``.metadata`` unpickled with the restricted unpickler unless
    ``weights_only=False`` (DCP's own reader uses plain ``pickle``, which runs what a planted file names)."""
    if isinstance(path, Remote):
        return remote_metadata_reader(path, weights_only)
    return FileSystemReader(str(path)) if weights_only is False else MetadataReader(str(path))


def read_metadata(path: str | os.PathLike | Remote, weights_only: bool | None = None) -> Metadata:
    return metadata_reader(path, weights_only).read_metadata()


def is_deepspeed_checkpoint(path: str | os.PathLike | Remote) -> bool:
    """A directory written by the DeepSpeed engine (``DeepSpeedEngine.save_checkpoint``)."""
    if isinstance(path, Remote):
        return (path / DEEPSPEED_TAG).is_dir()
    tag_dir = Path(path) / DEEPSPEED_TAG
    return tag_dir.is_dir() and any(tag_dir.glob("*mp_rank_00_model_states.pt"))


def _location(path: str | os.PathLike | Remote) -> Location:
    return path if isinstance(path, Remote) else Path(path)
