"""Training across slow links: 2 replica groups of 2 CPU ranks each, joined by a link much slower than the one
inside a group. What each way of training crosses that link per step, what a step then costs, and what it costs
in loss, on the demo GPT (the byte-level text of ``examples/fault_tolerance``), the same steps and tokens each:

    hsdp          one 4-rank job, ``ShardStrategy(stage=3, replicate_size=2)``: every step all-reduces each
                  rank's gradient shard with the same rank of the other group (the replicate dimension)
    diloco_H      2 replica groups (``fault_tolerance``, a Lighthouse in this process), stage 3, each training alone
                  and every H steps the weight change averaged across groups and stepped by DiLoCo's outer SGD
    streaming     the same with ``fragments=2`` (one half of the parameters synced every H / 2 steps)
    onebit_adam   one 4-rank job at stage 0, ``gradient_compression={"method": "onebit_adam", "freeze_step": f}``

Rank ``r`` of group ``g`` reads what rank ``2g + r`` of the 4-rank jobs reads (a ``DistributedSampler`` of 4).

Cross-group bytes per step (of one group; the link carries what its 2 ranks send), with P the parameter count,
G = 2 groups, W = 4 ranks, fp32:

    hsdp          2 (G - 1) / G * 4 P: a ring all-reduce of the gradients over the groups (each rank its shard of
                  P / 2), counted from P (FSDP's shard padding left out)
    diloco_H      the ``ft/cross_group_bytes`` the strategy logs (the all-reduced pseudo-gradients' bytes, this
                  rank's shards), summed over the group's ranks, times 2 (G - 1) / G (1 at G = 2) as above, / steps
    onebit_adam   after the warm-up: what ``CompressedAllreduce`` counts as sent per rank (the momentum's signs,
                  8 per byte, out to the servers and back, plus 2 fp32 scales per peer), of which the share going
                  to the other group's ranks, 2 of each rank's 3 peers; in the ``f`` warm-up steps DDP's full
                  fp32 ring all-reduce over the 4 ranks, one of whose ring links leaves each group:
                  2 (W - 1) / W * 4 P. The run's mean counts both; the after-warm-up figure the compressed steps

The slow link is simulated, not throttled: a step over it takes the measured step time (the mean over the steps
after the first 2, on this machine's loopback) plus cross-group bytes per step / ``--link-bandwidth`` (bytes/s,
default 1e8: about 1 Gbit/s). The final loss is the training loss of the last steps, averaged over the 4 ranks.
Goals, printed beside the figures (not asserted): bytes per step <= 1/H of HSDP's with DiLoCo, <= 1/16 of it with
1-bit Adam after the warm-up, and the final loss within 5% of HSDP's at H = 32.

    python benchmarks/bench_slow_links.py --out benchmarks/results/slow_links.json
    python benchmarks/bench_slow_links.py --steps 8 --h 2 4 --out /tmp/slow_links.json   # the smoke size
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

import lightning as L
from _common import StepTimer, interleaved, write_report
from torch.utils.data import DataLoader, DistributedSampler

from lightning_shard import ShardStrategy
from lightning_shard.demos.gpt import CharDataset, GPTModule, generate_text
from lightning_shard.demos.ranks import free_port, run_ranks

GROUPS, RANKS = 2, 2
WORLD = GROUPS * RANKS
RING = 2 * (GROUPS - 1) / GROUPS  # a ring all-reduce over the groups sends this much of the tensor per rank
WARMUP = 2  # steps left out of the measured step time


def _model(args: dict[str, Any]) -> GPTModule:
    width = args["d_model"]
    return GPTModule(
        vocab_size=256, seq_len=args["seq_len"], d_model=width, n_layers=2, n_heads=2, max_steps=args["steps"]
    )


def _loader(args: dict[str, Any], index: int) -> DataLoader:
    """Rank ``index`` of 4's batches: what rank ``index`` of the 4-rank jobs and rank ``index % 2`` of group
    ``index // 2`` read alike."""
    dataset = CharDataset(generate_text(args["sentences"], seed=0), args["seq_len"])
    sampler = DistributedSampler(
        dataset, num_replicas=WORLD, rank=index, shuffle=True, seed=0, drop_last=True
    )
    return DataLoader(dataset, batch_size=args["batch_size"], sampler=sampler, drop_last=True)


def _strategy(run: dict[str, Any], lighthouse: str, ports: list[int]) -> tuple[ShardStrategy, int]:
    """This process's strategy and device count; a replica group's process is given its group's world (its own
    port and ranks, as a ``torchrun`` per group would)."""
    import os

    if run["kind"] == "hsdp":
        return ShardStrategy(stage=3, replicate_size=GROUPS), WORLD
    if run["kind"] == "onebit_adam":
        compression = {"method": "onebit_adam", "freeze_step": run["freeze_step"]}
        return ShardStrategy(stage=0, gradient_compression=compression), WORLD
    group, rank = divmod(int(os.environ["RANK"]), RANKS)
    world = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": RANKS, "LOCAL_WORLD_SIZE": RANKS}
    os.environ.update({k: str(v) for k, v in world.items()}, MASTER_PORT=str(ports[group]))
    ft = {"replica_id": group, "replica_groups": GROUPS, "lighthouse": lighthouse, "min_replicas": GROUPS}
    ft |= {"semi_sync": "diloco", "sync_every": run["h"], "fragments": run["fragments"], "timeout": 60}
    return ShardStrategy(stage=3, fault_tolerance=ft), RANKS


def _rank(run: dict[str, Any], args: dict[str, Any], lighthouse: str, ports: list[int]) -> dict[str, Any]:
    """One of the 4 processes of ``run``: its step times, losses and (replica groups) the strategy's metrics."""
    import os

    index = int(os.environ["RANK"])  # of the 4 processes, before a group's process is given its own world
    strategy, devices = _strategy(run, lighthouse, ports)
    timer, losses = StepTimer(), []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *rest: Any) -> None:
            losses.append(float(outputs["loss"]))

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args["steps"],
        callbacks=[timer, Losses()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(_model(args), _loader(args, index))
    replicas = trainer.strategy.replica_group
    return {"times": timer.times, "losses": losses, "metrics": replicas.metrics() if replicas else {}}


def _launch(run: dict[str, Any], args: dict[str, Any]) -> list[dict[str, Any]]:
    if run["kind"] != "diloco":
        return run_ranks(_rank, run, args, "", [], world_size=WORLD)
    from lightning_shard.fault_tolerance import serve_lighthouse

    port = free_port()
    lighthouse = serve_lighthouse(GROUPS, port, join_timeout_ms=2000, heartbeat_timeout_ms=5000)
    try:
        ports = [free_port() for _ in range(GROUPS)]
        return run_ranks(_rank, run, args, f"http://localhost:{port}", ports, world_size=WORLD)
    finally:
        lighthouse.shutdown()


def _onebit_bytes(params: int, freeze_step: int, steps: int) -> tuple[float, float]:
    """One group's cross-group bytes per step of 1-bit Adam: the run's mean, and a compressed step's
    (:class:`lightning_shard.onebit.CompressedAllreduce`'s own count of what a rank sends, for P entries)."""
    chunk = 8 * math.ceil(params / (8 * WORLD))
    packed = WORLD * chunk // 8  # the momentum's signs, 8 per byte, padded to W chunks
    sent = 2 * packed * (WORLD - 1) // WORLD + 2 * 4 * (WORLD - 1)  # per rank and step, to its W - 1 peers
    other = (GROUPS - 1) * RANKS / (WORLD - 1)  # the peers in another group
    compressed = RANKS * sent * other
    warm = 2 * (WORLD - 1) / WORLD * 4 * params  # DDP's ring: one of its links leaves the group
    warm_steps = min(freeze_step, steps)
    return (warm_steps * warm + (steps - warm_steps) * compressed) / steps, compressed


def _summary(run: dict[str, Any], ranks: list[dict[str, Any]], args: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: cross-group bytes per step (of a group), step times, final loss."""
    steps, params = args["steps"], args["params"]
    times = ranks[0]["times"][WARMUP:] or ranks[0]["times"]
    last = max(1, min(8, steps // 8))
    row: dict[str, Any] = {
        "measured_step_s": statistics.mean(times),
        "measured_median_step_s": statistics.median(times),
        "final_loss": statistics.mean(statistics.mean(r["losses"][-last:]) for r in ranks),
    }
    if run["kind"] == "hsdp":
        row["cross_group_bytes_per_step"] = RING * 4 * params
    elif run["kind"] == "diloco":
        group0 = ranks[:RANKS]
        sent = sum(r["metrics"]["ft/cross_group_bytes"] for r in group0)
        row["cross_group_bytes_per_step"] = RING * sent / steps
        row["outer_steps"] = group0[0]["metrics"]["ft/outer_steps"]
    else:
        mean, compressed = _onebit_bytes(params, run["freeze_step"], steps)
        row["cross_group_bytes_per_step"] = mean
        row["cross_group_bytes_per_step_after_warmup"] = compressed
    row["throttled_step_s"] = row["measured_step_s"] + row["cross_group_bytes_per_step"] / args["bandwidth"]
    return row


def _runs(hs: list[int], streaming_h: int, freeze_step: int) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {"hsdp": {"kind": "hsdp"}}
    runs |= {f"diloco_{h}": {"kind": "diloco", "h": h, "fragments": 1} for h in hs}
    runs["streaming"] = {"kind": "diloco", "h": streaming_h, "fragments": 2}
    runs["onebit_adam"] = {"kind": "onebit_adam", "freeze_step": freeze_step}
    return runs


def _compare(median: dict[str, dict[str, Any]], hs: list[int]) -> dict[str, Any]:
    """Each run over HSDP, and the goals beside the figures."""
    base = median["hsdp"]
    ratios = {
        name: {
            "bytes_over_hsdp": m["cross_group_bytes_per_step"] / base["cross_group_bytes_per_step"],
            "loss_over_hsdp": m["final_loss"] / base["final_loss"],
            "throttled_step_over_hsdp": m["throttled_step_s"] / base["throttled_step_s"],
        }
        for name, m in median.items()
    }
    onebit = median["onebit_adam"]["cross_group_bytes_per_step_after_warmup"]
    ratios["onebit_adam"]["bytes_after_warmup_over_hsdp"] = onebit / base["cross_group_bytes_per_step"]
    goals: dict[str, Any] = {}
    for h in hs:
        value = ratios[f"diloco_{h}"]["bytes_over_hsdp"]
        goals[f"diloco_{h} bytes/step <= 1/{h} of hsdp's"] = {
            "value": value,
            "goal": 1 / h,
            "met": value <= 1 / h,
        }
    value = ratios["onebit_adam"]["bytes_after_warmup_over_hsdp"]
    goals["onebit_adam bytes/step after warm-up <= 1/16 of hsdp's"] = {
        "value": value,
        "goal": 1 / 16,
        "met": value <= 1 / 16,
    }
    if 32 in hs:
        value = ratios["diloco_32"]["loss_over_hsdp"]
        goals["diloco_32 final loss within 5% of hsdp's"] = {
            "value": value,
            "goal": 1.05,
            "met": value <= 1.05,
        }
    return {"over_hsdp": ratios, "goals": goals}


def _arguments() -> tuple[argparse.Namespace, list[int], int, int]:
    """The command line; the H values, the streaming run's H and 1-bit Adam's ``freeze_step``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--h", type=int, nargs="+", default=[8, 32, 128], help="DiLoCo's sync_every values")
    parser.add_argument(
        "--streaming-h", type=int, default=None, help="H of the 2-fragment run (the --h median)"
    )
    parser.add_argument(
        "--freeze-step", type=int, default=None, help="1-bit Adam's warm-up (steps // 8, at least 2)"
    )
    parser.add_argument("--d-model", type=int, default=32, help="the demo GPT's width (2 layers, 2 heads)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--link-bandwidth", type=float, default=1e8, help="the simulated link, bytes/s")
    parser.add_argument("--rounds", type=int, default=1, help="every run R times, in rotated order; medians")
    parser.add_argument("--out", default="benchmarks/results/slow_links.json")
    args = parser.parse_args()
    hs = sorted(set(args.h))
    streaming_h = args.streaming_h or hs[len(hs) // 2]
    # (freeze_step=1 diverges here: a variance frozen after one step is one batch's squared gradient)
    freeze_step = args.freeze_step or max(2, args.steps // 8)
    if hs[0] < 1 or streaming_h < 2 or args.steps < max(hs + [streaming_h]):
        parser.error(
            f"--h {args.h} --streaming-h {streaming_h}: each H in [1, --steps {args.steps}], streaming's >= 2"
        )
    return args, hs, streaming_h, freeze_step


BYTES_COUNTED = {
    "hsdp": "counted from the parameter count P: a ring all-reduce over the groups, 2 (G - 1) / G * 4 P",
    "diloco": "the strategy's ft/cross_group_bytes summed over the group's ranks, times 2 (G - 1) / G, / steps",
    "onebit_adam": (
        "counted from P as onebit.CompressedAllreduce counts what a rank sends (signs 8 per byte out and back,"
        " 2 fp32 scales per peer), the share to the other group's ranks (2 of 3 peers); warm-up steps: DDP's"
        " fp32 ring over the 4 ranks, 2 (W - 1) / W * 4 P per group"
    ),
}


def main() -> None:
    args, hs, streaming_h, freeze_step = _arguments()
    tokens = args.steps * WORLD * args.batch_size * (args.seq_len + 1)
    shared = {
        "steps": args.steps,
        "d_model": args.d_model,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "sentences": tokens // 20 + 100,  # about 33 bytes a sentence: every rank's steps in one epoch
        "bandwidth": args.link_bandwidth,
    }
    shared["params"] = sum(p.numel() for p in _model(shared).parameters())
    runs = _runs(hs, streaming_h, freeze_step)
    raw = interleaved(runs, args.rounds, lambda run: _summary(run, _launch(run, shared), shared))
    median = {n: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for n, rows in raw.items()}
    report = {
        "benchmark": (
            f"slow links: {GROUPS} groups x {RANKS} CPU ranks (gloo), demo GPT 2x{args.d_model} seq {args.seq_len}"
            f" batch {args.batch_size}/rank ({shared['params']} parameters), {args.steps} steps,"
            f" medians of {args.rounds} round(s)"
        ),
        "link": {
            "bandwidth_bytes_per_s": args.link_bandwidth,
            "throttle": "simulated: throttled_step_s = measured_step_s + cross_group_bytes_per_step / bandwidth",
        },
        "bytes": "cross-group bytes of one group per step (what its ranks send over the link), fp32",
        "bytes_counted": BYTES_COUNTED,
        "runs": runs | {"hsdp": {"kind": "hsdp", "strategy": "ShardStrategy(stage=3, replicate_size=2)"}},
        "median": median,
        **_compare(median, hs),
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
