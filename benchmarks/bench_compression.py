"""Compressed gradient all-reduce (``gradient_compression=``) on 2 CPU ranks at stage 1: bytes per step,
step time and loss after N steps against the uncompressed all-reduce, in one run.

Bytes are counted, not estimated: every ``torch.distributed.all_reduce`` the communication hooks issue
(torch's hooks call it from Python) is summed per optimizer step on rank 0. The uncompressed baseline is
torch's own ``allreduce_hook`` (DDP's built-in all-reduce runs in C++, where nothing can count it), the
same all-reduce. PowerSGD's bytes are reported after its ``start_iter`` warm-up steps of plain all-reduce.

    python benchmarks/bench_compression.py --rounds 5 --steps 30 --out benchmarks/results/compression.json
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import lightning as L
import torch.distributed as dist
from _common import MODEL, StepTimer, cpu_trainer, interleaved, token_loader, write_report
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks

START_ITER = 2


def _methods() -> dict[str, dict[str, Any]]:
    return {
        "none": {"ddp_comm_hook": default_hooks.allreduce_hook},
        "fp16": {"gradient_compression": "fp16"},
        "powersgd_rank1": {
            "gradient_compression": {"method": "powersgd", "rank": 1, "start_iter": START_ITER}
        },
        "powersgd_rank4": {
            "gradient_compression": {"method": "powersgd", "rank": 4, "start_iter": START_ITER}
        },
    }


class _Bytes(L.Callback):
    """all_reduce bytes of each training step on this rank."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self.total = 0
        self._original = dist.all_reduce

        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.total += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        self._counted = counted

    def on_train_start(self, *args: Any) -> None:
        dist.all_reduce = self._counted

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = self.total

    def on_train_batch_end(self, *args: Any) -> None:
        self.per_step.append(self.total - self._start)

    def on_train_end(self, *args: Any) -> None:
        dist.all_reduce = self._original


def _run(flags: dict[str, Any], steps: int) -> dict[str, Any]:
    timer, counter, losses = StepTimer(), _Bytes(), []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            losses.append(float(outputs["loss"]))

    trainer = cpu_trainer(ShardStrategy(stage=1, **flags), steps, [timer, counter, Losses()])
    trainer.fit(GPTModule(**MODEL), token_loader(steps))
    return {
        "step_s": statistics.median(timer.times[START_ITER + 1 :]),
        "bytes_per_step": statistics.median(counter.per_step[START_ITER + 1 :]),
        "final_loss": statistics.mean(losses[-5:]),
    }


def _bench(rounds: int, steps: int) -> dict[str, list[dict]]:
    return interleaved(_methods(), rounds, lambda config: _run(config, steps))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/compression.json")
    args = parser.parse_args()
    if args.steps < START_ITER + 2:
        parser.error(f"--steps {args.steps}: at least {START_ITER + 2} (PowerSGD starts after {START_ITER})")
    raw = run_ranks(_bench, args.rounds, args.steps)[0]
    median = {n: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for n, runs in raw.items()}
    base = median["none"]
    report = {
        "benchmark": (
            f"gradient compression at stage 1, 2 CPU ranks (gloo), GPT {MODEL['n_layers']}x{MODEL['d_model']}"
            f" seq {MODEL['seq_len']} batch 4/rank, {args.steps} steps, medians of {args.rounds} rounds"
        ),
        "median": median,
        "bytes_over_uncompressed": {
            n: m["bytes_per_step"] / base["bytes_per_step"] for n, m in median.items()
        },
        "step_time_over_uncompressed": {n: m["step_s"] / base["step_s"] for n, m in median.items()},
        "final_loss_minus_uncompressed": {n: m["final_loss"] - base["final_loss"] for n, m in median.items()},
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
