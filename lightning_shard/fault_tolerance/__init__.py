"""Fault tolerance without restart: replica groups that train on while one of them is lost and heals.

``ShardStrategy(fault_tolerance={...})`` makes the replicate dimension of HSDP elastic per step, through
torchft (``pip install torchft``): each *replica group* is a job of its own (one ``torchrun`` or SLURM step),
sharded inside as the stage says; across groups the gradients are averaged by torchft's managed all-reduce over
the groups that take part in the step, which join a quorum at every step through a Lighthouse. A step commits
only if every participant succeeded; a group that died is restarted alone and heals from a live peer's state
(never from disk) while the others train on. See docs/fault_tolerance.md.

This module holds the flag (:class:`FaultTolerance`) and the Lighthouse (:func:`serve_lighthouse`,
:func:`check_reachable`); :mod:`.replicas` drives a group at run time.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from lightning_shard.fault_tolerance.semi_sync import SEMI_SYNC_KEYS, SemiSync, semi_sync_from

#: Environment variables read where the flag leaves a key out (one launch command for every group).
ENV = {
    "replica_id": "REPLICA_GROUP_ID",
    "replica_groups": "NUM_REPLICA_GROUPS",
    "lighthouse": "TORCHFT_LIGHTHOUSE",
    "min_replicas": "TORCHFT_MIN_REPLICAS",
}
KEYS = ("replica_id", "replica_groups", "lighthouse", "min_replicas", "timeout", *SEMI_SYNC_KEYS)


@dataclass(frozen=True)
class FaultTolerance:
    """``ShardStrategy(fault_tolerance=...)``, checked."""

    replica_id: int
    replica_groups: int
    lighthouse: str
    min_replicas: int = 1
    #: Seconds a quorum, a cross-group collective or a heal may take before the step fails.
    timeout: float = 60.0
    #: DiLoCo or local SGD every ``sync_every`` steps instead of a gradient mean at every step (``None``).
    semi_sync: SemiSync | None = None

    @classmethod
    def from_flag(cls, value: Any, owner: str = "ShardStrategy") -> FaultTolerance | None:
        """``None`` (off), or a dict of :data:`KEYS` (each missing one read from :data:`ENV`)."""
        if value is None or value is False:
            return None
        if isinstance(value, FaultTolerance):
            return value
        if value is True:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(
                f"{owner}(fault_tolerance={value!r}) must be a dict such as {{'replica_id': 0, 'replica_groups': 2,"
                " 'lighthouse': 'http://host:29510'}} (missing keys are read from REPLICA_GROUP_ID,"
                " NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE, TORCHFT_MIN_REPLICAS)."
            )
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise ValueError(
                f"{owner}(fault_tolerance=...) has no key {unknown[0]!r}; its keys are {', '.join(KEYS)}."
            )
        given = dict(value)
        for key, env in ENV.items():
            if key not in given and os.environ.get(env):
                given[key] = os.environ[env]
        missing = [key for key in ("replica_id", "replica_groups", "lighthouse") if key not in given]
        if missing:
            raise ValueError(
                f"{owner}(fault_tolerance=...) needs {', '.join(repr(k) for k in missing)}: pass them in the dict"
                f" or set {', '.join(ENV[k] for k in missing)} for each group's processes."
            )
        semi_sync = semi_sync_from(given, f"{owner}(fault_tolerance=...)")
        try:
            ft = cls(
                replica_id=int(given["replica_id"]),
                replica_groups=int(given["replica_groups"]),
                lighthouse=str(given["lighthouse"]),
                min_replicas=int(given.get("min_replicas", 1)),
                timeout=float(given.get("timeout", 60.0)),
                semi_sync=semi_sync,
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"{owner}(fault_tolerance={value!r}): {err}") from err
        ft.check(owner)
        return ft

    def check(self, owner: str) -> None:
        flag = f"{owner}(fault_tolerance=...)"
        if self.replica_groups < 1 or not 0 <= self.replica_id < self.replica_groups:
            raise ValueError(
                f"{flag}: replica_id={self.replica_id} must be in [0, replica_groups={self.replica_groups}) (each"
                " group its own id, from 0)."
            )
        if not 1 <= self.min_replicas <= self.replica_groups:
            raise ValueError(
                f"{flag}: min_replicas={self.min_replicas} must be in [1, replica_groups={self.replica_groups}]: the"
                " groups a step needs to commit."
            )
        if self.timeout <= 0:
            raise ValueError(f"{flag}: timeout={self.timeout} must be a positive number of seconds.")
        address = urlparse(self.lighthouse)
        if address.scheme not in ("http", "https") or not address.hostname or address.port is None:
            raise ValueError(
                f"{flag}: lighthouse={self.lighthouse!r} must be the Lighthouse's address, 'http://HOST:PORT'"
                " (what `lightning-shard lighthouse` prints)."
            )


def check_reachable(ft: FaultTolerance, wait: float = 5.0) -> None:
    """Raise naming the address unless the Lighthouse accepts a connection within ``wait`` seconds (at most the
    flag's ``timeout``)."""
    address = urlparse(ft.lighthouse)
    deadline = time.monotonic() + min(wait, ft.timeout)
    while True:
        try:
            with socket.create_connection((address.hostname, address.port), timeout=1.0):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"ShardStrategy(fault_tolerance=...): no Lighthouse answers at {ft.lighthouse} ({err}). Start"
                    f" one first (`lightning-shard lighthouse --min-replicas {ft.min_replicas} --port"
                    f" {address.port}`) and pass its address as fault_tolerance['lighthouse'] or"
                    " TORCHFT_LIGHTHOUSE."
                ) from err
            time.sleep(0.2)


def serve_lighthouse(
    min_replicas: int, port: int = 29510, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 5000
) -> Any:
    """Start a torchft Lighthouse in this process (``.address()``; ``.shutdown()``)."""
    from torchft._torchft import LighthouseServer  # optional: torchft

    return LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


def run_lighthouse(min_replicas: int, port: int, join_timeout_ms: int) -> int:
    """``lightning-shard lighthouse``: serve until SIGINT or SIGTERM."""
    import signal
    import threading

    try:
        server = serve_lighthouse(min_replicas, port, join_timeout_ms)
    except ImportError:
        print("lightning-shard lighthouse needs torchft: pip install 'lightning-shard[ft]'", flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"Lighthouse at {server.address()} (min_replicas={min_replicas})", flush=True)
    # Python runs a handler in the main thread once that thread wakes; the signal itself may land on one of the
    # server's threads, which wakes nothing: wait in slices, so the handler runs within one.
    while not stop.wait(0.5):
        pass
    server.shutdown()
    return 0
