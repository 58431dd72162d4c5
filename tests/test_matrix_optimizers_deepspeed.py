"""``torch.optim.Muon`` under ``ShardStrategy(engine='deepspeed')`` at ZeRO-1, 2 and 3, side by side with
Lightning's ``DDPStrategy`` on the same ranks and data (clipping on, a matrix with a zero gradient): the same
losses and weights, each matrix's momentum on one rank only, and a ZeRO-3 checkpoint resumed on another world
size with every momentum moved to its new owner; a Fabric loop on both engines at stage 3 gives DDP's losses.

ZeRO hands the optimizer flat 1-D partitions (torch's Muon refuses them, ``Param gradient must be a 2D matrix``);
here each matrix is summed whole onto its owner, stepped by the user's Muon, and its update copied back into
every rank's partition. Shard-local Newton-Schulz, an update not sent back, or the momentum kept on every rank
each fail one of the assertions below.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.engines.deepspeed.whole_matrix import STATE_FILE, whole_matrix_step
from tests.test_matrix_optimizers_multirank import STEPS, WIDTH, _fit, _same

pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed]

#: ZeRO-1, 2 and 3, and ZeRO-2 with the optimizer (its fp32 partitions and state) offloaded to host memory.
CASES: dict[Any, dict[str, Any]] = {
    1: dict(stage=1),
    2: dict(stage=2),
    3: dict(stage=3),
    "2 offload": dict(stage=2, offload_optimizer="cpu"),
}


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    """DeepSpeed's fp32 master weights, whole (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        name: safe_get_full_fp32_param(p).detach().float().cpu().clone()
        for name, p in engine.module.named_parameters()
    }


def _run(strategy: Any, world: int, ckpt: str | None = None) -> dict[str, Any]:
    run = _fit(strategy, world, ckpt=ckpt)
    trainer = run["trainer"]
    out = {k: v for k, v in run.items() if k not in ("trainer", "state_bytes", "owned")}
    if isinstance(trainer.strategy, ShardStrategy):
        whole = whole_matrix_step(trainer.strategy.model)
        assert whole is not None
        out["weights"] = _weights(trainer.strategy.model)
        out["state_bytes"] = sum(t.numel() * t.element_size() for t in whole.state_tensors())
        out["momentum"] = {name: entry["momentum_buffer"].clone() for name, entry in whole.state.items()}
        out["traffic"] = dict(whole.traffic)
        out["trainer"] = trainer
    return out


def _side_by_side(root: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    world = int(os.environ["WORLD_SIZE"])  # read first: a fit can leave the environment without it
    out: dict[str, Any] = {}
    for stage, flags in CASES.items():
        run = _run(ShardStrategy(engine="deepspeed", **flags), world)
        if stage == 3:
            run["trainer"].save_checkpoint(f"{root}/muon3")
            # Resumed on the same layout at the checkpoint's step: each rank's momentum read back.
            again = _run(ShardStrategy(engine="deepspeed", stage=3), world, ckpt=f"{root}/muon3")
            out["resumed here"] = {"losses": again["losses"], "momentum": again["momentum"]}
        out[stage] = {k: v for k, v in run.items() if k != "trainer"}
    ddp = _fit(DDPStrategy(), world)
    out["ddp"] = {k: v for k, v in ddp.items() if k != "trainer"}
    out["fabric"] = _fabric_runs(world)
    return out


def _fabric_runs(world: int) -> dict[str, Any]:
    """A Fabric loop with ``torch.optim.Muon``: both engines at stage 3, and Lightning's DDP."""
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    from lightning_shard import ShardFabricStrategy

    out: dict[str, Any] = {}
    for name, strategy in {
        "fsdp": ShardFabricStrategy(stage=3),
        "deepspeed": ShardFabricStrategy(stage=3, engine="deepspeed"),
        "ddp": DDPStrategy(),
    }.items():
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, WIDTH, bias=False), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 8, bias=False)
        )
        model, optimizer = fabric.setup(model, torch.optim.Muon(model.parameters(), lr=0.05))
        g = torch.Generator().manual_seed(1 + fabric.global_rank)
        losses = []
        for _ in range(STEPS):
            loss = torch.nn.functional.mse_loss(
                model(torch.randn(4, 16, generator=g)), torch.randn(4, 8, generator=g)
            )
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out[name] = losses
    return out


def _resume(root: str) -> dict[str, Any]:
    """The 2-rank ZeRO-3 checkpoint resumed at ZeRO-1 on one rank (at its step: loaded, no step taken)."""
    run = _run(ShardStrategy(engine="deepspeed", stage=1), 1, f"{root}/muon3")
    return {k: v for k, v in run.items() if k != "trainer"}


def test_muon_under_deepspeed_zero_1_2_3_matches_ddp_with_each_momentum_on_one_rank(tmp_path):
    ranks = run_ranks(_side_by_side, str(tmp_path))
    reference_state = ranks[0]["ddp"]["state_bytes"]  # DDP: every momentum on every rank
    for rank, result in enumerate(ranks):
        assert len(result["ddp"]["losses"]) == STEPS
        for stage in CASES:
            _same(result[stage], result["ddp"], f"ZeRO-{stage}, rank {rank}")
            largest = WIDTH * WIDTH * 4
            assert 0 < result[stage]["state_bytes"] <= reference_state / 2 + largest, (stage, rank)
        # ZeRO-3 holds a slice of every matrix on each rank: each is summed onto its owner, its update sent back.
        assert result[3]["traffic"]["gathered"] > 0 and result[3]["traffic"]["broadcast"] > 0, rank
    for result in ranks:  # Fabric: both engines give DDP's losses
        for name in ("fsdp", "deepspeed"):
            torch.testing.assert_close(result["fabric"][name], result["fabric"]["ddp"], rtol=1e-5, atol=0)
    for stage in CASES:  # each matrix's momentum once across the ranks
        assert sum(r[stage]["state_bytes"] for r in ranks) == reference_state, stage
        names = [name for r in ranks for name in r[stage]["momentum"]]
        assert len(names) == len(set(names)) == 6, (stage, names)
    # Every momentum, saved by its owner, read back by the same owner (same layout) ...
    for rank, result in enumerate(ranks):
        assert result["resumed here"]["losses"] == []
        saved = result[3]["momentum"]
        assert saved.keys() == result["resumed here"]["momentum"].keys(), rank
        for name, value in saved.items():
            torch.testing.assert_close(result["resumed here"]["momentum"][name], value, rtol=0, atol=0)
    assert len(list((tmp_path / "muon3").rglob(STATE_FILE.replace("{:02d}", "*")))) == 2
    # ... and on one rank at ZeRO-1: every momentum moved to the one owner, the weights those saved.
    (alone,) = run_ranks(_resume, str(tmp_path), world_size=1)
    assert alone["losses"] == []
    saved = {name: value for r in ranks for name, value in r[3]["momentum"].items()}
    assert alone["momentum"].keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(alone["momentum"][name], value, rtol=0, atol=0, msg=name)
    for key, value in ranks[0][3]["weights"].items():
        torch.testing.assert_close(alone["weights"][key], value, rtol=0, atol=0, msg=key)
