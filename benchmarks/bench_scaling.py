"""How cost grows: per-rank model-state bytes, activation bytes and step time against model size and
world size, at ZeRO stages 0-3 on both engines, with the ZeRO formula beside every measured point.

    python benchmarks/bench_scaling.py --out benchmarks/results/scaling.json --plot docs/img/scaling.png
    python benchmarks/bench_scaling.py --smoke --out /tmp/scaling.json          # 2 sizes, fsdp, ~30 s

Models: the demo GPT (d_model 256, vocab 256, seq 128, 4 heads, tied head) with 1, 2, 4 and 8 blocks.
A block is 12d² + 13d parameters; the embeddings and the final norm (98,816) are fixed, so the counts
grow x1, x1.89, x3.67, x7.22 rather than exactly x1..x8 (the x-axis is the real count).

The ZeRO formula, for Ψ parameters over N data-parallel ranks with fp32 weights and AdamW (two fp32
states per parameter, so K = 8 bytes), per rank:

    stage 0:  4Ψ params + 4Ψ grads   + 8Ψ optimizer       = 16Ψ
    stage 1:  4Ψ        + 4Ψ         + 8Ψ/N               = 8Ψ + 8Ψ/N
    stage 2:  4Ψ        + 4Ψ/N       + 8Ψ/N               = 4Ψ + 12Ψ/N
    stage 3:  4Ψ/N      + 4Ψ/N       + 8Ψ/N               = 16Ψ/N

Measured bytes are ``trainer.strategy.state_bytes()`` on every rank after the last step; the JSON keeps
the largest rank's. Beside them: the formula, ``lightning_shard.planner.plan`` for the same model, and
what each engine holds at rest (``engine_at_rest``: FSDP2 keeps stage-2 parameters sharded between
steps; DeepSpeed frees gradients after the step and keeps an fp32 master partition in the optimizer).
Activation bytes do not depend on stage or world size under data parallelism (each rank runs the whole
model on its own micro-batch), so they are measured once per size on one process with
``activation_checkpointing.measure``. Step time: median of each run's steps after two warm-up steps,
median over rounds; one launch per world size runs every configuration, interleaved over rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from typing import Any

import torch
from _common import MODEL, StepTimer, cpu_trainer, interleaved, token_loader, write_report

from lightning_shard import ShardStrategy
from lightning_shard.activation_checkpointing import measure
from lightning_shard.demos import GPT, GPTModule
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.planner import plan

KINDS = ("parameters", "gradients", "optimizer")
MIB = 2**20
NOTES = {
    "activations": "Activation bytes depend on the model and the per-rank micro-batch only: under data parallelism"
    " every rank runs the whole model on its own micro-batch at every stage, so they are measured once per"
    " size (one process, activation_checkpointing.measure) and are the same for every stage and world size.",
    "measured": "Largest rank's trainer.strategy.state_bytes() after the last step (model state at rest).",
    "fsdp_stage2": "FSDP2 keeps stage-2 parameters sharded between steps (gathered from forward to backward),"
    " so at rest it holds 4Ψ/N of parameters, not the formula's 4Ψ; the planner counts the same.",
    "fsdp_stage1": "Stage 1 on the FSDP engine is ZeroRedundancyOptimizer, which gives each rank whole"
    " parameters: ranks hold unequal optimizer shards and the largest sits a few percent above 8Ψ/N.",
    "deepspeed": "DeepSpeed frees gradients after each step (0 at rest; they exist only inside the step) and,"
    " at stages 1-3, keeps an fp32 master copy of its partition next to the fp32 weights: optimizer 12Ψ/N"
    " (stage 0: plain AdamW, 8Ψ). Totals at rest: stage 0 12Ψ, stages 1-2 4Ψ + 12Ψ/N, stage 3 16Ψ/N.",
    "planner": "The planner follows the FSDP engine's layout for both engines (no engine-specific model state).",
    "planner_activations": "The planner finds blocks as a ModuleList/Sequential of two or more identical"
    " modules; a one-block GPT has none, so its activation estimate leaves the block out (n_layers=1 only).",
}


def zero_formula(psi: int, stage: int, n: int) -> dict[str, int]:
    """The ZeRO paper's per-rank bytes for fp32 weights + AdamW (module docstring)."""
    held = {
        "parameters": 4 * psi // (n if stage >= 3 else 1),
        "gradients": 4 * psi // (n if stage >= 2 else 1),
        "optimizer": 8 * psi // (n if stage >= 1 else 1),
    }
    return {**held, "total": sum(held.values())}


def engine_at_rest(psi: int, stage: int, n: int, engine: str) -> dict[str, int]:
    """What each engine holds between steps (``NOTES``): the formula with the engines' known differences."""
    if engine == "fsdp":
        held = {
            "parameters": 4 * psi // (n if stage >= 2 else 1),
            "gradients": 4 * psi // (n if stage >= 2 else 1),
            "optimizer": 8 * psi // (n if stage >= 1 else 1),
        }
    else:
        held = {
            "parameters": 4 * psi // (n if stage >= 3 else 1),
            "gradients": 0,
            "optimizer": 8 * psi if stage == 0 else 12 * psi // n,
        }
    return {**held, "total": sum(held.values())}


def _gpt_kwargs(n_layers: int) -> dict[str, Any]:
    return {**MODEL, "n_layers": n_layers}


def planner_bytes(n_layers: int, stage: int, n: int, engine: str) -> dict[str, Any]:
    """The planner's stage row for this model in ``32-true`` with AdamW, no offload, no checkpointing."""
    with torch.device("meta"):
        model = GPT(**_gpt_kwargs(n_layers))
    row = plan(
        module=model,
        world_size=n,
        device_memory="1TB",
        precision="32-true",
        optimizer="adamw",
        offload_optimizer="none",
        offload_params="none",
        activation_checkpointing="none",
        micro_batch=None,
        engine=engine,
    ).stages[stage]
    held = {kind: getattr(row, kind) for kind in KINDS}
    return {**held, "total": row.model_state, "unsupported": row.unsupported}


def _run(config: dict[str, Any], steps: int, world_size: int, micro_batch: int) -> dict[str, Any]:
    timer = StepTimer()
    strategy = ShardStrategy(stage=config["stage"], engine=config["engine"])
    trainer = cpu_trainer(strategy, steps, [timer], devices=world_size)
    torch.manual_seed(0)
    trainer.fit(GPTModule(**_gpt_kwargs(config["n_layers"])), token_loader(steps, micro_batch, world_size))
    state = trainer.strategy.state_bytes()
    return {
        "step_s": statistics.median(timer.times[2:]),  # the first two steps warm up allocators and gloo
        "state": {kind: sum(state[kind].values()) for kind in KINDS} | {"total": state["total"]},
    }


def _bench(
    configs: dict[str, dict[str, Any]], rounds: int, steps: int, world_size: int, micro_batch: int
) -> dict[str, list[dict[str, Any]]]:
    return interleaved(configs, rounds, lambda config: _run(config, steps, world_size, micro_batch))


def _configs(sizes: list[int], stages: list[int], engines: list[str]) -> dict[str, dict[str, Any]]:
    return {
        f"L{n_layers}_{engine}_stage{stage}": {"n_layers": n_layers, "stage": stage, "engine": engine}
        for n_layers in sizes
        for engine in engines
        for stage in stages
    }


def _sizes(sizes: list[int], micro_batch: int) -> dict[int, dict[str, Any]]:
    """Parameter count and activation bytes per size (one process; independent of stage and world size)."""
    rows: dict[int, dict[str, Any]] = {}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (micro_batch, MODEL["seq_len"]), generator=g)  # (b, t)
    for n_layers in sizes:
        torch.manual_seed(0)
        model = GPT(**_gpt_kwargs(n_layers))
        estimate = plan(
            module=model, device_memory="1TB", precision="32-true", micro_batch=micro_batch
        ).stages[0]
        rows[n_layers] = {
            "n_layers": n_layers,
            "params": sum(p.numel() for p in model.parameters()),  # the tied head counted once
            "activation_bytes": measure(model, tokens).activation_bytes,
            "planner_activation_bytes": estimate.activations,
        }
    smallest = rows[min(rows)]["params"]
    for row in rows.values():
        row["params_over_smallest"] = row["params"] / smallest
    return rows


def _point(
    config: dict[str, Any], psi: int, world_size: int, per_rank: list[list[dict[str, Any]]]
) -> dict[str, Any]:
    """One (size, world size, stage, engine) point: ``per_rank[r]`` is rank r's runs, one per round."""
    last = [runs[-1]["state"] for runs in per_rank]
    measured = max(last, key=lambda state: state["total"])
    formula = zero_formula(psi, config["stage"], world_size)
    planner = planner_bytes(config["n_layers"], config["stage"], world_size, config["engine"])
    at_rest = engine_at_rest(psi, config["stage"], world_size, config["engine"])
    rank0_steps = [run["step_s"] * 1000 for run in per_rank[0]]
    return {
        **config,
        "params": psi,
        "world_size": world_size,
        "measured": measured,
        "measured_total_per_rank": [state["total"] for state in last],
        "zero_formula": formula,
        "planner": planner,
        "engine_at_rest": at_rest,
        "measured_over_formula": measured["total"] / formula["total"],
        "measured_over_planner": measured["total"] / planner["total"],
        "measured_over_engine_at_rest": measured["total"] / at_rest["total"],
        "step_ms": statistics.median(rank0_steps),
        "step_ms_per_round": rank0_steps,
    }


def _budget_table(budget: float, world_sizes: list[int]) -> dict[str, dict[str, float]]:
    """Largest Ψ whose model state alone fits ``budget`` bytes per rank, by the formula (16Ψ at Ψ=1)."""
    return {
        f"stage{stage}": {
            str(n): budget / zero_formula(1_000_000, stage, n)["total"] * 1e6 for n in world_sizes
        }
        for stage in range(4)
    }


MARKERS = {"fsdp": "o", "deepspeed": "x"}


def _select(points: list[dict[str, Any]], stage: int, n: int, engine: str) -> list[dict[str, Any]]:
    return [p for p in points if (p["stage"], p["world_size"], p["engine"]) == (stage, n, engine)]


def _state_panel(ax: Any, stage: int, points: list[dict[str, Any]], params: list[int], colors: dict) -> None:
    for n, color in colors.items():
        line = [zero_formula(psi, stage, n)["total"] / MIB for psi in params]
        ax.plot(params, line, "-", color=color, alpha=0.4, label=f"formula N={n}")
        for engine, marker in MARKERS.items():
            pts = _select(points, stage, n, engine)
            xs, ys = [p["params"] for p in pts], [p["measured"]["total"] / MIB for p in pts]
            ax.plot(xs, ys, marker, color=color, ms=8, mfc="none", label=f"{engine} N={n}")
    ax.set(title=f"stage {stage}", xscale="log", yscale="log", xlabel="parameters")
    ax.set(ylabel="per-rank model state (MiB)")


def _time_panel(ax: Any, points: list[dict[str, Any]], colors: dict) -> None:
    for stage, style in ((0, ":"), (3, "-")):  # the extremes; every stage's times are in the JSON
        for n, color in colors.items():
            for engine, marker in MARKERS.items():
                pts = _select(points, stage, n, engine)
                if pts:
                    xs, ys = [p["params"] for p in pts], [p["step_ms"] for p in pts]
                    ax.plot(xs, ys, style, marker=marker, color=color, label=f"{engine} N={n} stage {stage}")
    ax.set(title="step time (median)", xscale="log", yscale="log", xlabel="parameters", ylabel="ms")
    ax.legend(fontsize=7, ncols=2)


def _activation_panel(ax: Any, sizes: list[dict[str, Any]]) -> None:
    params = [row["params"] for row in sizes]
    ax.plot(params, [row["activation_bytes"] / MIB for row in sizes], "o-", label="measured")
    ax.plot(params, [row["planner_activation_bytes"] / MIB for row in sizes], "--", label="planner")
    ax.set(title="activations per rank (any stage, any N)", xscale="log", yscale="log", xlabel="parameters")
    ax.set(ylabel="MiB")
    ax.legend(fontsize=8)


def plot(report: dict[str, Any], path: str) -> None:
    """Per-rank state MiB against parameters, one panel per stage (measured markers per world size and
    engine, formula lines per world size), then step time and activation bytes."""
    try:
        # A bare Figure, not pyplot: no global backend switch and no window.
        from matplotlib.figure import Figure
    except ImportError as err:
        raise SystemExit(
            f"--plot {path} needs matplotlib, which is not installed. Run: pip install lightning-shard[plot]"
        ) from err
    points, sizes = report["points"], report["sizes"]
    colors = {n: f"C{i}" for i, n in enumerate(sorted({p["world_size"] for p in points}))}
    params = [row["params"] for row in sizes]
    fig = Figure(figsize=(15, 9), layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    for stage in range(4):
        _state_panel(axes[stage], stage, points, params, colors)
    axes[0].legend(fontsize=7, ncols=2)
    _time_panel(axes[4], points, colors)
    _activation_panel(axes[5], sizes)
    fig.savefig(path, dpi=110)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="n_layers per size")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--engines", nargs="+", default=["fsdp", "deepspeed"], choices=["fsdp", "deepspeed"])
    parser.add_argument("--steps", type=int, default=5, help="steps per run; the first two are not timed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4, help="per rank")
    parser.add_argument("--budget", type=float, default=80e9, help="per-rank bytes for the fits table")
    parser.add_argument("--smoke", action="store_true", help="sizes 1 2, N 1 2, stages 0 3, fsdp, 3 steps")
    parser.add_argument("--out", default="benchmarks/results/scaling.json")
    parser.add_argument(
        "--plot", default=None, metavar="PATH", help="also draw the figure (needs matplotlib)"
    )
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.world_sizes, args.stages, args.engines = [1, 2], [1, 2], [0, 3], ["fsdp"]
        args.steps, args.rounds = 3, 1
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: the first two steps are warm-up; use --steps 3 or more")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error(f"--plot {args.plot} needs matplotlib. Run: pip install lightning-shard[plot]")
    return args


def main() -> None:
    args = _parse()
    configs = _configs(args.sizes, args.stages, args.engines)
    sizes = _sizes(args.sizes, args.micro_batch)
    points = []
    for n in args.world_sizes:
        per_rank = run_ranks(_bench, configs, args.rounds, args.steps, n, args.micro_batch, world_size=n)
        for name, config in configs.items():
            runs = [rank_result[name] for rank_result in per_rank]
            points.append(_point(config, sizes[config["n_layers"]]["params"], n, runs))
    report = {
        "benchmark": "per-rank model state, activations and step time vs model and world size, CPU ranks (gloo)",
        "torch": torch.__version__,
        "model": {k: v for k, v in MODEL.items() if k != "n_layers"},
        "micro_batch_per_rank": args.micro_batch,
        "steps": args.steps,
        "rounds": args.rounds,
        "formula": "ZeRO, fp32 + AdamW: stage 0 4Ψ+4Ψ+8Ψ, 1 4Ψ+4Ψ+8Ψ/N, 2 4Ψ+4Ψ/N+8Ψ/N, 3 16Ψ/N",
        "notes": NOTES,
        "sizes": list(sizes.values()),
        "points": points,
        "largest_params_for_budget": {
            "budget_bytes": args.budget,
            **_budget_table(args.budget, [1, 2, 4, 8, 64]),
        },
    }
    summary = {
        f"L{p['n_layers']}_N{p['world_size']}_{p['engine']}_s{p['stage']}": (
            f"{p['measured']['total'] / MIB:.1f} MiB (formula {p['zero_formula']['total'] / MIB:.1f}), {p['step_ms']:.0f} ms"
        )
        for p in points
    }
    write_report(report, args.out, printed=summary)
    if args.plot is not None:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
