"""What the monitors share: one all_gather of a few numbers per rank, and batch-count checks.

Callbacks reach the other ranks only through ``trainer.strategy.all_gather`` (Lightning's own
contract), so they work under DDP, FSDP2, DeepSpeed or any other strategy and never import an engine.
A Lightning Fabric has the same ``strategy``, ``world_size`` and ``loggers``, so a Fabric loop drives the
same callbacks through ``fabric.call(hook, trainer=fabric, pl_module=model, ...)`` (docs/fabric.md); what
only a Trainer has (the global step, its precision string) is read here with the Fabric's equivalent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Runner = Any  # an L.Trainer, or an L.Fabric driving the callback from its own loop


def gather_rows(trainer: Runner, values: Sequence[float]) -> torch.Tensor:
    """All ranks' ``values`` as a (world_size, len(values)) CPU float64 tensor, from one all_gather."""
    device = trainer.strategy.root_device
    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    local = torch.tensor([float(v) for v in values], dtype=dtype, device=device)
    if trainer.world_size == 1:
        return local.view(1, -1).double().cpu()
    return trainer.strategy.all_gather(local).reshape(-1, len(values)).double().cpu()


def logged_step(trainer: Runner, batches: int) -> int:
    """The step metrics are logged at: the Trainer's global step; a Fabric has none, so the batches seen."""
    step = getattr(trainer, "global_step", None)
    return batches if step is None else int(step)


def precision_name(trainer: Runner) -> str:
    """The run's precision string ("bf16-mixed", ...) from the Trainer's or the Fabric's precision plugin."""
    strategy = trainer.strategy
    plugin = getattr(strategy, "precision_plugin", None) or getattr(strategy, "precision", None)
    return str(getattr(plugin, "precision", "32-true"))


def ranks_per_batch(trainer: Runner) -> int:
    """How many ranks read each batch: 1 under plain data parallelism; the ranks of a tensor-parallel group
    and the stages of a pipeline share theirs (world size over the sampler's replicas, as the strategy
    reports them to Lightning's sampler)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    replicas = int(kwargs.get("num_replicas", trainer.world_size) or trainer.world_size)
    return max(1, trainer.world_size // max(1, replicas))


def check_count(owner: str, flag: str, value: Any, example: int) -> None:
    """Raise unless ``value`` is an int >= 1 (bool is not a count), naming ``owner(flag=value)`` and a fix."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{owner}({flag}={value!r}) must be an int >= 1 (a number of training batches)."
            f" Use e.g. {flag}={example}."
        )
