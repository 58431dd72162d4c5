"""``ShardFabricStrategy(fault_tolerance=...)``: replica groups in a Fabric loop, the loop unchanged.

- The loop calls :meth:`~lightning_shard.ShardFabricStrategy.join_replica_groups` once, after ``fabric.setup``
  (and ``fabric.load`` when resuming) and before it starts, with its state (the dict it passes to
  ``fabric.save``). That joins the first quorum: a restarted group returns from it holding the live groups'
  model and optimizer shards, random generators and the state's other entries (a step counter, LR schedulers,
  anything with ``state_dict``, restored as ``fabric.load`` restores them), so the loop goes on from the live
  groups' step.
- Every later quorum is joined before the first training forward of a step (a forward pre-hook on the set-up
  model, in training mode with gradients on; ``fabric.backward`` joins too if no forward passed the hook).
- The backward's gradients are averaged over the groups taking part (as under the Trainer).
- Each ``optimizer.step()`` runs only if the step commits on every participating group, else the step's
  gradients are dropped; every optimizer of a step follows the one decision.
- ``fabric.save`` writes in the lowest live group only.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_shard.core.replica_groups import join_replica_groups as join_groups
from lightning_shard.fabric._checkpoint import is_optimizer, restore_entries
from lightning_shard.fault_tolerance._rng import rng_state, set_rng_state
from lightning_shard.fault_tolerance.replicas import ReplicaGroups


class FabricReplicas:
    """The replica group of a Fabric loop's set-up model and optimizers."""

    def __init__(self, strategy: Any, optimizers: list[Optimizer]) -> None:
        session = strategy._running()
        model = session.model
        self.replicas: ReplicaGroups = join_groups(strategy, session, optimizers)
        self.replicas.extra_state, self.replicas.load_extra = self._extra, self._load_extra
        self._state: dict[str, Any] | None = None  # the loop's, once it joined
        self._keys: list[str] = []  # its entries a peer sends (read at each heal: the loop rebinds them)
        # Before FSDP2's own pre-forward (which gathers the parameters): a heal, or a peer's state read while
        # this group waits on the quorum, reads the model's state dict, which puts the shards back.
        self._hook = model.register_forward_pre_hook(self._before_forward, prepend=True)

    def join(self, state: dict[str, Any]) -> None:
        """Join the first quorum with the loop's ``state``: its entries other than modules and optimizers
        (healed as shards) go to a restarted group, each restored as ``fabric.load`` restores it
        (``load_state_dict``, or the value put back into ``state``)."""
        if not isinstance(state, dict):
            raise TypeError(
                "ShardFabricStrategy.join_replica_groups(state) takes the loop's state dict (got"
                f" {type(state).__name__}), as fabric.save does: {{'model': model, 'optimizer': optimizer,"
                " 'step': 0, ...}."
            )
        self._state = state
        self._keys = [
            k for k, obj in state.items() if not isinstance(obj, nn.Module) and not is_optimizer(obj)
        ]
        self.replicas.ensure_quorum()

    def ensure_quorum(self) -> None:
        if self._state is None:
            raise RuntimeError(
                "ShardFabricStrategy(fault_tolerance=...): call fabric.strategy.join_replica_groups(state) after"
                " fabric.setup (and fabric.load, when resuming) and before the loop, with the loop's state"
                " ({'model': model, 'optimizer': optimizer, 'step': step, ...}): a restarted group returns from"
                " it holding the live groups' state, and the loop goes on from state['step']."
            )
        self.replicas.ensure_quorum()

    def _entries(self) -> dict[str, Any]:
        assert self._state is not None
        return {key: self._state[key] for key in self._keys}

    def _extra(self) -> dict[str, Any]:
        entries = self._entries()
        sent = {key: obj.state_dict() if isinstance(obj, _Stateful) else obj for key, obj in entries.items()}
        return {"rng": rng_state(), "entries": sent}

    def _load_extra(self, state: dict[str, Any]) -> None:
        assert self._state is not None
        set_rng_state(state["rng"])
        restore_entries(self._state, self._entries(), dict(state["entries"]), strict=True)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.ensure_quorum()

    def detach(self) -> None:
        self._hook.remove()


def join(
    strategy: Any, previous: FabricReplicas | None, optimizers: list[Optimizer]
) -> FabricReplicas | None:
    """The replica group of the strategy's set-up model and ``optimizers`` (None without fault tolerance)."""
    if strategy.config.fault_tolerance is None:
        return None
    if previous is not None:
        previous.detach()
    return FabricReplicas(strategy, optimizers)


def join_replica_groups(replicas: FabricReplicas | None, state: dict[str, Any]) -> None:
    if replicas is None:
        raise RuntimeError(
            "ShardFabricStrategy.join_replica_groups needs fault_tolerance=... and a set-up model and optimizer:"
            " call it after fabric.setup(model, optimizer)."
        )
    replicas.join(state)


def before_backward(replicas: FabricReplicas | None) -> None:
    """The step's quorum, joined here if no forward of the set-up model joined it."""
    if replicas is not None:
        replicas.ensure_quorum()
