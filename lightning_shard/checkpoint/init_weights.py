"""Start training from full pretrained weights without any rank holding the full model.

``ShardStrategy(init_weights=PATH)`` calls :func:`load_full_weights` on every rank once the model is
sharded and its parameters are allocated. Accepted ``PATH`` (:func:`open_weights`):

* a ``torch.save`` file of a state dict: a flat ``{name: Tensor}`` dict, or a dict whose
  ``"state_dict"`` entry is one (a Lightning checkpoint). ``lightning-shard consolidate`` writes the
  flat kind. It is opened with ``torch.load(mmap=True, weights_only=True)``: tensors stay on disk,
  memory-mapped, and slicing one pages in only the bytes of the slice (its rows, for a dim-0 shard);
* a ``.safetensors`` file, read with ``safe_open(...).get_slice(name)[index]``: only the slice;
* a Hugging Face directory: ``model.safetensors.index.json`` (its ``"weight_map"`` names the shard
  file of every tensor) with its shard files, or a single ``model.safetensors``.

Memory: for every parameter or buffer, a rank reads only the slice of the global tensor it holds
(:func:`local_index`), one tensor at a time, and copies it into its local shard. Its extra memory is
at most one local shard (the largest), never a full sharded tensor; summed over N ranks, the bytes
read are one copy of every sharded tensor plus N copies of each replicated one.

File keys are matched to the module's state-dict keys exactly, or through ONE prefix found
automatically (:func:`match_keys`): an HF model held as ``self.model`` in a LightningModule has keys
``model.`` + file key; a file saved from a wrapper (``module.``, ``model.``) has keys with a prefix
the module lacks. Every mismatch (missing, unexpected, shape) is reported before any tensor is read.
"""

from __future__ import annotations

import json
import logging
import pickle
from abc import ABC, abstractmethod
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_shard.checkpoint import _keys

_log = logging.getLogger(__name__)
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
_ACCEPTED = (
    "Accepted: a torch.save state-dict file (flat, or with a top-level 'state_dict'), a .safetensors"
    f" file, or a Hugging Face directory ({HF_INDEX} with its shard files, or {HF_SINGLE})."
)
# safetensors' dtype names (``get_slice(name).get_dtype()``) as torch dtypes.
_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

Index = tuple[slice, ...]


class InitWeightsError(ValueError):
    """Pretrained weights cannot initialise the model: unreadable, of another model, or wrongly placed."""


class WeightSource(ABC):
    """Named tensors of a weights file or directory, read slice by slice; ``bytes_read`` counts what was read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bytes_read = 0

    @abstractmethod
    def keys(self) -> list[str]: ...

    @abstractmethod
    def shape(self, name: str) -> torch.Size: ...

    @abstractmethod
    def dtype(self, name: str) -> torch.dtype: ...

    @abstractmethod
    def _read(self, name: str, index: Index | None) -> torch.Tensor: ...

    def read(self, name: str, index: Index | None = None) -> torch.Tensor:
        """Only ``tensor[index]`` (the whole tensor for ``None``), as a new contiguous CPU tensor."""
        tensor = self._read(name, index or None)  # () indexes a 0-d tensor whole
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    @abstractmethod
    def close(self) -> None:
        """Release open files and memory maps."""

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TorchFileSource(WeightSource):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise InitWeightsError(
                f"init_weights={str(path)!r} cannot be read as a torch.save state dict ({type(err).__name__}:"
                f" {str(err).splitlines()[0] if str(err) else ''}). {_ACCEPTED} A checkpoint holding"
                " more than tensors: `lightning-shard consolidate CKPT model.pt`, then pass model.pt."
            ) from err
        state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
        if not isinstance(state, dict):
            raise InitWeightsError(
                f"init_weights={str(path)!r} holds a {type(obj).__name__}, not a state dict. {_ACCEPTED}"
            )
        # Non-tensor entries (a module's ``_extra_state``) are not weights.
        self._tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> torch.Size:
        return self._tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._tensors[name].dtype

    def _read(self, name: str, index: Index | None) -> torch.Tensor:
        view = self._tensors[name] if index is None else self._tensors[name][index]
        # A copy, never the memory-mapped view: only the slice's pages are read.
        return view.clone(memory_format=torch.contiguous_format)

    def close(self) -> None:
        self._tensors = {}


class _SafetensorsSource(WeightSource):
    def __init__(self, path: Path, files: dict[str, Path]) -> None:
        super().__init__(path)
        self._files = files  # tensor name -> the .safetensors file holding it
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def _handle(self, name: str) -> Any:
        file = self._files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_safe_open(file))
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self._files)

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._handle(name).get_slice(name).get_dtype()]

    def _read(self, name: str, index: Index | None) -> torch.Tensor:
        handle = self._handle(name)
        tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        return tensor.contiguous()

    def close(self) -> None:
        self._stack.close()
        self._handles = {}


def _safe_open(file: Path) -> Any:
    try:
        from safetensors import safe_open  # optional: safetensors
    except ImportError as err:
        raise InitWeightsError(
            f"init_weights={str(file)!r} is in the safetensors format, which needs the `safetensors`"
            " package: pip install safetensors."
        ) from err
    return safe_open(str(file), framework="pt")


def _safetensors_file(path: Path) -> _SafetensorsSource:
    with _safe_open(path) as handle:
        names = list(handle.keys())
    return _SafetensorsSource(path, dict.fromkeys(names, path))


def _hf_directory(path: Path) -> _SafetensorsSource:
    index = path / HF_INDEX
    if not index.is_file():
        return _safetensors_file(path / HF_SINGLE)
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
    if missing:
        raise InitWeightsError(
            f"init_weights={str(path)!r}: {HF_INDEX} names shard files that are not in the directory:"
            f" {', '.join(missing[: _keys.SHOWN])}. Download or copy every shard of the model."
        )
    return _SafetensorsSource(path, {name: path / file for name, file in weight_map.items()})


def open_weights(path: str | Path) -> WeightSource:
    """The tensors of a ``torch.save`` file, a ``.safetensors`` file or a Hugging Face directory."""
    path = Path(path)
    if not path.exists():
        raise InitWeightsError(f"init_weights={str(path)!r} does not exist. Check the path. {_ACCEPTED}")
    if path.is_dir():
        if (path / HF_INDEX).is_file() or (path / HF_SINGLE).is_file():
            return _hf_directory(path)
        found = sorted(p.name for p in path.iterdir())
        shown = ", ".join(found[:10]) + (f" and {len(found) - 10} more" if len(found) > 10 else "")
        raise InitWeightsError(
            f"init_weights={str(path)!r} is a directory with neither {HF_INDEX} nor {HF_SINGLE}"
            f" (found: {shown or 'nothing'}). {_ACCEPTED} For a sharded lightning-shard checkpoint,"
            " write its weights as one file first: `lightning-shard consolidate CKPT model.pt`."
        )
    if path.suffix == ".safetensors":
        return _safetensors_file(path)
    return _TorchFileSource(path)


def _match(
    source: WeightSource, targets: dict[str, tuple[torch.Size, torch.dtype]], aliases: list[set[str]]
) -> tuple[_keys.Prefix, dict[str, str]]:
    prefix, mapping, problems = _keys.match(source, targets, aliases)
    if any(problems):
        raise InitWeightsError(_keys.mismatch_message(source.path, prefix, *problems))
    return prefix, mapping


def match_keys(
    source: WeightSource, targets: dict[str, tuple[torch.Size, torch.dtype]], aliases: list[set[str]]
) -> dict[str, str]:
    """Map each module state-dict key in ``targets`` (key -> (global shape, dtype)) to a key of ``source``.

    Keys match exactly, or through one prefix found automatically (:mod:`._keys`). Each set in
    ``aliases`` is one tied parameter: present in the file under any member's key, every member maps
    to that key. Raises :class:`InitWeightsError` on any missing, unexpected or mis-shaped key; reads
    no tensor.
    """
    prefix, mapping = _match(source, targets, aliases)
    _log.info("init_weights=%r: matched %s", str(source.path), prefix.describe())
    return mapping


def _local_shape_and_offset(tensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Private torch API (torch.distributed.tensor._utils, checked on torch 2.13): the local shape and
    # global offset of this rank's shard, the same computation DCP uses to place shards on load.
    for placement in tensor.placements:
        # FSDP2's strided shard over a tensor-parallel split is still one slice (torch computes its offset);
        # a partial sum is not.
        if placement.is_partial():
            raise InitWeightsError(
                f"init_weights supports DTensors placed by Shard and Replicate only, got {tensor.placements}."
            )
    return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)


def local_index(tensor: torch.Tensor) -> Index | None:
    """The slice of the global tensor this rank holds: per dimension for a DTensor, ``None`` (all) otherwise."""
    if not isinstance(tensor, DTensor):
        return None
    shape, offset = _local_shape_and_offset(tensor)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def tied_names(module: torch.nn.Module, keys: dict[str, Any]) -> list[set[str]]:
    names: dict[int, set[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in keys:
            names.setdefault(id(param), set()).add(name)
    return [group for group in names.values() if len(group) > 1]


def _local_part(key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, Index | None]:
    """This rank's part of ``tensor`` and the slice of the global tensor it is, checked before any read."""
    local, index = tensor, None
    if isinstance(tensor, DTensor):
        local, index = tensor.to_local(), local_index(tensor)
        # FSDP2 pads uneven shards internally; the local tensor must still be exactly this slice.
        shape = tuple(s.stop - s.start for s in index or ())
        if shape != tuple(local.shape):
            raise InitWeightsError(
                f"init_weights: {key} is sharded as {tensor.placements}, so this rank should hold the slice"
                f" {index} of shape {shape}, but its local tensor has shape {tuple(local.shape)}; this"
                " sharding is not supported."
            )
    if local.is_meta:
        raise InitWeightsError(
            f"init_weights: {key} is on the meta device; load weights only after parameters are allocated."
        )
    return local, index


def load_full_weights(
    module: torch.nn.Module, path: str | Path, *, log_prefix: bool = True
) -> dict[str, Any]:
    """Copy full pretrained weights into ``module``'s (possibly sharded) parameters and buffers.

    Each rank reads only the slice it holds. Returns ``{"prefix", "prefix_on", "loaded", "bytes_read"}``:
    the key prefix found, the side that carries it (``"model"``, ``"file"`` or ``""``), the number of
    tensors loaded (a tied parameter once) and the bytes read from the source on this rank.
    """
    state = module.state_dict(keep_vars=True)  # the parameters themselves, so tied ones are one object
    targets = {key: (t.shape, t.dtype) for key, t in state.items() if isinstance(t, torch.Tensor)}
    with open_weights(path) as source:
        prefix, mapping = _match(source, targets, tied_names(module, targets))
        if log_prefix:
            # A prefix is worth seeing by default (WARNING shows without logging set up): it says which
            # part of the model the file was matched to.
            level = logging.WARNING if prefix.on else logging.INFO
            _log.log(level, "init_weights=%r: matched %s", str(source.path), prefix.describe())
        with torch.no_grad():
            first: dict[int, str] = {}  # a tied parameter is one object under several keys: load it once
            for key in targets:
                first.setdefault(id(state[key]), key)
            parts = {key: _local_part(key, state[key]) for key in first.values()}
            for key, (local, index) in parts.items():
                local.copy_(source.read(mapping[key], index))  # converts the file's dtype to the model's
        return {
            "prefix": prefix.text,
            "prefix_on": prefix.on,
            "loaded": len(parts),
            "bytes_read": source.bytes_read,
        }
