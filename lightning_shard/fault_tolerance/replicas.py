"""One replica group's side of a fault-tolerant run: torchft's Manager, the cross-group gradient average, the
commit gate, and the state a restarted group heals from.

Inside the group the model is sharded as the stage says (FSDP2 over the group's ranks). Once FSDP2's
reduce-scatters have averaged each gradient shard over the group (its all-reduce hook, where HSDP's replicate
all-reduce would run, marks the backward), the shards are averaged over the groups taking part in the step at
the backward's end, a few large all-reduces through the Manager's reconfigurable gloo group (rank ``r`` of
every group holds the same shards): :mod:`._across`, which does the same for DDP's buckets. The optimizer
steps only if ``should_commit`` says every participant succeeded, else the gradients are dropped and the step
is discarded on every group.

The next step's quorum is asked for as soon as a step's commit is decided, in a thread of its own, so the
Lighthouse's round trip runs beside the optimizer step, the loop's work between steps and the data loading; the
step waits for it before its first forward (:meth:`ReplicaGroups.settle`). Until then nothing a peer might need
is read: a healing peer's state (and a heal of this group's own) waits for that point, where the weights are
the committed step's and no forward holds gathered shards, exactly where a synchronous quorum would read them.

A group that joins a running job heals from a live peer at its first quorum: model and optimizer state (this
rank's shards, as rank ``r`` of the peer holds them) and whatever ``extra_state`` gives (the Trainer's loops,
callbacks, schedulers, RNG), sent by torchft's HTTP transport and read back with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_shard._dtensor import laid_out_as
from lightning_shard.fault_tolerance import FaultTolerance, check_reachable
from lightning_shard.fault_tolerance._across import AcrossGroups
from lightning_shard.fault_tolerance.diloco import OuterSync

log = logging.getLogger(__name__)
_KEY = "lightning_shard"


def _local(value: Any) -> Any:
    """``value`` with every DTensor replaced by this rank's local tensor (containers rebuilt)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def _safe_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, its payload read with ``weights_only=True``."""
    from torchft.checkpointing import _serialization  # optional: torchft
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):  # type: ignore[misc]
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _serialization._streaming_load(f, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


class OwnState(Protocol):
    """An optimizer whose state this rank keeps in a layout of its own: read and restored by the engine."""

    def holds(self, optimizer: Optimizer) -> bool: ...
    def state(self, optimizer: Optimizer) -> dict[str, Any]: ...
    def load(self, optimizer: Optimizer, state: dict[str, Any]) -> None: ...


class ReplicaGroups:
    """This process's member of replica group ``ft.replica_id`` (rank ``group_rank`` of ``group_size``), for
    every fit of the process (its Manager lives until :meth:`shutdown`, as the process groups do)."""

    def __init__(self, ft: FaultTolerance, group_rank: int, group_size: int) -> None:
        from torchft import Manager, ProcessGroupGloo  # optional: torchft

        check_reachable(ft)
        self.ft = ft
        timeout = timedelta(seconds=ft.timeout)
        self.pg = ProcessGroupGloo(timeout=timeout)
        #: What else a peer sends a healing group (the Trainer's state), and how it is applied: set per fit.
        self.extra_state: Callable[[], dict[str, Any]] = dict
        self.load_extra: Callable[[dict[str, Any]], None] = lambda state: None
        self.model: nn.Module | None = None
        self.optimizers: list[Optimizer] = []
        self.own_state: OwnState | None = None
        #: ``semi_sync``: the outer step, the last-sync copy and the cycle's position (set per fit).
        self.outer: OuterSync | None = None
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=ft.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_size,
            replica_id=f"replica_{ft.replica_id}",
            lighthouse_addr=ft.lighthouse,
            store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            store_port=int(os.environ["MASTER_PORT"]),
            checkpoint_transport=_safe_transport(timeout),
        )
        self.manager.register_state_dict_fn(_KEY, self._load, self._state)
        self._quorum_ready = False  # a quorum was joined and no step has used it yet
        self._commits: bool | None = None  # the last quorum's commit decision, once asked
        #: The next step's quorum, asked for in a thread once a step's commit is decided (None: none pending),
        #: what it raised, and whether the loop is where a peer's state may be read (set, unless one is pending).
        self._next: threading.Thread | None = None
        self._next_error: BaseException | None = None
        self._safe = threading.Event()
        self._safe.set()
        self._writes = False  # whether this group is the lowest of the quorum its last step used
        #: Whether this group takes no step after the one being committed (its loop ends there: a preemption
        #: every rank agreed on, the last of max_steps): no quorum is asked for after it, so none counts it.
        self.leaving: Callable[[], bool] = lambda: False
        self._next_writes = False
        #: Participants of each step so far, the steps discarded, and the seconds each heal took.
        self.participants: list[int] = []
        self.discarded = 0
        self.heals: list[float] = []
        self.asked_ahead = 0  # quorums asked for when a step committed (each served the next step)
        #: Seconds each step spent waiting on fault tolerance: the quorum (what of it the loop waited for), the
        #: cross-group all-reduces, the commit decision.
        self.waits: list[dict[str, float]] = []
        self._waited = {"quorum": 0.0, "cross_group": 0.0}
        #: The extra state of the last heal (None: the last quorum healed nothing).
        self.healed: dict[str, Any] | None = None

    # --- set-up ------------------------------------------------------------------------------------------

    def attach(
        self,
        model: nn.Module,
        optimizers: list[Optimizer],
        within: Callable[..., Any],
        own_state: OwnState | None = None,
    ) -> None:
        """Average every gradient of ``model`` over the participating groups (at each fit): each FSDP2 shard
        after its reduce-scatter (stages 2-3), every gradient once DDP's backward has taken the group's own
        mean of each bucket through ``within`` (stages 0-1: ``within(process_group, bucket)`` returns a future
        of the bucket, DDP's default hook).
        ``own_state``: how an optimizer's state is read and put back where its ``state_dict`` is not this
        rank's own (a whole-matrix step's, kept by name on each matrix's owner)."""
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        self.model, self.optimizers = model, list(optimizers)
        self.own_state = own_state
        self.participants, self.discarded, self.heals, self.asked_ahead = [], 0, [], 0  # this fit's record
        self.waits = []
        if self.ft.semi_sync is not None:  # no cross-group gradient mean: the groups sync every H steps
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"ShardStrategy(fault_tolerance={{'semi_sync': {self.ft.semi_sync.kind!r}, ...}}) counts the"
                    f" steps of one optimizer (got {len(self.optimizers)}): configure_optimizers must return one."
                )
            self.outer = OuterSync(self.ft.semi_sync, self.manager, model)
            return
        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if sharded:
            across = AcrossGroups(self.manager, model, self._waited_across)
            for module in sharded:
                module.set_all_reduce_hook(across.shard_reduced)
        for ddp in (m for m in model.modules() if isinstance(m, DistributedDataParallel)):
            if not getattr(ddp, _KEY, False):  # DDP takes one hook for its lifetime (a later fit keeps it)
                ddp.register_comm_hook(
                    ddp.process_group, AcrossGroups(self.manager, ddp.module, self._waited_across, within)
                )
                setattr(ddp, _KEY, True)

    def _waited_across(self, seconds: float) -> None:
        self._waited["cross_group"] += seconds

    def join(self) -> None:
        """Join a quorum (healing first if this group is behind); the next step uses it."""
        if self._next is not None:  # asked for after a previous fit's last step: used by no step
            self._safe.set()
            self._next.join()
            self._next = None
        if self.outer is not None:
            if not self.outer.backup:  # else restored from a checkpoint
                self.outer.snapshot()
            self.outer.sync_next = False
        self.join_sync()
        self._commits = None
        if self.outer is not None and not (self.healed is not None and self.outer.sync_next):
            # A fit's first quorum serves no sync, unless this group healed from a peer at a sync's quorum (its
            # next step is that sync's): closed here, so a group that starts later is behind and heals. The
            # all-reduce first: a peer healing from this group has its state once it reaches it, and the commit
            # ends the window in which this group serves its state.
            self._quorum_ready = False
            self.manager.allreduce(torch.zeros(1)).wait()
            self.manager.should_commit()

    def _quorum(self) -> bool:
        """Join a quorum; whether this group is its lowest (the one that writes checkpoints)."""
        started = time.monotonic()
        self.healed = None
        try:
            self.manager.start_quorum()
        except Exception as err:  # noqa: BLE001  (the Lighthouse's "Timeout expired", the manager's own)
            ft = self.ft
            raise RuntimeError(
                f"ShardStrategy(fault_tolerance=...): replica group {ft.replica_id} found no quorum of"
                f" min_replicas={ft.min_replicas} groups at {ft.lighthouse} within timeout={ft.timeout:g} s"
                f" ({type(err).__name__}: {err}). Start the other groups, lower min_replicas, or raise timeout."
            ) from err
        if self.healed is not None:
            self.heals.append(time.monotonic() - started)
            log.info(
                "Replica group %d healed from a live peer in %.2f s.", self.ft.replica_id, self.heals[-1]
            )
        return self.manager.participating_rank() == 0

    def _ask_next(self) -> None:
        """Ask for the next step's quorum in a thread; :meth:`settle` waits for it."""
        self._safe.clear()
        self._next_error = None
        self.asked_ahead += 1
        # torchft reads the thread's current device (its recovery stream, the heal's tensors): this rank's.
        device = torch.accelerator.current_device_index() if torch.accelerator.is_available() else None

        def run() -> None:
            try:
                if device is not None:
                    torch.accelerator.set_device_index(device)
                self._next_writes = self._quorum()
            except BaseException as err:  # noqa: BLE001  (raised in the loop's thread, at settle)
                self._next_error = err

        self._next = threading.Thread(target=run, name="lightning_shard-quorum", daemon=True)
        self._next.start()

    def settle(self) -> None:
        """The loop is before a step's first forward: a peer's state may be read from here on; wait for the
        quorum asked for after the last step (its heal, if any, applied), which the step then uses.
        With ``semi_sync``, the quorum of a step followed by a sync is joined here."""
        self._safe.set()
        if self.outer is not None:
            if not self._quorum_ready and self.outer.due_next():
                self.outer.sync_next = True  # a group healing from this quorum syncs with it
                self.join_sync()
            return
        pending, self._next = self._next, None
        if pending is None:
            return
        started = time.perf_counter()
        pending.join()
        self._waited["quorum"] += time.perf_counter() - started
        if self._next_error is not None:
            raise self._next_error
        self._writes, self._quorum_ready, self._commits = self._next_writes, True, None

    def release(self) -> None:
        """The loop has ended: a quorum asked for after its last step may read this state (a late peer heals
        from it); the next :meth:`join` waits for that quorum, whose outcome no step uses."""
        self._safe.set()

    # --- steps -------------------------------------------------------------------------------------------

    def ensure_quorum(self) -> None:
        """Join a quorum unless one is joined that no step has used yet (the one asked for after the last step
        settled first)."""
        self.settle()
        if not self._quorum_ready:
            self.join()

    def commits(self) -> bool:
        """Whether the step of the last quorum commits on every participating group: asked once per quorum
        (every optimizer of a step follows the one answer), the step's record kept. A discarded step's
        gradients are dropped."""
        if self._commits is None:
            self._quorum_ready = False
            self.participants.append(self.manager.num_participants())
            started = time.perf_counter()
            self._commits = bool(self.manager.should_commit())
            self.waits.append({**self._waited, "commit": time.perf_counter() - started})
            self._waited = {"quorum": 0.0, "cross_group": 0.0}
            if not self._commits:
                self.discarded += 1
                log.warning(
                    "Replica group %d: step discarded (a participant failed or too few groups); %d discarded"
                    " so far.",
                    self.ft.replica_id,
                    self.discarded,
                )
                for optimizer in self.optimizers:
                    optimizer.zero_grad(set_to_none=True)
            if not self.leaving():
                self._ask_next()
        return self._commits

    def step(self, closure: Callable[[], Any], optimizer_step: Callable[[Callable[[], Any]], Any]) -> Any:
        """One training step: the quorum, ``closure`` (forward, backward, the cross-group average), then
        ``optimizer_step`` only if the step commits on every participating group. With ``semi_sync``: the
        group's own step, then the outer sync where one is due."""
        if self.outer is not None:
            result = closure()
            optimizer_step(lambda: result)
            self._outer_step()
            return result
        self.ensure_quorum()
        self._quorum_ready = False
        result = closure()
        if self.commits():
            optimizer_step(lambda: result)
            return result
        return None

    def join_sync(self) -> None:
        """Join a quorum (healing first if this group is behind): the next step's, or the one a sync uses."""
        started = time.perf_counter()
        self._writes = self._quorum()
        self._waited["quorum"] += time.perf_counter() - started
        self._quorum_ready = True

    def _outer_step(self) -> None:
        assert self.outer is not None
        fragment = self.outer.after_step()
        if fragment is None:
            return
        if not self._quorum_ready:  # no forward passed settle() since the last sync
            self.join_sync()
        self._quorum_ready, self.outer.sync_next = False, False
        self.participants.append(self.manager.num_participants())
        started = time.perf_counter()
        committed = self.outer.sync(fragment)
        self._waited["cross_group"] += time.perf_counter() - started
        self.waits.append({**self._waited, "commit": 0.0})
        self._waited = {"quorum": 0.0, "cross_group": 0.0}
        if not committed:
            self.discarded += 1
            log.warning(
                "Replica group %d: the sync after step %d did not commit (a participant failed or too few"
                " groups); the local weights are kept and the next sync averages the change since the last"
                " one. %d syncs discarded so far.",
                self.ft.replica_id,
                self.outer.steps,
                self.discarded,
            )

    def metrics(self) -> dict[str, float]:
        """``ft/participants`` (of the last step), ``ft/discarded_steps`` and, after a heal, ``ft/heal_seconds``
        (empty before the first step)."""
        metrics = {} if self.outer is None else self.outer.metrics()
        if not self.participants:
            return metrics
        metrics["ft/participants"] = float(self.participants[-1])
        metrics["ft/discarded_steps"] = float(self.discarded)
        if self.heals:
            metrics["ft/heal_seconds"] = self.heals[-1]
        return metrics

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the run's checkpoints: the lowest group of the last quorum only."""
        return self._writes

    def shutdown(self) -> None:
        self._safe.set()  # a peer healing from this group's last state gets it
        self.manager.shutdown(wait=False)

    # --- healing -----------------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """What a restarted group needs (called in torchft's quorum thread while this process waits on the
        quorum, between steps: no collective)."""
        self._safe.wait()  # a quorum asked for after a step: the loop is before the next step's forward
        assert self.model is not None
        return {
            "model": _local(self.model.state_dict()),
            "optimizers": [self._optimizer_state(optimizer) for optimizer in self.optimizers],
            "extra": self.extra_state(),
            "outer": None if self.outer is None else self.outer.state(),
        }

    def _optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.own_state is not None and self.own_state.holds(optimizer):
            return self.own_state.state(optimizer)
        own = _own(optimizer)
        state: dict[str, Any] = _local(own.state_dict())
        if own is not optimizer:  # ZeRO-1: its own groups hold the hyper-parameters of the next step
            state["param_groups"] = [
                {**local, **{k: v for k, v in outer.items() if k != "params"}}
                for local, outer in zip(state["param_groups"], optimizer.param_groups, strict=True)
            ]
        return state

    def _load(self, state: dict[str, Any]) -> None:
        self._safe.wait()  # (as in _state)
        assert self.model is not None
        with torch.no_grad():
            for name, value in self.model.state_dict().items():
                _local(value).copy_(state["model"][name])
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            if self.own_state is not None and self.own_state.holds(optimizer):
                self.own_state.load(optimizer, saved)
            else:
                own = _own(optimizer)
                own.load_state_dict(_as_dtensors(own, saved))
                # ZeRO-1 steps with its own groups' hyper-parameters (a scheduler's LR among them), copied to the
                # local optimizer at each step: the peer's arrive with the local state (see _optimizer_state).
                for outer, local in zip(optimizer.param_groups, own.param_groups, strict=True):
                    outer.update({k: v for k, v in local.items() if k != "params"})
        if self.outer is not None and state.get("outer") is not None:
            self.outer.load(state["outer"])
        self.healed = state["extra"]
        self.load_extra(state["extra"])


def _own(optimizer: Optimizer) -> Optimizer:
    """The optimizer over this rank's own state: ZeRO-1's local one (its ``state_dict`` would gather them all)."""
    inner: Optimizer = getattr(optimizer, "optim", optimizer)
    return inner


def _as_dtensors(optimizer: Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """A peer's local optimizer state, each tensor shaped like its parameter's shard made that DTensor."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in saved["state"].items():
        p = params[index]
        state[index] = {
            key: laid_out_as(value.to(p.device), p)
            if isinstance(p, DTensor)
            and torch.is_tensor(value)
            and value.dim() > 0
            and value.shape == p.to_local().shape
            else value
            for key, value in entry.items()
        }
    return {"state": state, "param_groups": saved["param_groups"]}
