"""``fault_tolerance={"semi_sync": ...}``: the flag's checks (at construction, before any process starts), the
fragments' schedule, and the outer step in one process against a stand-in for torchft's Manager."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_shard import ShardStrategy
from lightning_shard.fault_tolerance import FaultTolerance
from lightning_shard.fault_tolerance.diloco import OuterSync
from lightning_shard.fault_tolerance.replicas import ReplicaGroups
from lightning_shard.fault_tolerance.semi_sync import OuterOptimizer, SemiSync

pytest.importorskip("torchft")

GOOD = {"replica_id": 0, "replica_groups": 2, "lighthouse": "http://localhost:29510"}
DILOCO = {**GOOD, "semi_sync": "diloco", "sync_every": 4}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({**GOOD, "semi_sync": "sync"}, r"semi_sync='sync' is unknown\. Use 'diloco'.*'local_sgd'"),
        ({**GOOD, "semi_sync": "diloco"}, r"needs sync_every=H, an integer >= 1 \(got sync_every=None\)"),
        ({**DILOCO, "sync_every": 0}, r"needs sync_every=H.*got sync_every=0.*Set e\.g\. sync_every=100"),
        ({**DILOCO, "fragments": 0}, r"fragments=0 must be an integer in \[1, sync_every=4\]"),
        ({**DILOCO, "fragments": 5}, r"fragments=5 must be .*two on one step\. Use fewer fragments"),
        (
            {**DILOCO, "fragment_sync_delay": 1},
            r"fragment_sync_delay=1 is not supported.*fragment_sync_delay=0",
        ),
        (
            {**DILOCO, "fragment_update_alpha": 1.5},
            r"fragment_update_alpha=1\.5 must be a number in \[0, 1\]",
        ),
        ({**GOOD, "sync_every": 4}, r"sync_every=4 is read only with semi_sync=.*Set semi_sync, or drop it"),
        (
            {**DILOCO, "semi_sync": "local_sgd", "outer_optimizer": {"lr": 1.0}},
            r"outer_optimizer=\{'lr': 1\.0\} is read only with semi_sync='diloco'",
        ),
        ({**DILOCO, "outer_optimizer": {"beta": 0.9}}, r"must be a dict of lr, momentum, nesterov.*'beta'"),
        (
            {**DILOCO, "outer_optimizer": {"momentum": 0.0}},
            r"needs lr > 0, momentum >= 0, and momentum > 0 with nesterov",
        ),
    ],
)
def test_bad_semi_sync_keys_are_refused_naming_the_value_and_fix(flags, message):
    with pytest.raises(ValueError, match=message):
        ShardStrategy(stage=0, fault_tolerance=flags)


def test_semi_sync_with_gradient_compression_and_in_fabric_is_refused():
    with pytest.raises(
        ValueError, match=r"gradient_compression='bf16'\) with semi_sync='diloco' is not available"
    ):
        ShardStrategy(stage=3, fault_tolerance=DILOCO, gradient_compression="bf16")
    from lightning_shard import ShardFabricStrategy

    with pytest.raises(
        ValueError, match=r"ShardFabricStrategy\(fault_tolerance=\{'semi_sync'.*Trainer\(strategy="
    ):
        ShardFabricStrategy(stage=3, fault_tolerance=DILOCO)


def test_the_flag_holds_the_paper_defaults_and_staggers_the_fragments():
    ft = FaultTolerance.from_flag({**DILOCO, "fragments": 2})
    assert ft is not None and ft.semi_sync == SemiSync("diloco", 4, 2, 0.0, OuterOptimizer(0.7, 0.9, True))
    assert [ft.semi_sync.due(step) for step in range(1, 9)] == [None, 1, None, 0, None, 1, None, 0]
    assert ShardStrategy(stage=3, fault_tolerance=DILOCO).config.fault_tolerance.semi_sync.fragments == 1
    assert FaultTolerance.from_flag(GOOD).semi_sync is None  # every-step gradient mean, as before


class _OtherGroupAtZero:
    """torchft's Manager, the other group's tensors all zeros: the mean is half of this group's."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def allreduce(self, tensor: torch.Tensor) -> Any:
        self.sent.append(tensor.numel())
        tensor.div_(2)
        return torch.futures.Future()  # (stands in for Work: only wait() is called)

    def should_commit(self) -> bool:
        return True


def test_local_sgd_mixes_the_mean_with_the_local_weights_by_alpha(monkeypatch):
    monkeypatch.setattr(torch.futures.Future, "wait", lambda self: None)
    model, manager = nn.Linear(3, 2), _OtherGroupAtZero()
    outer = OuterSync(SemiSync("local_sgd", 2, fragment_update_alpha=0.25), manager, model)
    outer.snapshot()
    local = [p.detach().clone() for p in model.parameters()]
    assert outer.after_step() is None and outer.after_step() == 0
    assert outer.sync(0) and manager.sent == [8] and outer.bytes == 32
    for p, before, synced in zip(model.parameters(), local, outer.backup, strict=True):
        torch.testing.assert_close(synced, before / 2)
        torch.testing.assert_close(p.detach(), 0.25 * before + 0.75 * before / 2)
    assert outer.metrics() == {"ft/outer_steps": 1.0, "ft/cross_group_bytes": 32.0}


def test_more_fragments_than_parameters_and_more_than_one_optimizer_are_refused():
    with pytest.raises(ValueError, match=r"fragments=3 is more than the model's 2 trainable parameters"):
        OuterSync(
            SemiSync("diloco", 4, fragments=3, outer=OuterOptimizer()), _OtherGroupAtZero(), nn.Linear(2, 2)
        )
    replicas = ReplicaGroups.__new__(ReplicaGroups)
    replicas.ft = FaultTolerance.from_flag(DILOCO)  # type: ignore[assignment]
    model = nn.Linear(2, 2)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)]
    with pytest.raises(ValueError, match=r"counts the steps of one optimizer \(got 2\)"):
        replicas.attach(model, optimizers, within=lambda *args: None)
