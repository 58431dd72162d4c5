"""``ShardStrategy(fault_tolerance=...)``: the flag's checks (before any process starts), the environment
fallbacks one launch command per group relies on, an unreachable Lighthouse, and `lightning-shard lighthouse`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import free_port, run_ranks
from lightning_shard.fault_tolerance import FaultTolerance

pytest.importorskip("torchft")

GOOD = {"replica_id": 0, "replica_groups": 2, "lighthouse": "http://localhost:29510"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(fault_tolerance={"replica_groups": 2}), r"needs 'replica_id', 'lighthouse'.*REPLICA_GROUP_ID"),
        (dict(fault_tolerance={**GOOD, "replica_id": 2}), r"replica_id=2 must be in \[0, replica_groups=2\)"),
        (
            dict(fault_tolerance={**GOOD, "min_replicas": 3}),
            r"min_replicas=3 must be in \[1, replica_groups=2\]",
        ),
        (
            dict(fault_tolerance={**GOOD, "lighthouse": "localhost"}),
            r"lighthouse='localhost' must be.*http://HOST:PORT",
        ),
        (dict(fault_tolerance={**GOOD, "replicas": 2}), r"has no key 'replicas'"),
        (
            dict(fault_tolerance=GOOD, engine="deepspeed"),
            r"engine='deepspeed'\) is not available.*engine='fsdp'",
        ),
        (dict(fault_tolerance=GOOD, stage="auto"), r"stage='auto'\) is not available.*Pick stage=0-3"),
        (
            dict(fault_tolerance=GOOD, stage=1, gradient_compression="bf16"),
            r"stage=1\) takes DDP's communication hook.*Drop one",
        ),
        (
            dict(fault_tolerance=GOOD, replicate_size=2),
            r"replicate_size=2.*the replica groups are the replicate",
        ),
    ],
)
def test_bad_fault_tolerance_flags_are_refused_naming_the_value_and_fix(flags, message):
    with pytest.raises(ValueError, match=message):
        ShardStrategy(**flags)


def test_the_fabric_door_takes_it_with_the_same_checks_and_asks_for_a_set_up_model_first():
    from lightning_shard import ShardFabricStrategy

    strategy = ShardFabricStrategy(stage=3, fault_tolerance=GOOD)
    assert strategy.config.fault_tolerance == FaultTolerance.from_flag(GOOD)
    assert strategy.replica_group is None  # no Manager before fabric.setup
    with pytest.raises(
        RuntimeError, match=r"join_replica_groups needs .* after fabric.setup\(model, optimizer\)"
    ):
        strategy.join_replica_groups({"step": 0})
    with pytest.raises(ValueError, match=r"engine='deepspeed'\) is not available.*engine='fsdp'"):
        ShardFabricStrategy(fault_tolerance=GOOD, engine="deepspeed")


def test_missing_keys_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "3")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    monkeypatch.setenv("TORCHFT_MIN_REPLICAS", "2")
    strategy = ShardStrategy(fault_tolerance={"timeout": 30})
    assert strategy.config.fault_tolerance == FaultTolerance(1, 3, "http://lighthouse:29510", 2, 30.0)
    # Every rank of every group reads its own part of each batch, as one HSDP job over all of them would.
    monkeypatch.setattr(type(strategy), "num_processes", property(lambda self: 2))  # 2 ranks in this group
    monkeypatch.setattr(type(strategy), "global_rank", property(lambda self: 1))
    kwargs = strategy.distributed_sampler_kwargs
    assert kwargs == {"num_replicas": 6, "rank": 3}


def _fit_alone(port: int, **flags: Any) -> str:
    import lightning as L

    from lightning_shard.demos.gpt import GPTModule, TextDataModule

    flags = {"replica_id": 0, "replica_groups": 2, "lighthouse": f"http://localhost:{port}", **flags}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ShardStrategy(stage=3, fault_tolerance=flags),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
    )
    try:
        trainer.fit(GPTModule(d_model=16, n_layers=1, n_heads=2, seq_len=16), TextDataModule(16, 2, 50))
    except (ConnectionError, RuntimeError) as err:
        return str(err)
    return "no error"


def _without_lighthouse_then_alone(port: int) -> list[str]:
    from lightning_shard.fault_tolerance import serve_lighthouse

    unreachable = _fit_alone(port, timeout=1)
    lighthouse = serve_lighthouse(min_replicas=2, port=port)
    try:
        return [unreachable, _fit_alone(port, min_replicas=2, timeout=2)]
    finally:
        lighthouse.shutdown()


def test_an_unreachable_lighthouse_and_too_few_groups_are_clear_errors():
    port = free_port()
    ((unreachable, alone),) = run_ranks(_without_lighthouse_then_alone, port, world_size=1)
    assert re.search(
        rf"no Lighthouse answers at http://localhost:{port}.*lightning-shard lighthouse", unreachable
    )
    # One group of two, min_replicas=2: it waits for the quorum timeout=2 s, then says so.
    assert re.search(
        r"replica group 0 found no quorum of min_replicas=2 groups.*within timeout=2 s", alone
    ), alone


def test_the_lighthouse_command_serves_until_sigterm():
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "lightning_shard.cli",
        "lighthouse",
        "--min-replicas",
        "2",
        "--port",
        str(port),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert re.match(rf"Lighthouse at http://\S+:{port} \(min_replicas=2\)", line), line
        from lightning_shard.fault_tolerance import check_reachable

        check_reachable(FaultTolerance(0, 2, f"http://localhost:{port}"), wait=5)
    finally:
        process.send_signal(signal.SIGTERM)
        # its subject is the exit code after SIGTERM; on a loaded machine the shutdown and the interpreter's
        # exit have taken over 10 s
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    assert process.returncode == 0


def test_a_backward_that_raised_after_queuing_the_cross_group_mean_leaves_the_next_its_own(monkeypatch):
    from lightning_shard.fault_tolerance import _across

    means: list[int] = []
    monkeypatch.setattr(_across, "average_gradients", lambda manager, module: means.append(1))
    across = _across.AcrossGroups(None, torch.nn.Linear(2, 2), lambda seconds: None)
    fail = [True]

    class EarlierUnit(torch.autograd.Function):  # a unit nearer the inputs, whose backward runs after
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 1

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            if fail[0]:
                raise RuntimeError("an earlier unit's backward failed")
            return grad

    def step() -> None:
        h = EarlierUnit.apply(torch.ones(2, requires_grad=True))
        h.register_hook(lambda grad: across.shard_reduced(grad))  # where FSDP2 calls its all-reduce hook
        (h * 2).sum().backward()

    with pytest.raises(RuntimeError, match="earlier unit"):
        step()  # the mean was queued, then the backward failed: autograd drops what was queued
    assert means == []
    fail[0] = False
    step()  # the next backward queues its own mean, which runs
    assert means == [1]
