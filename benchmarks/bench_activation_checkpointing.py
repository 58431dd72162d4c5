"""Activation bytes and step time per activation-checkpointing policy, side by side in one run.

    python benchmarks/bench_activation_checkpointing.py                      # GPT 4 x 128, seq 512, batch 8
    python benchmarks/bench_activation_checkpointing.py --seq-len 128 --rounds 5 --out ac.json

Every policy gets its own copy of one initial model. Bytes and FLOPs come from
``lightning_shard.activation_checkpointing.measure`` (allocator bytes left by the forward pass;
FlopCounterMode FLOPs). Step time is forward + backward + AdamW step; policies are timed
interleaved, round-robin, so machine noise hits them alike, and the median per policy is reported.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_shard.activation_checkpointing import (
    ActivationCheckpointing,
    apply_activation_checkpointing,
    measure,
)
from lightning_shard.demos import GPT

POLICIES: dict[str, Callable[[], ActivationCheckpointing | None]] = {
    "none": lambda: None,
    "selective": lambda: ActivationCheckpointing(policy="selective"),  # the default: every other matmul
    "selective_all_matmuls": lambda: ActivationCheckpointing(policy="selective", save_matmuls="all"),
    "full_every_2nd_block": lambda: ActivationCheckpointing(policy="full", every_n=2),
    "full": lambda: ActivationCheckpointing(policy="full"),
    "memory_budget_0.5": lambda: ActivationCheckpointing(policy="selective", memory_budget=0.5),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="> 0 sends CPU attention down the math path (t x t matrices)",
    )
    parser.add_argument(
        "--rounds", type=int, default=7, help="timed steps per policy (after one warm-up step)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 keeps noise down on shared CPUs)"
    )
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = GPT(
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        dropout=args.dropout,
    )
    idx = torch.randint(0, 256, (args.batch_size, args.seq_len), device=device)
    target = torch.randint(0, 256, (args.batch_size, args.seq_len), device=device)

    models, configs, optimizers = {}, {}, {}
    results: dict[str, dict] = {}
    for name in args.policies:
        model = copy.deepcopy(base).to(device)
        configs[name] = POLICIES[name]()
        if configs[name] is not None:
            apply_activation_checkpointing(model, configs[name])
        m = measure(model, idx)
        models[name] = model
        optimizers[name] = torch.optim.AdamW(model.parameters(), lr=1e-4)
        results[name] = {
            "activation_bytes": m.activation_bytes,
            "forward_flops": m.forward_flops,
            "backward_flops": m.backward_flops,
            "recompute_flops": m.recompute_flops,
        }

    def step(name: str) -> float:
        model, optimizer = models[name], optimizers[name]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        logits = model(idx)
        F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in args.policies}
    for name in args.policies:
        step(name)  # warm-up (allocator, lazy init)
    for _ in range(args.rounds):
        for name in args.policies:  # interleaved: noise hits every policy alike
            times[name].append(step(name))

    reference = results.get("none")
    for name in args.policies:
        r = results[name]
        r["median_step_ms"] = round(1000 * statistics.median(times[name]), 2)
        r["step_ms"] = [round(1000 * t, 2) for t in times[name]]
        r["activation_mb"] = round(r["activation_bytes"] / 1e6, 2)
        if reference is not None:
            r["bytes_vs_none"] = round(r["activation_bytes"] / reference["activation_bytes"], 3)
            r["step_time_vs_none"] = round(r["median_step_ms"] / reference["median_step_ms"], 3)
        config = configs[name]
        if config is not None and config.plans:
            r["plan"] = [list(plan.modes) for plan in config.plans]

    report = {
        "benchmark": "activation_checkpointing",
        "model": {
            k: getattr(args, k)
            for k in ("n_layers", "d_model", "n_heads", "seq_len", "batch_size", "dropout")
        },
        "rounds": args.rounds,
        "threads": args.threads,
        "device": str(device),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
