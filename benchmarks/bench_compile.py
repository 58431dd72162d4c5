"""``ShardStrategy(compile=True)`` against eager on 2 CPU ranks: step time, first-step (compile) time, recompiles.

Per configuration (stage, activation checkpointing), eager and compiled (inductor) runs alternate over
rounds in one pair of processes, so machine noise hits both alike; the report gives the median step time
of each (steps after the first two), their ratio, the first step's time (where compilation happens; later
rounds hit dynamo's and inductor's caches) and the recompiles the strategy counted.

    python benchmarks/bench_compile.py --rounds 5 --steps 12 --out benchmarks/results/compile.json
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from _common import MODEL, StepTimer, cpu_trainer, interleaved, token_loader, write_report

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks


def _configs(stages: list[int], policies: list[str]) -> dict[str, dict[str, Any]]:
    configs: dict[str, dict[str, Any]] = {}
    for stage in stages:
        for ac in (None if policy == "none" else policy for policy in policies):
            name = f"stage{stage}" + (f"_{ac}" if ac else "")
            for mode, compile in (("eager", False), ("compiled", True)):
                configs[f"{name}/{mode}"] = dict(stage=stage, activation_checkpointing=ac, compile=compile)
    return configs


def _run(flags: dict[str, Any], steps: int, model: dict[str, Any]) -> dict[str, Any]:
    timer = StepTimer()
    trainer = cpu_trainer(ShardStrategy(**flags), steps, [timer])
    trainer.fit(GPTModule(**model), token_loader(steps))
    return {
        "step_s": statistics.median(timer.times[2:]),
        "first_step_s": timer.times[0],
        "recompiles": trainer.strategy.recompiles,
    }


def _bench(
    rounds: int, steps: int, stages: list[int], policies: list[str], model: dict[str, Any]
) -> dict[str, list[dict]]:
    return interleaved(_configs(stages, policies), rounds, lambda config: _run(config, steps, model))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument(
        "--ac",
        nargs="+",
        choices=["none", "selective"],
        default=["none", "selective"],
        help="activation checkpointing",
    )
    parser.add_argument("--layers", type=int, default=MODEL["n_layers"])
    parser.add_argument("--d-model", type=int, default=MODEL["d_model"])
    parser.add_argument("--out", default="benchmarks/results/compile.json")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: at least 3 (the first two steps are not timed)")
    model = {**MODEL, "n_layers": args.layers, "d_model": args.d_model}
    raw = run_ranks(_bench, args.rounds, args.steps, args.stages, args.ac, model)[0]
    median_ms = {n: statistics.median(r["step_s"] for r in runs) * 1000 for n, runs in raw.items()}
    pairs = sorted({name.split("/")[0] for name in raw})
    report = {
        "benchmark": (
            f"torch.compile (inductor) vs eager, 2 CPU ranks (gloo), GPT {args.layers}x{args.d_model}"
            f" seq {MODEL['seq_len']} batch 4/rank, medians of {args.rounds} rounds"
        ),
        "median_step_ms": median_ms,
        "compiled_over_eager": {p: median_ms[f"{p}/compiled"] / median_ms[f"{p}/eager"] for p in pairs},
        "first_step_s": {n: [r["first_step_s"] for r in runs] for n, runs in raw.items()},
        "recompiles": {n: max(r["recompiles"] for r in runs) for n, runs in raw.items()},
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
