"""Muon (``torch.optim.Muon``) at stage 3 against stage 0, on 2 and 4 CPU ranks.

    stage0    ShardStrategy(stage=0)    every rank holds every matrix and runs Newton-Schulz on all of them
    stage3    ShardStrategy(stage=3)    each matrix owned by one rank: gathered whole there, stepped, sent back

The model is a stack of ``n_layers`` residual blocks of two ``d x 4d`` matrices (no biases, no norms: Muon takes
matrices only), on random regression data.

Measured per rank, over the timed steps (the first two are warm-up), median over steps then over rounds
(configurations interleaved, the order rotated each round):

    step time         rank 0's training step
    optimizer time    from Lightning's ``on_before_optimizer_step`` (gradients ready, clipped) to the step's end:
                      the optimizer's update, with the gathers and broadcasts of stage 3
    bytes moved       what the whole-matrix step received per step (``WholeMatrixStep.traffic``): each matrix and
                      its gradient gathered whole, the owner's update broadcast; 0 at stage 0 (DDP's gradient
                      all-reduce is not counted at either stage)
    state bytes       the optimizer's state tensors on each rank (Muon: one momentum per matrix)

The goal (issue): at stage 3 each rank's state is at most 1/N of stage 0's plus the largest matrix, and the
optimizer time at most 1.5x stage 0's.

    python benchmarks/bench_matrix_optim.py --out benchmarks/results/matrix_optim.json
    python benchmarks/bench_matrix_optim.py --smoke --out /tmp/matrix_optim.json   # tiny, one round
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch
from _common import StepTimer, cpu_trainer, interleaved, write_report
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.engines.fsdp.whole_matrix import whole_matrix_step
from lightning_shard.memory import model_state_bytes

WARMUP = 2
CONFIGS = {"stage0": dict(stage=0), "stage3": dict(stage=3)}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class MatrixStack(L.LightningModule):
    def __init__(self, d: int, n_layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(x, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Muon(self.parameters(), lr=0.02)


class OptimizerTimer(L.Callback):
    """Time from the gradients being ready (``on_before_optimizer_step``) to the end of the step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)


def _run(flags: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    d, steps, batch = cfg["d_model"], cfg["steps"], cfg["batch_size"]
    g = torch.Generator().manual_seed(0)
    n = batch * steps * cfg["world"]  # Lightning's sampler gives each rank its share
    data = TensorDataset(torch.randn(n, 64, d, generator=g), torch.randn(n, 64, d, generator=g))
    step_timer, optimizer_timer = StepTimer(), OptimizerTimer()
    trainer = cpu_trainer(
        ShardStrategy(**flags),
        steps,
        [step_timer, optimizer_timer],
        devices=cfg["world"],
        gradient_clip_val=1.0,
    )
    trainer.fit(MatrixStack(d, cfg["n_layers"]), DataLoader(data, batch_size=batch))
    optimizer = trainer.optimizers[0]
    whole = whole_matrix_step(optimizer)
    traffic = {"gathered": 0, "broadcast": 0} if whole is None else whole.traffic
    return {
        "step_s": statistics.median(step_timer.times[WARMUP:]),
        "optimizer_s": statistics.median(optimizer_timer.times[WARMUP:]),
        "bytes_per_step": {k: v // steps for k, v in traffic.items()},
        "state_bytes": model_state_bytes(trainer.lightning_module, [optimizer]).optimizer,
        "owned": None if whole is None else len(whole.stand_ins),
    }


def _bench(cfg: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return interleaved(CONFIGS, cfg["rounds"], lambda flags: _run(flags, cfg))


def summarize(
    world: int, per_rank: list[dict[str, list[dict[str, Any]]]], cfg: dict[str, Any]
) -> dict[str, Any]:
    d, layers = cfg["d_model"], cfg["n_layers"]
    largest = 4 * d * d * 4
    out: dict[str, Any] = {}
    for name in CONFIGS:
        rank0 = per_rank[0][name]
        out[name] = {
            "median_step_ms": 1000 * statistics.median(r["step_s"] for r in rank0),
            "median_optimizer_ms": 1000 * statistics.median(r["optimizer_s"] for r in rank0),
            "state_bytes": [ranks[name][-1]["state_bytes"] for ranks in per_rank],
            "bytes_per_step": [ranks[name][-1]["bytes_per_step"] for ranks in per_rank],
            "matrices_owned": [ranks[name][-1]["owned"] for ranks in per_rank],
        }
    zero, three = out["stage0"], out["stage3"]
    total = zero["state_bytes"][0]
    out["goals"] = {
        "state_per_rank_bound_bytes": total // world + largest,
        "state_per_rank_met": max(three["state_bytes"]) <= total // world + largest,
        "optimizer_time_ratio": three["median_optimizer_ms"] / zero["median_optimizer_ms"],
        "optimizer_time_met": three["median_optimizer_ms"] <= 1.5 * zero["median_optimizer_ms"],
        "matrices": 2 * layers,
    }
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences of 64 rows per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help=f"steps per run; the first {WARMUP} are warm-up")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--smoke", action="store_true", help="d 64, 2 layers, one round of 3 steps, 2 ranks")
    parser.add_argument("--out", default="benchmarks/results/matrix_optim.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.d_model, args.n_layers, args.rounds, args.steps, args.worlds = 64, 2, 1, 3, [2]
    if args.steps <= WARMUP:
        parser.error(
            f"--steps {args.steps}: the first {WARMUP} steps are warm-up; use --steps {WARMUP + 1} or more"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = {}
    for world in args.worlds:
        cfg = dict(
            world=world,
            d_model=args.d_model,
            n_layers=args.n_layers,
            batch_size=args.batch_size,
            rounds=args.rounds,
            steps=args.steps,
        )
        results[str(world)] = summarize(world, run_ranks(_bench, cfg, world_size=world), cfg)
    report = {
        "benchmark": "bench_matrix_optim",
        "smoke": args.smoke,
        "model": {"d_model": args.d_model, "n_layers": args.n_layers, "matrices": 2 * args.n_layers},
        "timed_steps_per_run": args.steps - WARMUP,
        "rounds": args.rounds,
        "results": results,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
