"""The model tensors of any checkpoint kind, read a subset of keys at a time (for :mod:`.hf_export`).

Each source lists every model tensor's name, shape and dtype without reading a tensor, and reads the tensors
of the keys asked for and no others:

* a sharded DCP directory (ours at any stage / world size, Lightning's ``ModelParallelStrategy``'s): DCP reads
  only the byte ranges of the keys in its load target (``no_dist=True``, any number of shard files);
* one ``torch.save`` file (``checkpoint="full"``, Lightning's ``DDPStrategy``, ``consolidate`` output):
  ``torch.load(mmap=True)`` (through :mod:`._torch_files`, as every one-file read) maps the file, and only the pages of the tensors copied out are read;
* a DeepSpeed directory (ZeRO stages 0-3): :class:`._zero_reader.ZeroReader` indexes where each parameter lies
  in the ranks' flat fp32 partitions and assembles only the parameters asked for, the rank files mmap'd one at
  a time (the tensors ``zero_to_fp32`` gives, without rebuilding the whole model as it does).

Keys are the Lightning ``state_dict`` keys (``model.transformer.wte.weight``), without DCP's ``state_dict.``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import lightning_shard.checkpoint._torch_files as torch_files
from lightning_shard.checkpoint._zero_reader import ZeroReader
from lightning_shard.checkpoint.layout import (
    META_FILENAME,
    MODEL_KEY,
    is_deepspeed_checkpoint,
    is_sharded_checkpoint,
    local_path,
    metadata_reader,
)
from lightning_shard.checkpoint.sharded import read_meta
from lightning_shard.checkpoint.storage import Location, follow_alias, resolve
from lightning_shard.checkpoint.weights import read_dcp_tensors

SourceKind = Literal["sharded", "file", "deepspeed"]


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the checkpoint as saved: ``shape`` and ``dtype`` on disk."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


class Source:
    """One checkpoint, opened for reading; see the module docstring for what each kind reads."""

    def __init__(self, path: str | os.PathLike, weights_only: bool | None) -> None:
        # A local path or an object-store URL (sharded checkpoints and files; DeepSpeed's are local).
        self.path: Location = follow_alias(resolve(path, "export(checkpoint)"))
        self.weights_only = weights_only
        if not self.path.exists():
            raise FileNotFoundError(f"Checkpoint {str(self.path)!r} does not exist.")
        self._file: dict[str, Any] | None = None
        self._zero: ZeroReader | None = None
        self.kind: SourceKind
        if self.path.is_file():
            self.kind = "file"
            # mmap: the pickle is read now, each tensor's bytes only when that tensor is copied.
            loaded = torch_files.load(self.path, weights_only, mmap=True)
            self._file = loaded if isinstance(loaded, dict) else {}
        elif is_deepspeed_checkpoint(self.path):
            self.kind = "deepspeed"
            self.path = local_path(str(self.path), "export(checkpoint)")
            self._zero = ZeroReader(self.path, weights_only)
        elif is_sharded_checkpoint(self.path):
            self.kind = "sharded"
            self._reader = metadata_reader(self.path, weights_only)
            self._metadata = self._reader.read_metadata()
        else:
            raise ValueError(
                f"{str(self.path)!r} is a directory but not a sharded checkpoint (no .metadata / {META_FILENAME})"
                " nor a DeepSpeed one (no checkpoint/ folder): its save never finished, or it is not a checkpoint."
            )

    def tensors(self) -> dict[str, TensorInfo]:
        """Every model tensor of the checkpoint, in saved order; nothing is read but metadata."""
        if self.kind == "sharded":
            prefix = MODEL_KEY + "."
            return {
                key[len(prefix) :]: TensorInfo(tuple(md.size), md.properties.dtype)
                for key, md in self._metadata.state_dict_metadata.items()
                if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
            }
        if self._zero is not None:
            return {k: TensorInfo(shape, dtype) for k, (shape, dtype) in self._zero.tensors().items()}
        state = self._file_weights()
        return {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in state.items() if torch.is_tensor(v)}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``keys`` (and no others), whole, contiguous and owning their memory."""
        if self.kind == "sharded":
            prefix = MODEL_KEY + "."
            with (
                warnings.catch_warnings()
            ):  # one process is meant (no_dist=True); said once per file otherwise
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                read = read_dcp_tensors(
                    self.path, self._reader, self._metadata, [prefix + key for key in keys]
                )
            return {key: read[prefix + key] for key in keys}
        if self._zero is not None:
            return self._zero.read(keys)
        state = self._file_weights()
        # A copy: an mmap'd tensor may be a view into a storage shared with others (tied weights), which
        # safetensors refuses, and the copy is what this worker holds, the same as a DCP read.
        return {key: state[key].detach().clone(memory_format=torch.contiguous_format) for key in keys}

    def hyper_parameters(self) -> Any:
        """What Lightning saved as ``hyper_parameters`` (None when absent): read only when asked for, since it
        may hold classes that ``weights_only`` loading refuses."""
        if self.kind == "file":
            return (self._file or {}).get("hyper_parameters")
        if self.kind == "sharded":
            return read_meta(self.path, self.weights_only).get("hyper_parameters")
        assert self._zero is not None
        return self._zero.hyper_parameters()

    def _file_weights(self) -> dict[str, Any]:
        content = self._file or {}
        weights = content.get(MODEL_KEY, content)
        return weights if isinstance(weights, dict) else {}
