"""``weights_only`` for the pickles inside checkpoint directories that torch.load does not open itself.

``torch.load(weights_only=True)`` refuses any global outside torch's allowlist, so a planted pickle
cannot run code. Two files of our layouts are read by libraries that do not offer that:

* DCP's ``.metadata`` is read with plain ``pickle`` (``FileSystemReader.read_metadata``). Here it is
  unpickled with Python's documented restriction (``Unpickler.find_class``) to DCP's own metadata
  classes, ``torch.Size``, dtypes and paths: :class:`MetadataReader`.
* DeepSpeed's ``zero_to_fp32`` loads every rank's files with ``weights_only=False``. Before it does,
  :func:`check_deepspeed_pickles` lists each file's globals with torch's own scanner
  (``torch.serialization.get_unsafe_globals_in_checkpoint``, which reads the pickle's opcodes and
  runs nothing) and refuses a file naming anything beyond DeepSpeed's plain classes below.
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

#: Globals DeepSpeed's checkpoint files name beyond torch's ``weights_only`` allowlist: an enum, the
#: ZeRO-1/2 partition bookkeeping dataclass and the loss scalers' plain state classes.
DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    }
)

_TRUST = "Pass weights_only=False (lightning-shard consolidate --trusted) only if you trust the checkpoint's source."


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"DCP .metadata names the global {module}.{name}, which weights_only loading refuses. {_TRUST}"
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


def check_deepspeed_files(path: Path) -> None:
    """Every file of a DeepSpeed checkpoint directory passes :func:`check_deepspeed_pickles`, or
    :class:`~lightning_shard.CheckpointLoadError` names the file, the global and the opt-in."""
    from lightning_shard.checkpoint import _errors
    from lightning_shard.checkpoint.layout import DEEPSPEED_TAG

    files = sorted((Path(path) / DEEPSPEED_TAG).glob("*.pt"))
    try:
        check_deepspeed_pickles(files)
    except Exception as err:  # noqa: BLE001  (a refused global, or a file cut short: the scanner reads it whole)
        raise _errors.unreadable(Path(path), "a DeepSpeed file", err) from err


def check_deepspeed_pickles(files: list[Path]) -> None:
    """Raise ``pickle.UnpicklingError`` unless every file names only torch-safe and DeepSpeed's plain globals,
    and the harmless hyper-parameter classes a ``torch.load`` of ours allows (:mod:`._torch_files`)."""
    from lightning_shard.checkpoint._torch_files import allowed_names

    for file in files:
        named = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(file)))
        unsafe = named - DEEPSPEED_GLOBALS - allowed_names(str(file))
        if unsafe:
            raise pickle.UnpicklingError(
                f"{str(file)!r} names {', '.join(sorted(unsafe))}, which weights_only loading refuses. {_TRUST}"
            )
