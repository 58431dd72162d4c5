"""FSDP2 vs DeepSpeed engine at stages 1-3, and offload none / cpu / nvme, on 2 CPU ranks; and the two engines on
the same tensor-parallel and HSDP layouts, on 2 and 4 CPU ranks.

The layout rows train a Hugging Face Llama at the demo GPT's shape (6 x 256, 4 heads, seq 128, batch 4 per
data-parallel rank), which both engines split by its own plan (``config.base_model_tp_plan``: DeepSpeed's AutoTP
and the FSDP engine's ``parallelize_module`` alike):

    row       ranks  FSDP engine                         DeepSpeed engine
    tp2       2      stage 2, tensor_parallel_size=2     ZeRO-1, tensor_parallel_size=2
    tp2_dp2   4      stage 2, tensor_parallel_size=2     ZeRO-1, tensor_parallel_size=2
    hsdp      4      stage 3, replicate_size=2 (2 x 2)   ZeRO-3 over all 4 ranks

FSDP2 refuses tensor parallelism at stage 1 (ZeroRedundancyOptimizer takes no DTensor) and names stage 2, the
same all-reduce volume with the gradients sharded too; the DeepSpeed engine refuses ``replicate_size``, and its
nearest layout is ZeRO-3 over every rank. Each row's JSON carries the refusal as the engine words it.

Per configuration: median step time, per-rank peak RSS (ru_maxrss growth is not per-run, so the
resident set is sampled after the run), and model-state bytes by location (``strategy.state_bytes()``).
Configurations of one world size run interleaved over rounds in one set of processes (the first two steps
of each run are warm-up); medians are reported.

    python benchmarks/bench_engines.py --rounds 5 --steps 12 --out benchmarks/results/engines.json
    python benchmarks/bench_engines.py --only fsdp_stage2 deepspeed_stage2 --profile   # + chrome traces
    python benchmarks/bench_engines.py --rounds 5 --steps 10 --only fsdp_tp2 deepspeed_tp2 fsdp_tp2_dp2 \
        deepspeed_tp2_dp2 fsdp_hsdp deepspeed_hsdp --out benchmarks/results/engines_layouts.json

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
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from _common import MODEL, Profile, StepTimer, cpu_trainer, interleaved, token_loader, write_report

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.engines import declared

#: The layout rows' Llama at the demo GPT's shape (``MODEL``): 6 x 256, 4 heads (2 per tensor-parallel rank).
LLAMA = dict(
    vocab_size=256,
    max_position_embeddings=128,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=True,
    use_cache=False,
)
#: Layout row -> (ranks, its FSDP configuration, its DeepSpeed configuration).
LAYOUTS = {
    "tp2": (2, "fsdp_tp2", "deepspeed_tp2"),
    "tp2_dp2": (4, "fsdp_tp2_dp2", "deepspeed_tp2_dp2"),
    "hsdp": (4, "fsdp_hsdp", "deepspeed_hsdp"),
}


class LlamaModule(L.LightningModule):
    """A Hugging Face ``LlamaForCausalLM`` with AdamW; ``self.config`` carries the plan both engines split by."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        import transformers  # optional: only the layout rows need it

        self.config = transformers.LlamaConfig(**config)
        self.model = transformers.LlamaForCausalLM(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _configs(nvme_path: str) -> dict[str, tuple[int, str, dict]]:
    """Configuration -> (ranks, model, ShardStrategy flags)."""
    flags = {
        f"{engine}_stage{s}": {"stage": s, "engine": engine}
        for s in (1, 2, 3)
        for engine in ("fsdp", "deepspeed")
    }
    flags["offload_none"] = {"stage": 3, "engine": "deepspeed"}
    flags["offload_cpu"] = {"stage": 3, "offload_optimizer": "cpu"}
    flags["offload_nvme"] = {"stage": 3, "offload_optimizer": "nvme", "nvme_path": nvme_path}
    flags["fsdp_offload_cpu"] = {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
    configs = {name: (2, "gpt", f) for name, f in flags.items()}
    for ranks, tp in ((2, "tp2"), (4, "tp2_dp2")):
        configs[f"fsdp_{tp}"] = (ranks, "llama", {"engine": "fsdp", "stage": 2, "tensor_parallel_size": 2})
        configs[f"deepspeed_{tp}"] = (
            ranks,
            "llama",
            {"engine": "deepspeed", "stage": 1, "tensor_parallel_size": 2},
        )
    configs["fsdp_hsdp"] = (4, "llama", {"engine": "fsdp", "stage": 3, "replicate_size": 2})
    configs["deepspeed_hsdp"] = (4, "llama", {"engine": "deepspeed", "stage": 3})
    return configs


#: What each layout row would have run on the side that refuses it: FSDP2's tensor parallelism at stage 1 (it runs
#: stage 2 instead), the DeepSpeed engine's replicate_size (it runs ZeRO-3 over every rank instead).
REFUSED = {
    "tp2": {"engine": "fsdp", "stage": 1, "tensor_parallel_size": 2},
    "tp2_dp2": {"engine": "fsdp", "stage": 1, "tensor_parallel_size": 2},
    "hsdp": {"engine": "deepspeed", "stage": 3, "replicate_size": 2},
}


def _refusal(flags: dict) -> str:
    try:
        ShardStrategy(**flags)
    except ValueError as err:
        return str(err)
    raise AssertionError(f"ShardStrategy(**{flags}) is accepted now: measure it in its row")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _run(config: tuple[int, str, dict], steps: int, sizes: dict, trace: str | None = None) -> dict:
    ranks, model, flags = config
    timer = StepTimer()
    profile = Profile(trace) if trace is not None else None
    callbacks = [timer] + ([profile] if profile else [])
    trainer = cpu_trainer(ShardStrategy(**flags), steps, callbacks, devices=ranks)
    module = GPTModule(**sizes["gpt"]) if model == "gpt" else LlamaModule(**sizes["llama"])
    # Lightning's sampler splits the rows over the data-parallel ranks: batch 4 on each.
    trainer.fit(module, token_loader(steps, world_size=ranks, model=sizes["gpt"]))
    return {
        "step_s": statistics.median(timer.times[2:]),
        "rss_bytes": _rss_bytes(),
        "state": trainer.strategy.state_bytes(),
        **({"profile": profile.table} if profile else {}),
    }


def _bench(rounds: int, steps: int, configs: dict, traces: str | None, sizes: dict) -> dict:
    if rounds == 0:  # --smoke --profile: one profiled run per configuration is also its timed run
        raw = {n: [_run(c, max(steps, 6), sizes, f"{traces}/{n}.json")] for n, c in configs.items()}
        return {"raw": raw, "profiles": {n: runs[0]["profile"] for n, runs in raw.items()}}
    raw = interleaved(configs, rounds, lambda config: _run(config, steps, sizes))
    if traces is None:
        return {"raw": raw}
    profiles = {n: _run(c, max(steps, 6), sizes, f"{traces}/{n}.json")["profile"] for n, c in configs.items()}
    return {"raw": raw, "profiles": profiles}


def _layout_rows(median_ms: dict[str, float], configs: dict) -> dict[str, dict]:
    """Every layout row (``None``: not measured in this run), with the refusal that chose one side's configuration
    as the strategy words it; the DeepSpeed engine's reason for refusing ``replicate_size`` as its capabilities
    declare it."""
    rows = {}
    for row, (ranks, fsdp, deepspeed) in LAYOUTS.items():
        rows[row] = {
            "ranks": ranks,
            "fsdp": {"flags": configs[fsdp][2], "median_step_ms": median_ms.get(fsdp)},
            "deepspeed": {"flags": configs[deepspeed][2], "median_step_ms": median_ms.get(deepspeed)},
            "refused": {"flags": REFUSED[row], "message": _refusal(REFUSED[row])},
        }
    rows["hsdp"]["refused"]["reason"] = declared("deepspeed").absent_because["replicate"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", nargs="+", default=None, help="configuration names (default: all)")
    parser.add_argument("--profile", action="store_true", help="also profile each configuration")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="GPT and Llama 2 x 64, one run per configuration (the suite's check)",
    )
    parser.add_argument("--max-ranks", type=int, default=4, help="leave out the configurations on more ranks")
    parser.add_argument("--out", default="benchmarks/results/engines.json")
    args = parser.parse_args()
    sizes = {"gpt": MODEL, "llama": LLAMA}
    if args.smoke:
        sizes = {
            "gpt": dict(MODEL, n_layers=2, d_model=64),
            "llama": dict(LLAMA, num_hidden_layers=2, hidden_size=64, intermediate_size=128),
        }
        args.rounds, args.steps = (0 if args.profile else 1), 4
    all_configs = _configs("")
    unknown = set(args.only or ()) - set(all_configs)
    if unknown:
        parser.error(f"--only {sorted(unknown)}: not configurations; choose from {sorted(all_configs)}")
    traces = str(Path(args.out).parent / "traces") if args.profile else None
    raw: dict[str, list[dict]] = {}
    profiles: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_nvme_") as nvme_path:
        configs = {
            n: c
            for n, c in _configs(nvme_path).items()
            if (args.only is None or n in args.only) and c[0] <= args.max_ranks
        }
        for ranks in sorted({c[0] for c in configs.values()}):
            group = {n: c for n, c in configs.items() if c[0] == ranks}
            result = run_ranks(_bench, args.rounds, args.steps, group, traces, sizes, world_size=ranks)[0]
            raw |= result["raw"]
            profiles |= result.get("profiles", {})
    median_ms = {n: statistics.median(r["step_s"] for r in runs) * 1000 for n, runs in raw.items()}
    stages = {f"stage{s}": (f"fsdp_stage{s}", f"deepspeed_stage{s}") for s in (1, 2, 3)}
    pairs = stages | {row: (fsdp, ds) for row, (_, fsdp, ds) in LAYOUTS.items()}
    report = {
        "benchmark": "step time / RSS / state bytes, CPU ranks (gloo); stage rows: 2 ranks, GPT"
        f" {sizes['gpt']['n_layers']}x{sizes['gpt']['d_model']}; layout rows: Hugging Face Llama"
        f" {sizes['llama']['num_hidden_layers']}x{sizes['llama']['hidden_size']}; seq"
        f" {sizes['gpt']['seq_len']}, batch 4 per data-parallel rank",
        "median_step_ms": median_ms,
        "step_ms_per_round": {n: [r["step_s"] * 1000 for r in runs] for n, runs in raw.items()},
        "rounds": args.rounds,
        "fsdp_over_deepspeed": {
            row: median_ms[fsdp] / median_ms[ds]
            for row, (fsdp, ds) in pairs.items()
            if fsdp in median_ms and ds in median_ms
        },
        **(
            {"nvme_over_cpu_offload": median_ms["offload_nvme"] / median_ms["offload_cpu"]}
            if {"offload_nvme", "offload_cpu"} <= set(median_ms)
            else {}
        ),
        "layouts": _layout_rows(median_ms, all_configs),
        "rank0_rss_mb_after_run": {n: runs[-1]["rss_bytes"] / 2**20 for n, runs in raw.items()},
        "rank0_state_bytes": {n: runs[-1]["state"] for n, runs in raw.items()},
        "targets": {"fsdp_over_deepspeed": "<= 0.9 at each stage", "nvme_over_cpu_offload": "< 3"},
        **({"profiles": profiles, "traces": traces} if profiles else {}),
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
