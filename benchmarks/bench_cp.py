"""Context parallelism on CPU ranks: activation memory per rank and step time of the demo GPT against the
sequence length, the measured memory ratio against 1/c, and the longest sequence a per-rank budget trains.

For each context-parallel size ``c`` (``c`` gloo ranks, one thread each) and method, the demo GPT trains a
few steps of one sequence of ``T`` tokens under ``ShardStrategy(stage=0, context_parallel_size=c)``:

* **Activation memory**: ``torch.autograd.graph.saved_tensors_hooks`` around the forward and the loss counts
  the bytes autograd keeps for backward on each rank (each storage once, parameters left out; the peak is
  at the end of the forward). With the sequence cut in ``c`` every per-token activation divides by ``c``;
  what does not is counted by the planner too: ``"allgather"`` keeps the group's keys and values (``T``
  tokens) and a ``T / c x T`` causal mask per layer; ``"ulysses"`` a ``T x T`` mask per layer.
* **Step time**: the median of the steps after the first (Lightning's batch start to batch end). Ranks
  beyond the machine's cores share them, so ``c`` > cores measures memory exactly and time only roughly.
* **Planner**: ``plan(module=..., context_parallel_size=c, ...)``'s activation bytes (activations plus the
  loss's log-softmax, fp32) for the same run, and the longest ``T`` of the grid each side puts under
  ``--budget`` bytes of activations per rank.

    python benchmarks/bench_cp.py --out benchmarks/results/cp.json
    python benchmarks/bench_cp.py --seq-lens 256 512 --cp 1 2 --steps 1 --out /tmp/cp.json   # smoke
"""

from __future__ import annotations

import argparse
import platform
import statistics
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from _common import SavedBytes, StepTimer, cpu_trainer, write_report
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPT
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.planner import plan
from lightning_shard.units import parse_size


class _Measured(L.LightningModule):
    """The demo GPT on ``(inputs, targets)``; the saved-tensor bytes of each step's forward and loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.peaks: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        saved = SavedBytes(self.model)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            logits = self.model(x)  # (1, T / c, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.peaks.append(saved.peak)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _run_one(cp: int, method: str, seq: int, steps: int, model: dict[str, int]) -> dict[str, float]:
    torch.manual_seed(0)
    module = _Measured(GPT(seq_len=seq, **model))
    tokens = torch.randint(
        0, model["vocab_size"], (steps, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)
    flags: dict[str, Any] = {"context_parallel_size": cp, "context_parallel_method": method} if cp > 1 else {}
    timer = StepTimer()
    cpu_trainer(ShardStrategy(stage=0, **flags), steps, [timer], devices=cp).fit(module, loader)
    timed = timer.times[1:] or timer.times  # the first step warms up (allocator, sockets)
    return {"peak_saved_bytes": max(module.peaks), "step_s": statistics.median(timed)}


def _bench(cp: int, methods: list[str], seqs: list[int], steps: int, model: dict[str, int]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {f"{m}/{s}": _run_one(cp, m, s, steps, model) for m in methods for s in seqs}


def _planned(cp: int, method: str, seq: int, model: dict[str, int]) -> int:
    """The planner's activation bytes per rank for this run: activations plus the loss's log-softmax."""
    result = plan(
        module=GPT(seq_len=seq, **model),
        world_size=cp,
        device_memory="1TB",
        precision="32-true",
        optimizer="sgd",
        stage=0,
        activation_checkpointing="none",
        offload_optimizer="none",
        offload_params="none",
        micro_batch=1,
        seq_len=seq,
        vocab=model["vocab_size"],  # the shape reader would take the larger position table for the vocabulary
        context_parallel_size=cp,
        context_parallel_method=method if cp > 1 else "allgather",
    )
    row = result.recommended
    assert row is not None
    return row.activations + row.buffers_detail.get("loss", 0)


def _longest(rows: dict[int, dict[str, Any]], key: str, budget: int) -> int | None:
    fitting = [seq for seq, row in rows.items() if row[key] <= budget]
    return max(fitting) if fitting else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--methods", nargs="+", default=["allgather", "ulysses"], choices=["allgather", "ulysses"]
    )
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is not timed")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument(
        "--budget", default="256MiB", help="activation bytes per rank for the longest-sequence test"
    )
    parser.add_argument("--out", default="benchmarks/results/cp.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    model = {"vocab_size": 256, "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads}
    budget = parse_size(args.budget, "--budget")
    results: dict[str, Any] = {}
    for cp in args.cp:
        methods = args.methods if cp > 1 else ["none"]
        per_rank = run_ranks(_bench, cp, methods, args.seq_lens, args.steps, model, world_size=cp)
        for method in methods:
            rows = {}
            for seq in args.seq_lens:
                measured = [r[f"{method}/{seq}"] for r in per_rank]
                rows[seq] = {
                    "peak_activation_bytes_per_rank": [m["peak_saved_bytes"] for m in measured],
                    "step_s_median": max(m["step_s"] for m in measured),  # a step ends with its slowest rank
                    "planned_activation_bytes": _planned(cp, method, seq, model),
                }
            results[f"cp{cp}" if cp == 1 else f"cp{cp}/{method}"] = rows
    base = results.get("cp1")
    for name, rows in results.items():
        cp = int(name.split("/")[0][2:])
        for seq, row in rows.items():
            row["peak_activation_bytes"] = max(row["peak_activation_bytes_per_rank"])
            row["measured_over_planned"] = round(
                row["peak_activation_bytes"] / row["planned_activation_bytes"], 3
            )
            if base is not None:
                row["ratio_to_cp1"] = round(
                    row["peak_activation_bytes"] / base[seq]["peak_activation_bytes"], 4
                )
                row["one_over_c"] = 1 / cp
    longest = {
        name: {
            "measured": _longest(rows, "peak_activation_bytes", budget),
            "planned": _longest(rows, "planned_activation_bytes", budget),
        }
        for name, rows in results.items()
    }
    report = {
        "benchmark": f"demo GPT {args.n_layers} x {args.d_model} ({args.n_heads} heads, vocab 256), batch 1, fp32,"
        f" stage 0, SGD; c gloo CPU ranks of one thread each; step time median of {max(1, args.steps - 1)}"
        " steps after the first",
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "model": model,
        "results": {name: {str(seq): row for seq, row in rows.items()} for name, rows in results.items()},
        "budget_bytes": budget,
        "longest_sequence_in_budget": longest,
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
