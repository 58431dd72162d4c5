"""The dry run at scale: published models at the planner's recommendation for 64, 1024 and 8192 H100 80GB.

For each model (Llama-3 8B and 70B, Llama-3.1 405B, Qwen3-235B-A22B, DeepSeek-V3: their published configs,
shipped in ``lightning_shard/dryrun/configs``) and each world size, ``lightning-shard plan``'s recommendation
(bf16-mixed, AdamW, micro-batch 1 x 4096 tokens, 8 GPUs per node) is dry-run for the first and the last rank:
the layout, each rank's model state from its real shards beside the planner's figure (the difference in % of
the dry run's), the seconds one rank's set-up takes on this CPU, and any layout the dry run refuses with its
reason. Nothing is allocated: each rank is built on torch's fake process group with the model on meta.

    python benchmarks/bench_dryrun.py --out benchmarks/results/dryrun.json
    python benchmarks/bench_dryrun.py --smoke --out /tmp/dryrun.json        # one small model, 64 ranks
    python benchmarks/bench_dryrun.py --reshard --models llama-3-8b --worlds 1024

``--reshard`` adds, for each recommendation, its sharded checkpoint read by half the world with the same flags
(``lightning_shard.dryrun.reshard``): the seconds the plan takes, and for the first and the last loading rank the
files it opens, the bytes it keeps and the bytes of the saved chunks it touches.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _common import write_report

from lightning_shard.dryrun import PUBLISHED, dryrun, reshard
from lightning_shard.dryrun.models import build_model
from lightning_shard.planner import plan
from lightning_shard.units import format_bytes

WORLDS = (64, 1024, 8192)
DEVICE = "80GB"  # H100 80GB
SEQ_LEN = 4096


def _one(name: str, module: Any, world: int, ranks: str, reshard_too: bool = False) -> dict[str, Any]:
    start = time.perf_counter()
    result = plan(
        module=module,
        model=name,
        world_size=world,
        device_memory=DEVICE,
        precision="bf16-mixed",
        seq_len=SEQ_LEN,
        layout=True,
        gpus_per_node=8,
    )
    planned = time.perf_counter() - start
    row: dict[str, Any] = {
        "model": name,
        "world_size": world,
        "strategy": result.strategy,
        "fits": result.fits,
    }
    row["plan_seconds"] = round(planned, 2)
    if result.recommended is None:
        return {**row, "refused": "the planner has no configuration: " + " ".join(result.notes)}
    flags = result.strategy_kwargs()
    chosen = [0, world - 1] if ranks == "ends" else None
    try:
        reports = dryrun(module, flags, world, chosen, precision="bf16-mixed")
    except (ValueError, RuntimeError) as error:
        return {**row, "refused": str(error)}
    if reshard_too:
        row["reshard"] = _reshard(module, flags, world)
    row["ranks"] = [
        {
            "rank": r.rank,
            "coordinates": r.coordinates,
            "layers": [r.layers[0], r.layers[-1]] if r.layers else [],
            "experts": len(r.experts),
            "param_bytes": r.param_bytes,
            "grad_bytes": r.grad_bytes,
            "optimizer_bytes": r.optimizer_bytes,
            "model_state_bytes": r.model_state_bytes,
            "planner_model_state_bytes": sum(r.planner.values()) if r.planner else None,
            "difference_pct": r.difference("model_state"),
            "checkpoint_bytes": r.checkpoint_bytes,
            "build_seconds": r.build_seconds,
        }
        for r in reports
    ]
    return row


def _reshard(module: Any, flags: dict[str, Any], world: int) -> dict[str, Any]:
    """The recommendation's checkpoint read by ``world // 2`` ranks with the same flags."""
    half = world // 2
    try:
        result = reshard(module, flags, world, flags, half, [0, half - 1], precision="bf16-mixed")
    except (ValueError, RuntimeError) as error:
        return {"load_world_size": half, "refused": str(error)}
    document = result.to_dict()
    for rank in document["ranks"]:
        rank["files"] = len(rank["files"])
    return document


def _line(row: dict[str, Any]) -> list[str]:
    head = f"| {row['model']} | {row['world_size']} | `{row['strategy']}` |"
    if "refused" in row:
        return [f"{head} refused: {row['refused'][:160]} | | |"]
    lines = []
    for r in row["ranks"]:
        ours, theirs = format_bytes(r["model_state_bytes"]), format_bytes(r["planner_model_state_bytes"] or 0)
        diff = f"{r['difference_pct']:+.1f}%" if r["difference_pct"] is not None else "-"
        lines.append(f"{head} rank {r['rank']}: {ours} | {theirs} ({diff}) | {r['build_seconds']:.2f} s |")
    plan = row.get("reshard")
    if plan and "refused" not in plan:
        reads = "; ".join(
            f"rank {r['rank']}: {r['files']} files, {format_bytes(r['bytes'])} kept of"
            f" {format_bytes(r['chunk_bytes'])} touched"
            for r in plan["ranks"]
        )
        lines.append(f"{head} read by {plan['load_world_size']}: {reads} | | {plan['seconds']:.1f} s |")
    elif plan:
        lines.append(f"{head} read by {plan['load_world_size']}: refused: {plan['refused'][:120]} | | |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/dryrun.json")
    parser.add_argument("--models", nargs="*", default=list(PUBLISHED))
    parser.add_argument("--worlds", nargs="*", type=int, default=list(WORLDS))
    parser.add_argument(
        "--ranks", choices=["ends", "default"], default="ends", help="first and last, or dryrun's"
    )
    parser.add_argument("--smoke", action="store_true", help="llama-3-8b on 64 ranks only")
    parser.add_argument(
        "--reshard", action="store_true", help="plan each checkpoint read by half the world too"
    )
    args = parser.parse_args()
    models, worlds = (["llama-3-8b"], [64]) if args.smoke else (args.models, args.worlds)
    rows = []
    for name in models:
        start = time.perf_counter()
        module = build_model(name)
        built = time.perf_counter() - start
        for world in worlds:
            row = _one(name, module, world, args.ranks, args.reshard)
            row["model_build_seconds"] = round(built, 2)
            rows.append(row)
            print("\n".join(_line(row)), flush=True)
    table = ["| model | GPUs | recommended | model state per rank, dry run | planner (difference) | build |"]
    table.append("|---|---|---|---|---|---|")
    table += [line for row in rows for line in _line(row)]
    print("\n".join(table))
    write_report(
        {"device_memory": DEVICE, "seq_len": SEQ_LEN, "rows": rows}, args.out, printed={"rows": len(rows)}
    )


if __name__ == "__main__":
    main()
