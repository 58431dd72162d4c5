"""Optimizers that need whole matrices (``torch.optim.Muon``) at every stage, side by side with Lightning's
``DDPStrategy`` on the same ranks and data: the same losses and weights, while at stages 2-3 each matrix's state
lives on one rank only and a sharded checkpoint resumes at stage 0 on another world size.

Muon orthogonalises each matrix's momentum by Newton-Schulz iterations: run on FSDP2's row shards, the update is
another matrix's (each shard orthogonalised alone), and the weights move far from DDP's after one step.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.engines._whole_matrix import optimizer_state_dict, whole_matrix_step
from tests.helpers import LossRecorder, full_weights, trainer_kwargs

pytestmark = pytest.mark.multirank

STEPS = 4
CLIP = 1.0
WIDTH = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class MatrixMLP(L.LightningModule):
    """2-D weights only (``torch.optim.Muon`` takes nothing else); ``dead`` gets a zero gradient every step."""

    def __init__(self, optimizer: str = "muon") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        torch.manual_seed(0)
        self.inp = nn.Linear(16, WIDTH, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.dead = nn.Linear(WIDTH, WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h + 0.0 * self.dead(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "soap":  # heavyball's SOAP: Adam in the eigenbasis of each matrix's factors
            import heavyball

            heavyball.utils.compile_mode = (
                None  # eager: its torch.compile takes a minute per run on 2 CPU cores
            )
            return heavyball.SOAP(self.parameters(), lr=0.01)
        return torch.optim.Muon(self.parameters(), lr=0.05, weight_decay=0.01)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g))
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=4, sampler=sampler)


def _state_bytes(optimizer: Any) -> int:
    return sum(
        v.numel() * v.element_size()
        for entry in optimizer.state.values()
        for v in entry.values()
        if torch.is_tensor(v) and v.dim() > 0
    )


def _fit(
    strategy: Any, world: int, steps: int = STEPS, ckpt: str | None = None, optimizer: str = "muon"
) -> dict[str, Any]:
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=world,
        strategy=strategy,
        callbacks=[recorder],
        **trainer_kwargs(max_steps=steps, gradient_clip_val=CLIP),
    )
    module = MatrixMLP(optimizer)
    trainer.fit(module, _loader(), ckpt_path=ckpt)
    optimizer = trainer.optimizers[0]
    whole = whole_matrix_step(optimizer)
    return {
        "losses": recorder.losses,
        "weights": full_weights(trainer),
        "state_bytes": _state_bytes(optimizer),
        "owned": None if whole is None else len(whole.stand_ins),
        "trainer": trainer,
    }


def _side_by_side(root: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    world = int(os.environ["WORLD_SIZE"])  # read first: a fit can leave the environment without it
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        run = _fit(ShardStrategy(stage=stage), world)
        if stage == 3:
            trainer = run["trainer"]
            trainer.save_checkpoint(f"{root}/muon3.ckpt")
            full = optimizer_state_dict(trainer.strategy.model, trainer.optimizers[0], full=True)
            out["saved_momentum"] = {name: entry["momentum_buffer"] for name, entry in full["state"].items()}
        out[stage] = {k: v for k, v in run.items() if k != "trainer"}
    out["ddp"] = {k: v for k, v in _fit(DDPStrategy(), world).items() if k != "trainer"}
    for name, strategy in {"soap 3": ShardStrategy(stage=3), "soap ddp": DDPStrategy()}.items():
        out[name] = {k: v for k, v in _fit(strategy, world, optimizer="soap").items() if k != "trainer"}
    return out


def _resume(root: str) -> dict[str, Any]:
    """The 2-rank stage-3 checkpoint resumed at stage 0 on one rank (at its step: loaded, no step taken)."""
    run = _fit(ShardStrategy(stage=0), 1, ckpt=f"{root}/muon3.ckpt")
    optimizer, module = run["trainer"].optimizers[0], run["trainer"].lightning_module
    momentum = {name: optimizer.state[p]["momentum_buffer"] for name, p in module.named_parameters()}
    return {"losses": run["losses"], "weights": run["weights"], "momentum": momentum}


def test_muon_at_every_stage_matches_ddp_with_its_state_on_one_rank_per_matrix(tmp_path):
    ranks = run_ranks(_side_by_side, str(tmp_path))
    reference_state = ranks[0]["ddp"]["state_bytes"]
    for rank, result in enumerate(ranks):
        reference = result["ddp"]
        assert len(reference["losses"]) == STEPS
        for stage in (0, 1, 2, 3):
            run, where = result[stage], f"stage {stage}, rank {rank}"
            torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-5, atol=0, msg=where)
            for key, weight in reference["weights"].items():
                torch.testing.assert_close(
                    run["weights"][key],
                    weight,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, k=key, w=where: f"{w}: {k}: {m}",
                )
        # Stages 2-3: each matrix's momentum lives on its owner only, the owners spread by size.
        for stage in (2, 3):
            assert result[stage]["owned"] and result[stage]["owned"] < 6, (stage, result[stage]["owned"])
            largest = WIDTH * WIDTH * 4
            assert result[stage]["state_bytes"] <= reference_state / 2 + largest, (stage, rank)
    for stage in (2, 3):
        assert sum(r[stage]["state_bytes"] for r in ranks) == reference_state, stage
    # heavyball's SOAP (preconditioners from each whole matrix's Kronecker factors) at stage 3.
    for rank, result in enumerate(ranks):
        run, reference = result["soap 3"], result["soap ddp"]
        assert run["owned"], rank
        torch.testing.assert_close(
            run["losses"], reference["losses"], rtol=1e-5, atol=0, msg=f"SOAP, rank {rank}"
        )
        for key, weight in reference["weights"].items():
            torch.testing.assert_close(run["weights"][key], weight, rtol=1e-5, atol=1e-6, msg=f"SOAP: {key}")
    # Stage 3 on 2 ranks -> stage 0 on 1 rank: every matrix's momentum, saved by its owner, is whole on the one.
    (resumed,) = run_ranks(_resume, str(tmp_path), world_size=1)
    assert resumed["losses"] == []  # resumed at the checkpoint's step
    saved = ranks[0]["saved_momentum"]
    assert saved.keys() == resumed["momentum"].keys()
    for name, value in saved.items():
        torch.testing.assert_close(resumed["momentum"][name], value, rtol=0, atol=0, msg=name)
    for key, value in ranks[0][3]["weights"].items():
        torch.testing.assert_close(resumed["weights"][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_refuses_a_whole_matrix_optimizer_naming_the_fsdp_engine(stage):
    from lightning_shard.engines import TrainSettings
    from tests.helpers import make_engine

    engine = make_engine("deepspeed", stage)
    module = MatrixMLP()
    muon = torch.optim.Muon(module.parameters(), lr=0.05)
    with pytest.raises(
        ValueError, match=r"cannot step Muon, whose update needs whole matrices.*engine='fsdp'"
    ):
        engine.setup_optimizers(module, [muon], [], TrainSettings(1, None, None))
