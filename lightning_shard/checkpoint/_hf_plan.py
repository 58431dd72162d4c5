"""What :func:`~lightning_shard.checkpoint.export_hf` writes, decided before any tensor is read.

From the checkpoint's tensor names and shapes (:class:`._hf_sources.Source`) and the Hugging Face config:

1. the config: ``config=`` (a ``PretrainedConfig``, a ``config.json`` or a model directory), else the checkpoint's
   hyper-parameters when they hold one (a ``PretrainedConfig``, or a dict with ``model_type``);
2. the model the config builds, on the meta device (no memory): its ``state_dict`` keys are what
   ``from_pretrained`` expects; of parameters tied to each other (``lm_head.weight`` to the embedding) one
   name is kept, as ``save_pretrained`` keeps it (safetensors refuses tensors sharing storage);
3. the checkpoint key of each expected key: Lightning's keys carry the LightningModule attribute holding the
   model (``model.`` for ``self.model = AutoModelForCausalLM.from_config(cfg)``); ``prefix=`` names it, else
   the prefix under which most checkpoint keys are expected keys is taken. Activation-checkpoint wrappers'
   ``_checkpoint_wrapped_module.`` and ``torch.compile``'s ``_orig_mod.`` segments are dropped first;
4. the output files: tensors in the model's ``state_dict`` order, cut into files of at most
   ``max_shard_size`` bytes by ``huggingface_hub``'s own splitter, the one ``save_pretrained`` uses.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

import lightning_shard.checkpoint._errors as errors
from lightning_shard.checkpoint._hf_sources import Source, SourceKind, TensorInfo

HFDtype = Literal["fp32", "bf16", "fp16"]
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})
_INSTALL = "pip install 'lightning-shard[hf]'"


def require_transformers() -> Any:
    try:
        import transformers  # optional: transformers (the hf extra)
    except ImportError as err:
        raise ImportError(
            f"Exporting a Hugging Face model directory needs transformers and safetensors: {_INSTALL}"
        ) from err
    return transformers


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the output: its Hugging Face name, its checkpoint key, and how it is saved there."""

    name: str
    key: str
    saved: TensorInfo


@dataclass(frozen=True)
class ExportPlan:
    """Everything a worker needs (picklable): the checkpoint, and each output file's tensors in order."""

    checkpoint: str
    kind: SourceKind
    weights_only: bool | None
    dtype: torch.dtype | None
    prefix: str
    files: dict[str, list[OutTensor]]
    dropped: tuple[str, ...]

    def file_bytes(self, name: str) -> int:
        """Bytes of the checkpoint's tensors that output file ``name`` is made of (what reading it takes)."""
        return sum(t.saved.nbytes for t in self.files[name])


def resolve_config(config: Any, source: Source) -> Any:
    """The ``PretrainedConfig`` to export with (a copy: the export sets its dtype and architectures)."""
    transformers = require_transformers()
    if isinstance(config, transformers.PretrainedConfig):
        return copy.deepcopy(config)
    if config is not None:
        path = Path(os.fspath(config))
        if not path.exists():
            raise FileNotFoundError(
                f"config={str(path)!r} does not exist. Give a Hugging Face config.json, or the model directory"
                " holding it (--config PATH)."
            )
        return transformers.AutoConfig.from_pretrained(str(path))
    try:
        hparams = source.hyper_parameters()
    except Exception as err:  # noqa: BLE001  (refused by weights_only, or unreadable: the fix is the same)
        cause = refusal_cause(err) or errors.summary(err)
        raise ValueError(
            f"Could not read the hyper-parameters of {str(source.path)!r} to find the Hugging Face config ({cause})."
            " Pass the config: config=PretrainedConfig or path to config.json / model dir (CLI --config), or"
            " weights_only=False (CLI --trusted) for a checkpoint you trust."
        ) from err
    found = _config_in(hparams, transformers)
    if found is None:
        raise ValueError(
            f"No Hugging Face config found in the hyper-parameters of {str(source.path)!r} (neither a"
            " PretrainedConfig nor a dict with 'model_type'). Pass it: config= a PretrainedConfig, or the path"
            " to a config.json or model directory (CLI --config PATH)."
        )
    return found


def refusal_cause(err: BaseException) -> str | None:
    """The one line of torch's ``weights_only`` refusal that names the global ("WeightsUnpickler error: ..."):
    torch puts it after a paragraph of general advice."""
    lines = str(err).strip().splitlines()
    # torch names the global either as "WeightsUnpickler error: Unsupported global: ..." or, for a module it
    # blocks outright (os, subprocess, ...), as "Trying to load unsupported GLOBAL ...".
    markers = ("WeightsUnpickler error", "unsupported GLOBAL")
    return next((line.strip() for line in lines if any(m in line for m in markers)), None)


def _config_in(hparams: Any, transformers: Any) -> Any:
    """A config held by the hyper-parameters themselves or by one of their values, else None."""
    candidates = [hparams, *(hparams.values() if isinstance(hparams, dict) else [])]
    for value in candidates:
        if isinstance(value, transformers.PretrainedConfig):
            return copy.deepcopy(value)
        if isinstance(value, dict) and isinstance(value.get("model_type"), str):
            kwargs = dict(value)
            return transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    return None


def meta_model(config: Any, architecture: str | None) -> Any:
    """The model ``config`` describes, on the meta device: ``architecture`` (a transformers class name), else
    the config's ``architectures[0]``, else ``AutoModelForCausalLM``."""
    transformers = require_transformers()
    name = architecture or next(iter(getattr(config, "architectures", None) or []), "AutoModelForCausalLM")
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(
            f"architecture={name!r} is not a class of transformers {transformers.__version__}. Give the model"
            " class the checkpoint was trained as, e.g. --architecture LlamaForCausalLM or AutoModelForCausalLM."
        )
    with torch.device("meta"):
        model = cls.from_config(config) if name.startswith("Auto") else cls(config)
    config.architectures = [type(model).__name__]
    return model


def tied_duplicates(model: Any) -> set[str]:
    """Names of tensors the model shares with another name, all but the one ``save_pretrained`` keeps."""
    declared = set(getattr(model, "all_tied_weights_keys", None) or {})  # tied name -> its source name
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    dropped: set[str] = set()
    for names in groups.values():
        if len(names) > 1:
            keep = next((n for n in names if n not in declared), names[0])
            dropped.update(n for n in names if n != keep)
    return dropped


def _clean(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in _WRAPPER_SEGMENTS)


def detect_prefix(keys: list[str], expected: set[str]) -> str | None:
    """The prefix under which most ``keys`` are ``expected`` keys; the shortest on a tie; None if none is."""
    votes: Counter[str] = Counter()
    for key in keys:
        if key in expected:
            votes[""] += 1
        for i, char in enumerate(key):
            if char == "." and key[i + 1 :] in expected:
                votes[key[: i + 1]] += 1
    if not votes:
        return None
    return min(votes, key=lambda p: (-votes[p], len(p)))


def _few(names: Any, n: int = 5) -> str:
    names = sorted(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def map_keys(
    saved: dict[str, TensorInfo], model: Any, prefix: str | None
) -> tuple[dict[str, str], str, set[str]]:
    """(Hugging Face name -> checkpoint key for every tensor to write, the prefix, the tied names dropped)."""
    expected = list(model.state_dict().keys())
    dropped = tied_duplicates(model)
    cleaned: dict[str, str] = {}
    for key in saved:
        cleaned.setdefault(_clean(key), key)
    if prefix is None:
        prefix = detect_prefix(list(cleaned), set(expected))
        if prefix is None:
            raise ValueError(
                f"No checkpoint key matches a key of {type(model).__name__} under any prefix: the checkpoint holds"
                f" {_few(cleaned)}; the model expects {_few(expected)}. Check that the config is the trained"
                " model's (--config), or name the LightningModule attribute holding it with --prefix (e.g. 'model.')."
            )
    elif prefix and not prefix.endswith("."):
        prefix += "."
    chosen = {k[len(prefix) :]: original for k, original in cleaned.items() if k.startswith(prefix)}
    unexpected = chosen.keys() - set(expected)
    missing = set(expected) - dropped - chosen.keys()
    if unexpected or missing:
        problems = ([f"unexpected keys {_few(unexpected)}"] if unexpected else []) + (
            [f"missing keys {_few(missing)}"] if missing else []
        )
        raise ValueError(
            f"The checkpoint's keys under prefix={prefix!r} do not fit {type(model).__name__}: "
            f"{'; '.join(problems)}. Its keys: {_few(cleaned)}. Pass the LightningModule attribute holding the"
            " model as --prefix (prefix=, e.g. 'model.'; '' for none), or the trained model's config (--config)."
        )
    return {name: chosen[name] for name in expected if name not in dropped}, prefix, dropped & chosen.keys()


def split_files(
    names: dict[str, str], saved: dict[str, TensorInfo], dtype: torch.dtype | None, max_shard_size: int
) -> dict[str, list[str]]:
    """Output file -> Hugging Face names, cut as ``save_pretrained`` cuts them (``huggingface_hub``)."""
    from huggingface_hub import (
        split_state_dict_into_shards_factory,  # optional: huggingface_hub, with transformers
    )

    def out_bytes(info: TensorInfo) -> int:
        itemsize = (dtype if dtype is not None and info.dtype.is_floating_point else info.dtype).itemsize
        return info.nbytes // info.dtype.itemsize * itemsize

    split = split_state_dict_into_shards_factory(
        {name: saved[key] for name, key in names.items()},  # (the splitter skips str values: never names)
        get_storage_size=out_bytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    return dict(split.filename_to_tensors)
