"""FSDP2 vs DeepSpeed engine at stages 1-3, and offload none / cpu / nvme, on 2 CPU ranks.

Per configuration: median step time, per-rank peak RSS (ru_maxrss growth is not per-run, so the
resident set is sampled after the run), and model-state bytes by location (``strategy.state_bytes()``).
Configurations run interleaved over rounds in one pair of processes; medians are reported.

    python benchmarks/bench_engines.py --rounds 3 --steps 12 --out benchmarks/results/engines.json
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile

from _common import MODEL, StepTimer, cpu_trainer, interleaved, token_loader, write_report

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks


def _configs(nvme_path: str) -> dict[str, dict]:
    configs = {
        f"{engine}_stage{s}": {"stage": s, "engine": engine}
        for s in (1, 2, 3)
        for engine in ("fsdp", "deepspeed")
    }
    configs["offload_none"] = {"stage": 3, "engine": "deepspeed"}
    configs["offload_cpu"] = {"stage": 3, "offload_optimizer": "cpu"}
    configs["offload_nvme"] = {"stage": 3, "offload_optimizer": "nvme", "nvme_path": nvme_path}
    configs["fsdp_offload_cpu"] = {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
    return configs


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _run(kwargs: dict, steps: int) -> dict:
    timer = StepTimer()
    trainer = cpu_trainer(ShardStrategy(**kwargs), steps, [timer])
    trainer.fit(GPTModule(**MODEL), token_loader(steps))
    return {
        "step_s": statistics.median(timer.times[2:]),
        "rss_bytes": _rss_bytes(),
        "state": trainer.strategy.state_bytes(),
    }


def _bench(rounds: int, steps: int, nvme_path: str) -> dict[str, list[dict]]:
    return interleaved(_configs(nvme_path), rounds, lambda config: _run(config, steps))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results/engines.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_nvme_") as nvme_path:
        raw = run_ranks(_bench, args.rounds, args.steps, nvme_path)[0]
    median_ms = {n: statistics.median(r["step_s"] for r in runs) * 1000 for n, runs in raw.items()}
    report = {
        "benchmark": "step time / RSS / state bytes, 2 CPU ranks (gloo), GPT 6x256 seq 128 batch 4/rank",
        "median_step_ms": median_ms,
        "fsdp_over_deepspeed": {
            f"stage{s}": median_ms[f"fsdp_stage{s}"] / median_ms[f"deepspeed_stage{s}"] for s in (1, 2, 3)
        },
        "nvme_over_cpu_offload": median_ms["offload_nvme"] / median_ms["offload_cpu"],
        "rank0_rss_mb_after_run": {n: runs[-1]["rss_bytes"] / 2**20 for n, runs in raw.items()},
        "rank0_state_bytes": {n: runs[-1]["state"] for n, runs in raw.items()},
        "targets": {"fsdp_over_deepspeed": "<= 1.0 at each stage", "nvme_over_cpu_offload": "< 3"},
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
