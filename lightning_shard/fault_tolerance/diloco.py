"""The outer step of semi-synchronous training between replica groups (``fault_tolerance["semi_sync"]``).

DiLoCo (Douillard et al., arXiv 2311.08105), per fragment ``f`` of the model's trainable parameters, after the
optimizer steps ``s`` where ``s % H == f * H // k`` (``H = sync_every``, ``k = fragments``)::

    delta_g   = theta_last_sync - theta_g            # each group g's pseudo-gradient (this rank's shards)
    delta     = mean over the participating groups of delta_g
    theta*    = OuterSGD(theta_last_sync, grad=delta)   # lr 0.7, momentum 0.9, Nesterov by default
    theta_g   = alpha * theta_g + (1 - alpha) * theta*  # alpha = fragment_update_alpha (0: theta*)
    theta_last_sync = theta*

Local SGD replaces the outer step by ``theta* = mean over the groups of theta_g``. Each group keeps its own
model between syncs; inside a group the engine's own reduction (DDP, FSDP2) is untouched. Rank ``r`` of every
group holds the same shards, so each rank averages its own shards over the torchft Manager's group, as the
every-step gradient mean does (:mod:`._across`).

A sync whose commit fails (a group died during it) changes nothing: every group keeps its local weights and
the last-sync copy, and the next sync of the fragment averages the change since then (2H steps' worth).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import SGD

from lightning_shard._dtensor import laid_out_as
from lightning_shard._dtensor import local as _local
from lightning_shard.fault_tolerance._across import chunked
from lightning_shard.fault_tolerance.semi_sync import SemiSync


class OuterSync:
    """One replica group's rank of a semi-synchronous run: the last-sync copy of its shards, the outer optimizers
    (one per fragment), the position in the H-step cycle, and the sync itself."""

    def __init__(self, semi: SemiSync, manager: Any, module: nn.Module) -> None:
        self.semi, self.manager = semi, manager
        self.params = [p for p in module.parameters() if p.requires_grad]
        n, k = len(self.params), semi.fragments
        if k > n:
            raise ValueError(
                f"ShardStrategy(fault_tolerance=...): fragments={k} is more than the model's {n} trainable"
                f" parameters (each fragment holds whole parameters). Use fragments <= {n}."
            )
        #: Fragment i: parameters [i * n // k, (i + 1) * n // k) in module order.
        self.fragments = [list(range(i * n // k, (i + 1) * n // k)) for i in range(k)]
        self.backup: list[torch.Tensor] = []
        self.outer: list[SGD] = []
        self.steps = 0  # optimizer steps taken this fit (the cycle's position: steps % sync_every)
        self.outer_steps = 0  # syncs committed
        self.bytes = 0  # bytes this rank sent to the other groups
        self.synced_at: list[int] = []  # the step of every sync tried
        #: Whether the quorum being joined serves the next step's sync (a group healing from it syncs too).
        self.sync_next = False

    # --- the last-sync copy --------------------------------------------------------------------------

    def snapshot(self) -> None:
        """The model's current weights taken as the last sync's (a fit's start, unless restored)."""
        with torch.no_grad():
            self._build([_local(p).detach().clone() for p in self.params])

    def _build(self, backup: list[torch.Tensor]) -> None:
        self.backup = backup
        outer = self.semi.outer
        if outer is None:
            self.outer = []
            return
        self.outer = [
            SGD([backup[j] for j in fragment], lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
            for fragment in self.fragments
        ]

    # --- the sync ------------------------------------------------------------------------------------

    def after_step(self) -> int | None:
        """Count an optimizer step; the fragment due for a sync after it, if any."""
        self.steps += 1
        return self.semi.due(self.steps)

    def due_next(self) -> bool:
        return self.semi.due(self.steps + 1) is not None

    def sync(self, fragment: int) -> bool:
        """Average fragment ``fragment`` over the groups of the joined quorum and step it (only if the sync
        commits on every participant); whether it committed."""
        self.synced_at.append(self.steps)
        index = self.fragments[fragment]
        with torch.no_grad():
            if self.semi.outer is not None:  # the pseudo-gradient
                sent = [self.backup[j] - _local(self.params[j]) for j in index]
            else:
                sent = [_local(self.params[j]).detach().clone() for j in index]
            self._mean_across(sent)
        if not self.manager.should_commit():
            return False
        with torch.no_grad():
            if self.semi.outer is not None:
                for j, mean in zip(index, sent, strict=True):
                    self.backup[j].grad = mean
                self.outer[fragment].step()
                self.outer[fragment].zero_grad(set_to_none=True)
            else:
                for j, mean in zip(index, sent, strict=True):
                    self.backup[j].copy_(mean)
            alpha = self.semi.fragment_update_alpha
            for j in index:
                weights = _local(self.params[j])
                if alpha == 0.0:
                    weights.copy_(self.backup[j])
                else:
                    weights.lerp_(self.backup[j], 1.0 - alpha)
        self.outer_steps += 1
        return True

    def _mean_across(self, tensors: list[torch.Tensor]) -> None:
        """Each of ``tensors`` replaced by its mean over the participating groups, in flat chunks of at most
        25 MB per dtype and device (a few large all-reduces)."""
        chunks = chunked(tensors)
        pending = []
        for chunk in chunks:
            flat = torch.cat([tensors[i].reshape(-1) for i in chunk])  # [sum of the chunk's numels]
            self.bytes += flat.numel() * flat.element_size()
            pending.append((chunk, flat, self.manager.allreduce(flat)))
        for chunk, flat, work in pending:
            work.wait()
            offset = 0
            for i in chunk:
                tensors[i].copy_(flat[offset : offset + tensors[i].numel()].view_as(tensors[i]))
                offset += tensors[i].numel()

    # --- state: a healing peer's (this rank's shards) and a checkpoint's (whole tensors) ---------------

    def state(self) -> dict[str, Any]:
        """What a healing group's rank ``r`` needs of this group's rank ``r`` (its own shards)."""
        return {
            "steps": self.steps,
            "outer_steps": self.outer_steps,
            "sync_next": self.sync_next,
            "backup": list(self.backup),
            "outer": [optimizer.state_dict() for optimizer in self.outer],
        }

    def load(self, state: dict[str, Any]) -> None:
        device = self.params[0].device if self.params else torch.device("cpu")
        self._build([t.to(device).clone() for t in state["backup"]])
        self._load_counts(state)
        for optimizer, saved in zip(self.outer, state["outer"], strict=True):
            optimizer.load_state_dict(saved)

    def _load_counts(self, state: dict[str, Any]) -> None:
        self.steps, self.outer_steps = int(state["steps"]), int(state["outer_steps"])
        self.sync_next = bool(state.get("sync_next", False))

    def checkpoint_state(self) -> dict[str, Any]:
        """:meth:`state` with whole tensors where the parameters are sharded (a collective inside the group:
        every rank of the group calls it), so any rank layout resumes from it."""
        whole = [self._whole(b, j) for j, b in enumerate(self.backup)]
        outer = []
        for fragment, optimizer in zip(self.fragments, self.outer, strict=True):
            saved = optimizer.state_dict()
            saved["state"] = {
                i: {
                    k: self._whole(v, fragment[i]) if torch.is_tensor(v) and v.dim() else v
                    for k, v in s.items()
                }
                for i, s in saved["state"].items()
            }
            outer.append(saved)
        return {"steps": self.steps, "outer_steps": self.outer_steps, "backup": whole, "outer": outer}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self._build([self._shard(t, j) for j, t in enumerate(state["backup"])])
        self._load_counts(state)
        for fragment, optimizer, saved in zip(self.fragments, self.outer, state["outer"], strict=True):
            saved = dict(saved)
            saved["state"] = {
                int(i): {
                    k: self._shard(v, fragment[int(i)]) if torch.is_tensor(v) and v.dim() else v
                    for k, v in s.items()
                }
                for i, s in saved["state"].items()
            }
            optimizer.load_state_dict(saved)

    def _whole(self, shard: torch.Tensor, j: int) -> torch.Tensor:
        p = self.params[j]
        whole = laid_out_as(shard, p).full_tensor() if isinstance(p, DTensor) else shard
        return whole.detach().cpu().clone()

    def _shard(self, whole: torch.Tensor, j: int) -> torch.Tensor:
        p = self.params[j]
        whole = whole.to(device=p.device, dtype=p.dtype)
        if isinstance(p, DTensor):  # this rank's part, cut locally (every rank read the whole tensor)
            return (
                distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local().clone()
            )
        return whole.clone()

    def metrics(self) -> dict[str, float]:
        return {"ft/outer_steps": float(self.outer_steps), "ft/cross_group_bytes": float(self.bytes)}
