"""``torch.save`` / ``torch.load`` for the pickles our checkpoints hold besides tensors (``meta.pt``, one-file
checkpoints), so that they load under ``weights_only=True``.

What Lightning puts there is plain containers, with one exception: the hyper-parameters, which hold whatever
the module's ``__init__`` was given. Three kinds of value are common and harmless, and torch's allowlist
refuses each of them:

* ``AttributeDict`` (Lightning's dict with attribute access): torch's restricted unpickler fills only plain
  dicts item by item, so it is written as a call ``AttributeDict({...})`` instead, by the pickler below;
* ``argparse.Namespace`` and ``pathlib`` paths, always allowed here;
* the user's own dataclasses and ``Enum`` classes (``MyModel(cfg: TrainConfig)``). These are allowed only when
  the class is already imported (nothing is ever imported by name from a file) and is *plain*: a dataclass
  that defines no ``__reduce__`` / ``__reduce_ex__`` / ``__setstate__`` of its own is rebuilt by setting its
  fields, an enum member is looked up by value, and neither runs code of the file's choosing.

Anything else stays refused with torch's error, which names the global (the caller adds the opt-in).
"""

from __future__ import annotations

import argparse
import contextlib
import copyreg
import dataclasses
import enum
import io
import os
import pathlib
import pickle
import sys
import types
from typing import IO, Any

import torch
from lightning.fabric.utilities.data import AttributeDict

from lightning_shard.checkpoint.storage import Remote

_ALWAYS: tuple[type, ...] = (
    AttributeDict,
    argparse.Namespace,
    pathlib.PosixPath,
    pathlib.WindowsPath,
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
)


def _reduce_attribute_dict(value: AttributeDict) -> tuple[Any, ...]:
    return AttributeDict, (dict(value),)


class _Pickler(pickle.Pickler):
    dispatch_table = {**copyreg.dispatch_table, AttributeDict: _reduce_attribute_dict}


#: What ``torch.save(pickle_module=...)`` needs of a pickle module: its ``Pickler``, here the one above.
_PICKLE_MODULE = types.ModuleType("lightning_shard_pickle")
_PICKLE_MODULE.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
_PICKLE_MODULE.Pickler = _Pickler  # type: ignore[attr-defined]


def save(obj: Any, f: str | os.PathLike | IO[bytes] | Remote) -> None:
    """``torch.save``, with ``AttributeDict`` written so that ``weights_only`` loading can rebuild it."""
    if isinstance(f, Remote):
        with f.open("wb") as stream:
            torch.save(obj, stream, pickle_module=_PICKLE_MODULE)
        return
    torch.save(obj, f, pickle_module=_PICKLE_MODULE)


def load(
    f: str | os.PathLike | IO[bytes] | Remote,
    weights_only: bool | None,
    map_location: Any = "cpu",
    mmap: bool = False,
) -> Any:
    """``torch.load(f, weights_only=...)``; unless ``weights_only is False``, the hyper-parameter classes the
    file names that are harmless (see the module docstring) are allowed for this one load."""
    if isinstance(f, Remote):
        with f.open("rb") as stream:
            f = io.BytesIO(stream.read())
        mmap = False  # the bytes are in memory already
    kwargs: dict[str, Any] = {"map_location": map_location, "weights_only": weights_only}
    if mmap:
        kwargs["mmap"] = True
    with allowing(f, weights_only):
        return torch.load(f, **kwargs)


def allowing(
    f: str | os.PathLike | IO[bytes], weights_only: bool | None
) -> contextlib.AbstractContextManager[Any]:
    """Allow, for the loads inside, the harmless hyper-parameter classes ``f`` names (nothing to do when
    ``weights_only is False``)."""
    if weights_only is False:
        return contextlib.nullcontext()
    return torch.serialization.safe_globals([*_ALWAYS, *allowed_classes(f)])


def allowed_classes(f: str | os.PathLike | IO[bytes]) -> list[type]:
    """The plain dataclasses and enums, already imported, among the globals ``f``'s pickle names."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception:  # noqa: BLE001  (not a zip checkpoint: torch.load says why, in its own words)
        return []
    finally:
        if isinstance(f, io.IOBase):
            f.seek(0)
    found = (_imported(name) for name in names)
    return [cls for cls in found if cls is not None and _is_plain(cls)]


def allowed_names(f: str | os.PathLike | IO[bytes]) -> set[str]:
    """:func:`allowed_classes` and the classes always allowed, as the qualified names pickles use."""
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in (*_ALWAYS, *allowed_classes(f))}


def _imported(qualified: str) -> type | None:
    module_name, _, name = qualified.rpartition(".")
    module = sys.modules.get(module_name)
    value = getattr(module, name, None) if module is not None else None
    return value if isinstance(value, type) else None


def _is_plain(cls: type) -> bool:
    if issubclass(cls, enum.Enum):
        return True
    if not dataclasses.is_dataclass(cls):
        return False
    own = ("__reduce__", "__reduce_ex__", "__setstate__")
    return not any(name in klass.__dict__ for klass in cls.__mro__[:-1] for name in own)
