"""The same GPT at stage 3 with and without ``fp8`` on 2 CPU ranks: losses and bytes gathered, not speed.

For each precision (``32-true``, ``bf16-mixed``) it trains the demo GPT three ways, side by side in one
job: without fp8, with fp8 and the weights gathered in high precision, and with fp8 gathered in float8
(the default at stages 2-3). It reports each run's losses, the bytes rank 0's FSDP all-gathers delivered
per step, the float8 gather's bytes over the high-precision gather's (the converted weights travel in 1
byte instead of 2 or 4; norms, biases and embeddings do not change), whether the float8 gather gave the
same losses as the high-precision one (it casts the same bytes), and how far fp8 moved the losses.
CPUs have no float8 matmul units, so times are not reported: the GPU side is
``bench_gpu_mfu.py --modes eager compiled fp8_compiled``.

    python benchmarks/bench_fp8.py --out benchmarks/results/fp8.json
    python benchmarks/bench_fp8.py --layers 2 --d-model 64 --steps 3 --precisions 32-true   # smoke size
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import MODEL, cpu_trainer, token_loader

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks

#: Every Linear but the head: the demo GPT's layers are below the size rule's H100 break-even.
FP8 = {"filter": "all"}
RUNS = {
    "plain": False,
    "fp8_high_precision_gather": {**FP8, "enable_fsdp_float8_all_gather": False},
    "fp8": FP8,
}


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"].detach().float().clone()
        torch.distributed.all_reduce(loss)
        self.losses.append(loss.item() / torch.distributed.get_world_size())


def _fit(model: dict[str, Any], steps: int, precision: str, fp8: Any) -> dict[str, Any]:
    from lightning_shard.engines._gloo import traffic

    recorder = _Losses()
    trainer = cpu_trainer(ShardStrategy(stage=3, fp8=fp8), steps, [recorder], precision=precision)
    torch.manual_seed(0)
    module = GPTModule(**model, lr=1e-3, max_steps=steps)
    traffic.reset()
    trainer.fit(module, token_loader(steps, 4, 2, model))
    converted = [n for n, m in module.named_modules() if type(m).__name__ == "Float8Linear"]
    return {
        "losses": recorder.losses,
        "all_gather_bytes_per_step": traffic.all_gather_bytes // steps,
        "converted_layers": len(converted),
    }


def _job(model: dict[str, Any], steps: int, precisions: list[str]) -> dict[str, Any]:
    return {p: {name: _fit(model, steps, p, fp8) for name, fp8 in RUNS.items()} for p in precisions}


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    summary = {}
    for precision, runs in results.items():
        plain, high, fp8 = runs["plain"], runs["fp8_high_precision_gather"], runs["fp8"]
        summary[precision] = {
            "fp8_gather_bytes_over_high_precision": fp8["all_gather_bytes_per_step"]
            / high["all_gather_bytes_per_step"],
            "fp8_gather_losses_equal_high_precision_gather": fp8["losses"] == high["losses"],
            "fp8_max_relative_loss_change": max(
                abs(a - b) / abs(b) for a, b in zip(fp8["losses"], plain["losses"], strict=True)
            ),
            "last_loss": {name: run["losses"][-1] for name, run in runs.items()},
        }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=MODEL["n_layers"])
    parser.add_argument("--d-model", type=int, default=MODEL["d_model"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--out", default="benchmarks/results/fp8.json")
    args = parser.parse_args(argv)
    model = {**MODEL, "n_layers": args.layers, "d_model": args.d_model}
    results = run_ranks(_job, model, args.steps, args.precisions)[0]
    report = {
        "benchmark": (
            f"GPT {args.layers}x{args.d_model} (seq {model['seq_len']}), ShardStrategy(stage=3), 2 CPU ranks,"
            f" batch 4 per rank, AdamW lr 1e-3, {args.steps} steps; fp8={FP8} (every Linear but the tied head)"
        ),
        "summary": summarise(results),
        "results": results,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))


if __name__ == "__main__":
    main()
