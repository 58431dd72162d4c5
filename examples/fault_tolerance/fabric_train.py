"""One replica group of a fault-tolerant Fabric loop: the demo GPT under ``ShardFabricStrategy(fault_tolerance={})``.

Launched as ``train.py`` is (one ``torchrun`` per group; ``launch.py --fabric`` does it all on one machine). The
loop is a plain Fabric loop plus one call, ``fabric.strategy.join_replica_groups(state)`` before it starts: a
restarted group returns from it holding the live groups' model, AdamW state, schedule, random generators and
``state["step"]``, and goes on from there. ``--plain`` runs the same loop as one job of ``NUM_REPLICA_GROUPS`` x
ranks (HSDP at stages 2-3, DDP at 0-1).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.utils.data import DataLoader

from lightning_shard import ShardFabricStrategy
from lightning_shard.demos.gpt import CharDataset, GPTModule, generate_text


def _wait_for(paths: list[Path], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--die-at-step", type=int, default=None, help="this group's ranks exit at that step")
    parser.add_argument("--rejoin-by-step", type=int, default=None, help="wait there for a lost group")
    parser.add_argument("--fail-at-step", type=int, default=None, help="a failed collective at that step")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps")
    parser.add_argument("--plain", action="store_true", help="one HSDP job instead of replica groups")
    args, _ = parser.parse_known_args()  # (launch.py passes train.py's arguments too)

    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))
    name = "plain" if args.plain else f"group{os.environ['REPLICA_GROUP_ID']}"
    out = args.out / "fabric"
    out.mkdir(parents=True, exist_ok=True)
    layout = (
        ({"replicate_size": groups} if args.stage >= 2 else {})
        if args.plain
        else {"fault_tolerance": {"timeout": 20}}
    )
    fabric = L.Fabric(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=ShardFabricStrategy(stage=args.stage, **layout),
    )
    fabric.launch()
    fabric.seed_everything(0)
    module = GPTModule(
        vocab_size=256, seq_len=32, d_model=32, n_layers=2, n_heads=2, max_steps=args.max_steps
    )
    # Muon on the blocks' matrices (at stages 2-3 each stepped whole on its owner), AdamW on the rest.
    matrices = [
        p for name, p in module.named_parameters() if p.dim() == 2 and name.startswith("model.blocks.")
    ]
    rest = [p for p in module.parameters() if all(p is not m for m in matrices)]
    muon, adamw = torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(rest, lr=3e-3)
    model, muon, adamw = fabric.setup(module, muon, adamw)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=args.max_steps)
    # Each rank of each group reads its share of every batch (the sampler splits over all groups' ranks).
    data = DataLoader(CharDataset(generate_text(400), seq_len=32), batch_size=4, shuffle=False)
    batches = list(fabric.setup_dataloaders(data, move_to_device=False))
    state: dict[str, Any] = {"model": model, "muon": muon, "adamw": adamw, "scheduler": scheduler, "step": 0}

    died = out / f"{name}.died"
    if not args.plain:
        if died.exists():
            died.with_suffix(".restarted").touch()
        (out / f"{name}.ready").touch()
        _wait_for([out / f"group{g}.ready" for g in range(groups)])
        fabric.strategy.join_replica_groups(state)  # a restarted group returns at the live groups' step
    started_at = state["step"]
    losses: list[float] = []
    changed: list[bool] = []  # whether each step changed this rank's weights

    def checksum() -> float:
        with torch.no_grad():
            return sum(float(getattr(p, "_local_tensor", p).double().sum()) for p in module.parameters())

    while state["step"] < args.max_steps:
        step = state["step"]
        x, y = batches[step % len(batches)]
        before = checksum()
        loss = module.pipeline_loss(model(x), y)
        if step == args.fail_at_step:  # this group's end of the cross-group collective breaks
            fabric.strategy.replica_group.pg.abort()
        fabric.backward(loss)
        if step + 1 == args.rejoin_by_step:  # a demo on one busy machine: wait until a lost group is back,
            _wait_for([d.with_suffix(".restarted") for d in out.glob("*.died")])  # before the next quorum
        if step == args.die_at_step and not died.exists():  # after the backward, before the step commits
            fabric.barrier()
            (out / f"{name}.rank{fabric.global_rank}.died.json").write_text(json.dumps({"losses": losses}))
            if fabric.global_rank == 0:
                died.touch()
            os._exit(1)  # every rank of this group dies here, mid-run
        for optimizer in (muon, adamw):
            optimizer.step()  # taken only if the step commits on every group taking part
            optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        losses.append(float(loss))
        changed.append(checksum() != before)
        time.sleep(args.step_time)

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(module, options=full)  # (the module FSDP2 sharded in place)
    # Both optimizers' state by parameter name, each entry whole (Muon's from each matrix's owner), on rank 0.
    engine = fabric.strategy.engine
    moments = {
        name: engine.optimizer_state_dict(module, optimizer.optimizer, full=True).get("state", {})
        for name, optimizer in (("muon", muon), ("adamw", adamw))
    }
    replicas = fabric.strategy.replica_group
    record = {
        "losses": losses,
        "started_at": started_at,
        "step": state["step"],
        "scheduler": scheduler.state_dict()["last_epoch"],
        "participants": replicas.participants if replicas else None,
        "heals": replicas.heals if replicas else None,
        "asked_ahead": replicas.asked_ahead if replicas else None,
        "waits": replicas.waits if replicas else None,
        "discarded": replicas.discarded if replicas else None,
        "changed": changed,
    }
    (out / f"{name}.rank{fabric.global_rank}.json").write_text(json.dumps(record))
    if fabric.global_rank == 0:
        torch.save({"weights": weights, "optimizer": moments}, out / f"{name}.pt")


if __name__ == "__main__":
    main()
