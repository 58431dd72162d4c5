"""``weights_only`` for DCP's ``.metadata``, which DCP unpickles itself with plain ``pickle``
(``FileSystemReader.read_metadata``).

Here it is unpickled with Python's documented restriction (``Unpickler.find_class``) to DCP's own metadata
classes, ``torch.Size``, dtypes and paths: :class:`RestrictedMetadata`, mixed into DCP's file-system reader
(:class:`MetadataReader`) and its fsspec one (:mod:`.storage`). It needs nothing else of the pack, so
every module that reads a checkpoint can use it.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}

#: The opt-in, ending every refusal of a restricted reader (here and in :mod:`._pickles`).
TRUST = "Pass weights_only=False (lightning-shard consolidate --trusted) only if you trust the checkpoint's source."


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"DCP .metadata names the global {module}.{name}, which weights_only loading refuses. {TRUST}"
            )
        return super().find_class(module, name)


class RestrictedMetadata:
    """Mixed into a DCP reader (``FileSystemReader`` or its fsspec subclass): ``.metadata`` is unpickled with
    :class:`_MetadataUnpickler` through the reader's own file system.

    Shard files need nothing more: DCP reads tensors as raw bytes and other entries with
    ``torch.load(weights_only=True)``.
    """

    fs: Any
    path: Any
    load_id: str

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        file = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(
                f"{str(file)!r} holds a {type(metadata).__name__}, not DCP metadata."
            )
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        metadata.storage_meta = storage_meta
        return metadata


class MetadataReader(RestrictedMetadata, FileSystemReader):
    """A DCP ``FileSystemReader`` whose ``.metadata`` is unpickled with :class:`_MetadataUnpickler`."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(str(path))
