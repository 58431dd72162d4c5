"""DiLoCo between replica groups (``fault_tolerance={"semi_sync": "diloco", ...}``): 2 groups of 1 CPU rank each
(the edge size of a group), a Lighthouse served in this process, each group its own job (its own port and
``REPLICA_GROUP_ID``), a small MLP trained by AdamW on its own group's rows.

Each group's fit is compared with DiLoCo written here in plain torch (two copies of the model, their inner AdamW
steps, every H steps the pseudo-gradient's mean over the two stepped by a Nesterov SGD over the last-sync copy,
copied back into both): whole DiLoCo at stages 0 and 3, streaming DiLoCo with 2 fragments at stage 0, and a run
checkpointed mid-cycle and resumed from it that ends where the uninterrupted one does.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.multirank
pytest.importorskip("torchft")

GROUPS, ROWS, BATCH, LR = 2, 128, 4, 1e-2
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
#: (name, stage, sync_every, fragments, steps): the fits each group's process runs in turn.
RUNS = [("whole0", 0, 3, 1, 9), ("whole3", 3, 3, 1, 9), ("streaming", 0, 4, 2, 8)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 4, generator=generator)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1


def _rows(group: int, step: int) -> list[int]:
    """The rows group ``group`` reads at optimizer step ``step`` (from 0): every other row, in order."""
    mine = list(range(ROWS))[group::GROUPS]
    return mine[step * BATCH : (step + 1) * BATCH]


def _fragment_due(step: int, every: int, fragments: int) -> int | None:
    for i in range(fragments):
        if step % every == i * every // fragments:
            return i
    return None


def _reference(
    every: int, fragments: int, steps: int, batches: list[int] | None = None, resume: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """DiLoCo in plain torch: each group's final weights (``batches``: the batch each step reads, in order by
    default; ``resume``: after that step both groups go on from group 0's model and AdamW state, as from the
    checkpoint group 0 wrote there, the last-sync copy and the outer momentum kept)."""
    batches = batches or list(range(steps))
    x, y = _data()
    start = _model()
    models = [copy.deepcopy(start) for _ in range(GROUPS)]
    inner = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    backup = [p.detach().clone() for p in start.parameters()]
    n = len(backup)
    parts = [list(range(i * n // fragments, (i + 1) * n // fragments)) for i in range(fragments)]
    outer = [torch.optim.SGD([backup[j] for j in part], **OUTER) for part in parts]
    for step in range(1, steps + 1):
        if step - 1 == resume:
            models[1].load_state_dict(models[0].state_dict())
            inner[1].load_state_dict(copy.deepcopy(inner[0].state_dict()))  # (load_state_dict shares tensors)
        for group, (model, optimizer) in enumerate(zip(models, inner, strict=True)):
            rows = _rows(group, batches[step - 1])
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        fragment = _fragment_due(step, every, fragments)
        if fragment is None:
            continue
        with torch.no_grad():
            weights = [list(m.parameters()) for m in models]
            for j in parts[fragment]:
                backup[j].grad = sum(backup[j] - w[j] for w in weights) / GROUPS
            outer[fragment].step()
            outer[fragment].zero_grad()
            for w in weights:
                for j in parts[fragment]:
                    w[j].copy_(backup[j])
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]


def _fit(root: str, lighthouse: str, ports: list[int]) -> None:
    """Group ``RANK``'s process (1 rank): each of :data:`RUNS`, then a run checkpointed at step 4 and resumed."""
    import os
    import time

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shard import ShardStrategy

    group = int(os.environ["RANK"])
    world = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1}
    os.environ.update({k: str(v) for k, v in world.items()}, MASTER_PORT=str(ports[group]))

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()
            self.seen: list[list[float]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.seen.append(x[:, 0].tolist())
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Count(L.Callback):
        """The cross-group all-reduces, and the step each ran after."""

        def __init__(self) -> None:
            self.calls: list[int] = []

        def on_train_start(self, trainer: L.Trainer, module: Any) -> None:
            replicas = trainer.strategy.replica_group
            send = replicas.manager.allreduce

            def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.calls.append(replicas.outer.steps)
                return send(tensor, *args, **kwargs)

            replicas.manager.allreduce = counted

    def fit(name: str, stage: int, every: int, fragments: int, steps: int, **kwargs: Any) -> dict[str, Any]:
        ft = {"replica_id": group, "replica_groups": GROUPS, "lighthouse": lighthouse, "min_replicas": 2}
        ft.update(
            semi_sync="diloco", sync_every=every, fragments=fragments, outer_optimizer=OUTER, timeout=30
        )
        module, count, callbacks = Module(), Count(), kwargs.pop("callbacks", [])
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=ShardStrategy(stage=stage, fault_tolerance=ft),
            max_steps=steps,
            logger=False,
            enable_checkpointing=bool(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[count, *callbacks],
            use_distributed_sampler=False,
        )
        x, y = _data()
        mine = list(range(ROWS))[group::GROUPS]  # this group's rows, in order
        trainer.fit(module, DataLoader(TensorDataset(x[mine], y[mine]), batch_size=BATCH), **kwargs)
        replicas = trainer.strategy.replica_group
        weights = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()
        }
        torch.save(
            {k.removeprefix("net."): v.detach() for k, v in weights.items()}, Path(root) / f"{name}{group}.pt"
        )
        record = {
            "synced_at": replicas.outer.synced_at,
            "outer_steps": replicas.outer.outer_steps,
            "participants": replicas.participants,
            "allreduces": count.calls,
            "metrics": replicas.metrics(),
            "first_x": [row[0] for row in module.seen],
        }
        (Path(root) / f"{name}{group}.json").write_text(json.dumps(record))
        return record

    for name, stage, every, fragments, steps in RUNS:
        fit(name, stage, every, fragments, steps)
    # Checkpointed after step 4 (mid-cycle: H = 3), then a fresh fit resumed from it to step 9.
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=Path(root) / "ckpt", every_n_train_steps=4, save_top_k=-1)
    fit("first", 0, 3, 1, 4, callbacks=[ckpt])
    path = Path(root) / "ckpt" / "epoch=0-step=4.ckpt"  # written by group 0 alone, committed by a rename
    for _ in range(600):
        if path.exists():
            break
        time.sleep(0.1)
    fit("resumed", 0, 3, 1, 9, ckpt_path=str(path))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_shard.demos.ranks import free_port, run_ranks
    from lightning_shard.fault_tolerance import serve_lighthouse

    root = tmp_path_factory.mktemp("diloco")
    port = free_port()
    lighthouse = serve_lighthouse(GROUPS, port, join_timeout_ms=1000, heartbeat_timeout_ms=5000)
    try:
        run_ranks(_fit, str(root), f"http://localhost:{port}", [free_port(), free_port()], world_size=GROUPS)
    finally:
        lighthouse.shutdown()
    return root


def _assert_weights(root: Path, name: str, reference: list[dict[str, torch.Tensor]]) -> float:
    worst = 0.0
    for group in range(GROUPS):
        got = torch.load(root / f"{name}{group}.pt", weights_only=True)
        for key, want in reference[group].items():
            torch.testing.assert_close(
                got[key], want, rtol=1e-5, atol=1e-7, msg=f"{name}, group {group}, {key}"
            )
            worst = max(worst, (got[key] - want).abs().max().item())
    return worst


@pytest.mark.parametrize("name", ["whole0", "whole3"])
def test_diloco_equals_plain_torch_and_talks_across_groups_only_at_syncs(runs, name):
    _, stage, every, fragments, steps = next(r for r in RUNS if r[0] == name)
    worst = _assert_weights(runs, name, _reference(every, fragments, steps))
    print(f"{name}: weight max |diff| vs reference {worst:.2e}")
    for group in range(GROUPS):
        record = json.loads((runs / f"{name}{group}.json").read_text())
        assert record["synced_at"] == [3, 6, 9], record
        assert record["outer_steps"] == 3 and record["participants"] == [2, 2, 2], record
        assert record["allreduces"] == [3, 6, 9], record  # one all-reduce per sync, none between
        assert record["first_x"] == [_data()[0][_rows(group, s)[0], 0].item() for s in range(steps)]
        metrics = record["metrics"]
        params = sum(p.numel() for p in _model().parameters())
        assert metrics["ft/outer_steps"] == 3.0
        assert metrics["ft/cross_group_bytes"] == 3 * params * 4  # fp32 pseudo-gradients, three syncs


def test_streaming_diloco_syncs_one_fragment_at_a_time(runs):
    worst = _assert_weights(runs, "streaming", _reference(4, 2, 8))
    print(f"streaming: weight max |diff| vs reference {worst:.2e}")
    for group in range(GROUPS):
        record = json.loads((runs / f"streaming{group}.json").read_text())
        # Fragment 1 (the second Linear) after steps 2 and 6, fragment 0 (the first) after 4 and 8.
        assert record["synced_at"] == [2, 4, 6, 8] and record["allreduces"] == [2, 4, 6, 8], record
    # Fragment 1 last synced at step 6: the groups' second Linear differ at the end, their first do not.
    one, two = (torch.load(runs / f"streaming{g}.pt", weights_only=True) for g in range(GROUPS))
    assert torch.equal(one["0.weight"], two["0.weight"]) and not torch.equal(one["2.weight"], two["2.weight"])


def test_a_checkpoint_mid_cycle_resumes_the_outer_state_exactly(runs):
    """Saved after step 4 (one sync behind it, one step into the next cycle) and resumed to step 9: the
    weights of the plain torch run (the last-sync copy, the outer momentum and the cycle's position came back),
    syncing after steps 6 and 9 only. The checkpoint is group 0's (the lowest group writes): both groups go on
    from its model and AdamW state. Lightning starts a plain DataLoader's epoch again on a mid-epoch resume:
    steps 5-9 read batches 0-4, as the groups' records show."""
    batches = [0, 1, 2, 3, 0, 1, 2, 3, 4]
    worst = _assert_weights(runs, "resumed", _reference(3, 1, 9, batches, resume=4))
    print(f"resumed: weight max |diff| vs reference {worst:.2e}")
    for group in range(GROUPS):
        record = json.loads((runs / f"resumed{group}.json").read_text())
        assert record["synced_at"] == [6, 9] and record["outer_steps"] == 3, record
        assert record["first_x"] == [_data()[0][_rows(group, b)[0], 0].item() for b in batches[4:]]
