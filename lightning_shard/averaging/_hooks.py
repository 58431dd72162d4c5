"""Optimizer hooks that let an average ride in optimizer state without changing what the optimizer does.

* Step: the average is hidden while the optimizer steps. Adam and most others initialise a
  parameter's state when they find it empty (``len(state) == 0``); a step skipped before the first
  real one (a loss scaler's overflow) would otherwise leave a state holding only the average, and the
  next step would fail looking for its moments.
* Load: ``Optimizer.load_state_dict`` casts every state entry to its parameter's dtype; the average
  is put back in fp32 (it matters for bf16 parameters, ``precision="bf16-true"``).
* State dict (``placeholders``): torch's ``get_optimizer_state_dict`` builds the load target of a
  sharded checkpoint from the optimizer's live state. Before the first average exists there is no
  entry to load into, so empty fp32 entries are added while ``placeholders()`` says the checkpoint
  being resumed holds averages.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_shard.averaging._layouts import KEY


class AverageHooks:
    """The hooks on one optimizer; :meth:`remove` takes them all off."""

    def __init__(self, optimizer: Optimizer, placeholders: Callable[[], bool]) -> None:
        self.optimizer = optimizer
        self._placeholders = placeholders
        self._hidden: dict[Any, torch.Tensor] = {}
        self._loaded: dict[Any, torch.Tensor] = {}
        self._handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._hide),
            optimizer.register_step_post_hook(self._unhide),
            optimizer.register_load_state_dict_pre_hook(self._take_averages),
            optimizer.register_load_state_dict_post_hook(self._put_averages),
            optimizer.register_state_dict_post_hook(self._add_placeholders),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --- step ------------------------------------------------------------------------------------

    def _hide(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._hidden = {p: state.pop(KEY) for p, state in optimizer.state.items() if KEY in state}

    def _unhide(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        for p, average in self._hidden.items():
            optimizer.state[p][KEY] = average
        self._hidden = {}

    # --- load ------------------------------------------------------------------------------------

    def _take_averages(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        live = chain.from_iterable(group["params"] for group in optimizer.param_groups)
        by_id = dict(zip(saved_ids, live, strict=False))
        state: dict[Any, Any] = {}
        self._loaded = {}
        for key, entry in state_dict["state"].items():
            if isinstance(entry, dict) and KEY in entry and key in by_id:
                self._loaded[by_id[key]] = entry[KEY]
                entry = {k: v for k, v in entry.items() if k != KEY}
            state[key] = entry
        return {**state_dict, "state": state}

    def _put_averages(self, optimizer: Optimizer) -> None:
        for p, average in self._loaded.items():
            optimizer.state[p][KEY] = average.to(device=p.device, dtype=torch.float32)
        self._loaded = {}

    # --- state dict ------------------------------------------------------------------------------

    def _add_placeholders(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        params = list(chain.from_iterable(group["params"] for group in optimizer.param_groups))
        if all(KEY in optimizer.state.get(p, {}) for p in params) or not self._placeholders():
            return state_dict
        ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        state = dict(state_dict["state"])
        for key, p in zip(ids, params, strict=False):
            if p.requires_grad and KEY not in state.get(key, {}):
                # A new dict: the packed state holds the optimizer's own per-parameter dicts.
                state[key] = {**state.get(key, {}), KEY: torch.zeros_like(p, dtype=torch.float32)}
        return {**state_dict, "state": state}
