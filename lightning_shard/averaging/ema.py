"""EMA: an exponential moving average of the weights that each rank keeps for the part it holds.

After an update, for every weight ``w`` a rank steps (a whole parameter, an FSDP2 shard, a ZeRO partition):

    ema_1 = w_1                                   (the first update copies)
    ema_k = decay * ema_{k-1} + (1 - decay) * w_k  (``torch.lerp(ema, w, 1 - decay)``, torch's ``get_ema_multi_avg_fn``)

The average is fp32 whatever the weights' dtype, lives beside them (same device, same sharding) as one more
entry of the optimizer's per-parameter state (:mod:`._layouts`), and so is saved and resumed wherever the
optimizer's state is: per rank in a sharded checkpoint. Floating-point buffers (``use_buffers``) are whole
on every rank; their averages ride in this callback's own state.

When and what, as Lightning's ``EMAWeightAveraging``: updated after optimizer steps chosen by
:meth:`EMA.should_update`; swapped into the model for validation during ``fit`` and swapped back for
training; copied into the model when training ends, so what follows ``fit`` (``test``, ``predict``, a saved
checkpoint) uses the averaged weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.fsdp import FSDPModule
from torch.optim.swa_utils import get_ema_multi_avg_fn
from typing_extensions import override

from lightning_shard._dtensor import local
from lightning_shard.averaging._hooks import AverageHooks
from lightning_shard.averaging._layouts import KEY, Layout, layout_of
from lightning_shard.checkpoint import read_metadata


class EMA(L.Callback):
    """Exponential moving average of the weights, at every ZeRO stage of either engine, and without one.

    Args:
        decay: weight of the old average at each update, in ``[0, 1]``.
        update_every_n_steps: update after every N-th optimizer step (0: never after steps).
        update_starting_at_step: first optimizer step (zero-based) to update after; ``None``: from the first.
        update_starting_at_epoch: also update at the end of every epoch from this one on; ``None``: never.
        use_buffers: average floating-point buffers too (otherwise the model's are used as they are).

    Override :meth:`should_update` for another schedule, as with Lightning's ``WeightAveraging``.
    """

    def __init__(
        self,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        use_buffers: bool = True,
    ) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA(decay={decay}) must be between 0 and 1; 0.999 is usual.")
        if update_every_n_steps < 0:
            raise ValueError(
                f"EMA(update_every_n_steps={update_every_n_steps}) must be 0 (no updates after steps) or more."
            )
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch
        self.use_buffers = use_buffers
        self.n_averaged = 0
        self._latest_update_step = 0
        self._latest_update_epoch = -1
        self._buffers: dict[str, torch.Tensor] = {}
        self._layouts: list[Layout] = []
        self._hooks: list[AverageHooks] = []
        self._backup: dict[Any, torch.Tensor] = {}
        self._swapped = False
        self._trainer: L.Trainer | None = None
        self._resumed_averages: dict[str, bool] = {}

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(decay=self.decay)

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether to update after the optimizer step ``step_idx`` or at the end of epoch ``epoch_idx``
        (both zero-based, one of them given); ``EMAWeightAveraging``'s rule."""
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        if epoch_idx is not None:
            return self.update_starting_at_epoch is not None and epoch_idx >= self.update_starting_at_epoch
        return False

    # --- where the averages live ------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Before a resumed checkpoint is loaded: the hooks carry the averages in and out of it.
        self._release()
        self._trainer = trainer
        optimizers = [getattr(opt, "_optimizer", opt) for opt in trainer.strategy.optimizers]
        self._layouts = [layout_of(opt) for opt in optimizers]
        self._hooks = [AverageHooks(layout.stateful, self._resuming_averages) for layout in self._layouts]

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    def _release(self) -> None:
        for hooks in self._hooks:
            hooks.remove()
        self._hooks, self._layouts, self._trainer = [], [], None

    def _resuming_averages(self) -> bool:
        """Whether the sharded checkpoint being resumed holds averages (see :mod:`._hooks`)."""
        path = None if self._trainer is None else self._trainer.ckpt_path
        if path is None or not (Path(path) / ".metadata").is_file():
            return False
        if str(path) not in self._resumed_averages:
            keys = read_metadata(path).state_dict_metadata
            self._resumed_averages[str(path)] = any(k.endswith("." + KEY) for k in keys)
        return self._resumed_averages[str(path)]

    # --- updates ---------------------------------------------------------------------------------

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer steps taken; step_idx is the zero-based index of the last one.
        if trainer.global_step > self._latest_update_step and self.should_update(
            step_idx=trainer.global_step - 1
        ):
            self.update(pl_module)
            self._latest_update_step = trainer.global_step

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(
            epoch_idx=trainer.current_epoch
        ):
            self.update(pl_module)
            self._latest_update_epoch = trainer.current_epoch

    @torch.no_grad()
    def update(self, pl_module: L.LightningModule) -> None:
        """Average the weights each rank holds now into its averages (no communication)."""
        pairs = [(layout.stateful.state[t], t) for layout in self._layouts for t in layout.truths()]
        restart = self.n_averaged == 0
        if not restart and any(KEY not in state for state, _ in pairs):
            rank_zero_warn(
                f"EMA: the resumed checkpoint holds no averages of the weights although {self.n_averaged} updates"
                " were counted when it was saved; the average starts again from the current weights."
            )
            restart = True
        averages, currents = [], []
        for state, t in pairs:
            if restart:
                state[KEY] = t.detach().to(torch.float32, copy=True)
            else:
                averages.append(local(state[KEY]))
                currents.append(local(t.detach()).float())
        for name, buffer in self._float_buffers(pl_module):
            if restart or name not in self._buffers:
                self._buffers[name] = buffer.detach().to(torch.float32, copy=True)
            else:
                self._buffers[name] = self._buffers[name].to(buffer.device)
                averages.append(self._buffers[name])
                currents.append(buffer.detach().float())
        if averages:
            get_ema_multi_avg_fn(self.decay)(averages, currents, None)
        self.n_averaged = 1 if restart else self.n_averaged + 1

    def _float_buffers(self, pl_module: L.LightningModule) -> list[tuple[str, torch.Tensor]]:
        if not self.use_buffers:
            return []
        return [(name, b) for name, b in pl_module.named_buffers() if b.is_floating_point()]

    # --- the averages in the model ----------------------------------------------------------------

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self._layouts and self.n_averaged > 0:
            self._exchange(pl_module, into_model=True)
            self._swapped = True

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._swapped:
            self._exchange(pl_module, into_model=False)
            self._swapped = False

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._layouts and self.n_averaged > 0:
            self._write(pl_module, lambda weight, average, key: weight.copy_(average))

    @torch.no_grad()
    def _exchange(self, pl_module: L.LightningModule, into_model: bool) -> None:
        """Swap weights and averages. fp32 weights trade places with their averages exactly; others are
        kept aside while the averages are in (a bf16 copy would round the average)."""

        def swap(weight: torch.Tensor, average: torch.Tensor, key: Any) -> None:
            if weight.dtype != average.dtype:
                if into_model:
                    self._backup[key] = weight.clone()
                    weight.copy_(average)
                else:
                    weight.copy_(self._backup.pop(key))
                return
            held = weight.clone()
            weight.copy_(average)
            average.copy_(held)

        self._write(pl_module, swap)

    def _write(self, pl_module: L.LightningModule, write: Any) -> None:
        """``write(weight, average, key)`` for every weight this rank holds, the model kept consistent."""
        _reshard(pl_module)
        for layout in self._layouts:
            layout.before_write()
            for t in layout.truths():
                write(local(t.detach()), local(layout.stateful.state[t][KEY]), id(t))
            layout.after_write()
        for name, buffer in self._float_buffers(pl_module):
            if name in self._buffers:
                self._buffers[name] = self._buffers[name].to(buffer.device)
                write(buffer.detach(), self._buffers[name], ("buffer", name))

    # --- checkpoint ------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        # Saved from rank 0 only: scalars, and buffer averages (whole and equal on every rank).
        return {
            "n_averaged": self.n_averaged,
            "latest_update_step": self._latest_update_step,
            "latest_update_epoch": self._latest_update_epoch,
            "buffers": {name: t.detach().cpu() for name, t in self._buffers.items()},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n_averaged = state_dict["n_averaged"]
        self._latest_update_step = state_dict["latest_update_step"]
        self._latest_update_epoch = state_dict["latest_update_epoch"]
        self._buffers = dict(state_dict["buffers"])


def _reshard(module: torch.nn.Module) -> None:
    """FSDP2 keeps parameters gathered after an evaluation forward at stage 2: drop those copies, so the
    next forward gathers the shards as now written."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
