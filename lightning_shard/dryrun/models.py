"""Where a dry run's model comes from, built afresh on the meta device for every rank (``prepare`` cuts and
shards the module it is given in place).

A model is any of:

- an ``nn.Module`` (a LightningModule too), copied for each rank (build it on the meta device, e.g. under
  ``torch.device("meta")``, so the copies take no memory);
- a class or a function that returns a module, called under ``torch.device("meta")``;
- a Hugging Face config object (``transformers.PretrainedConfig``), built with
  ``AutoModelForCausalLM.from_config``;
- a string: a ``config.json`` file or a directory holding one, the name of a published config shipped in
  ``lightning_shard/dryrun/configs`` (:data:`PUBLISHED`: ``llama-3-8b``, ``llama-3-70b``, ``llama-3.1-405b``,
  ``qwen3-235b-a22b``, ``deepseek-v3``), or a class path (``lightning_shard.demos.GPT``) built as ``plan``
  builds one.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_shard.planner.model import build_on_meta

CONFIGS = Path(__file__).with_name("configs")
#: The published configs shipped with the package, by name.
PUBLISHED = tuple(sorted(p.stem for p in CONFIGS.glob("*.json")))

ModelSource = nn.Module | Callable[[], nn.Module] | str | Any


def build_model(source: str, argv: list[str] | None = None) -> nn.Module:
    """``--model``'s module on the meta device: a config (file, directory, published name) or a class path."""
    return model_factory(source, argv=argv)()


def _hf_config(source: str) -> Any | None:
    """A Hugging Face config read from a file, a directory or a published name; ``None`` if ``source`` is none."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        path = CONFIGS / f"{source}.json"
        if not path.is_file():
            return None
    from transformers import AutoConfig  # optional dependency: only Hugging Face configs need it

    data = json.loads(path.read_text())
    model_type = data.pop("model_type")
    data.pop("architectures", None)
    return AutoConfig.for_model(model_type, **data)


def _from_hf_config(config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM  # optional dependency: only Hugging Face configs need it

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def model_factory(
    model: ModelSource, init_args: dict[str, Any] | None = None, argv: list[str] | None = None
) -> Callable[[], nn.Module]:
    """A function building ``model`` afresh on the meta device (see the module's docstring); a class path takes
    its constructor arguments as ``init_args`` or as the command line's ``argv`` (``--model.n_layers 12``)."""
    if isinstance(model, nn.Module):
        return lambda: copy.deepcopy(model)
    if isinstance(model, str):
        config = _hf_config(model)
        if config is not None:
            return lambda: _from_hf_config(config)
        return lambda: build_on_meta(model, init_args, argv=argv)
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):  # a Hugging Face PretrainedConfig
        return lambda: _from_hf_config(model)
    if callable(model):

        def build() -> nn.Module:
            with torch.device("meta"):
                return model(**(init_args or {}))

        return build
    raise TypeError(
        f"dryrun(model={model!r}) is not a model: give an nn.Module, a class or function returning one, a Hugging"
        f" Face config, a config.json path, a published config name ({', '.join(PUBLISHED)}) or a class path."
    )
