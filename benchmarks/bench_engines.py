"""FSDP2 vs DeepSpeed engine at stages 1-3, and offload none / cpu / nvme, on 2 CPU ranks.

Per configuration: median step time, per-rank peak RSS (ru_maxrss growth is not per-run, so the
resident set is sampled after the run), and model-state bytes by location (``strategy.state_bytes()``).
Configurations run interleaved over rounds in one pair of processes; medians are reported.

    python benchmarks/bench_engines.py --rounds 5 --steps 12 --out benchmarks/results/engines.json
    python benchmarks/bench_engines.py --only fsdp_stage2 deepspeed_stage2 --profile   # + chrome traces

``--profile`` adds one profiled run per configuration after the timed ones (``torch.profiler`` over
three steps): a chrome trace per configuration under ``benchmarks/results/traces/`` (open it in
``chrome://tracing`` or Perfetto) and the ops with the most self CPU time in the JSON.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
from pathlib import Path

from _common import MODEL, Profile, StepTimer, cpu_trainer, interleaved, token_loader, write_report

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


def _run(kwargs: dict, steps: int, model: dict, trace: str | None = None) -> dict:
    timer = StepTimer()
    profile = Profile(trace) if trace is not None else None
    trainer = cpu_trainer(ShardStrategy(**kwargs), steps, [timer] + ([profile] if profile else []))
    trainer.fit(GPTModule(**model), token_loader(steps))
    return {
        "step_s": statistics.median(timer.times[2:]),
        "rss_bytes": _rss_bytes(),
        "state": trainer.strategy.state_bytes(),
        **({"profile": profile.table} if profile else {}),
    }


def _bench(
    rounds: int, steps: int, nvme_path: str, only: list[str] | None, traces: str | None, model: dict
) -> dict:
    configs = {n: c for n, c in _configs(nvme_path).items() if only is None or n in only}
    if rounds == 0:  # --smoke --profile: one profiled run per configuration is also its timed run
        raw = {n: [_run(c, max(steps, 6), model, f"{traces}/{n}.json")] for n, c in configs.items()}
        return {"raw": raw, "profiles": {n: runs[0]["profile"] for n, runs in raw.items()}}
    raw = interleaved(configs, rounds, lambda config: _run(config, steps, model))
    if traces is None:
        return {"raw": raw}
    profiles = {n: _run(c, max(steps, 6), model, f"{traces}/{n}.json")["profile"] for n, c in configs.items()}
    return {"raw": raw, "profiles": profiles}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", nargs="+", default=None, help="configuration names (default: all)")
    parser.add_argument("--profile", action="store_true", help="also profile each configuration")
    parser.add_argument(
        "--smoke", action="store_true", help="GPT 2 x 64, one run per configuration (the suite's check)"
    )
    parser.add_argument("--out", default="benchmarks/results/engines.json")
    args = parser.parse_args()
    model = dict(MODEL, n_layers=2, d_model=64) if args.smoke else MODEL
    if args.smoke:
        args.rounds, args.steps = (0 if args.profile else 1), 4
    unknown = set(args.only or ()) - set(_configs(""))
    if unknown:
        parser.error(f"--only {sorted(unknown)}: not configurations; choose from {sorted(_configs(''))}")
    traces = str(Path(args.out).parent / "traces") if args.profile else None
    with tempfile.TemporaryDirectory(prefix="bench_nvme_") as nvme_path:
        result = run_ranks(_bench, args.rounds, args.steps, nvme_path, args.only, traces, model)[0]
    raw = result["raw"]
    median_ms = {n: statistics.median(r["step_s"] for r in runs) * 1000 for n, runs in raw.items()}
    pairs = [s for s in (1, 2, 3) if f"fsdp_stage{s}" in median_ms and f"deepspeed_stage{s}" in median_ms]
    report = {
        "benchmark": "step time / RSS / state bytes, 2 CPU ranks (gloo), GPT"
        f" {model['n_layers']}x{model['d_model']} seq {model['seq_len']} batch 4/rank",
        "median_step_ms": median_ms,
        "step_ms_per_round": {n: [r["step_s"] * 1000 for r in runs] for n, runs in raw.items()},
        "rounds": args.rounds,
        "fsdp_over_deepspeed": {
            f"stage{s}": median_ms[f"fsdp_stage{s}"] / median_ms[f"deepspeed_stage{s}"] for s in pairs
        },
        **(
            {"nvme_over_cpu_offload": median_ms["offload_nvme"] / median_ms["offload_cpu"]}
            if {"offload_nvme", "offload_cpu"} <= set(median_ms)
            else {}
        ),
        "rank0_rss_mb_after_run": {n: runs[-1]["rss_bytes"] / 2**20 for n, runs in raw.items()},
        "rank0_state_bytes": {n: runs[-1]["state"] for n, runs in raw.items()},
        "targets": {"fsdp_over_deepspeed": "<= 0.9 at each stage", "nvme_over_cpu_offload": "< 3"},
        **({"profiles": result["profiles"], "traces": traces} if "profiles" in result else {}),
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
