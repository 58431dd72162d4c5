"""Step time of ShardStrategy stages 0-3 against Lightning's ModelParallelStrategy with hand-written FSDP2.

Two CPU ranks over gloo, the example GPT (6 x 256, seq 128, batch 4 per rank). Configurations are
run interleaved, several rounds, in one pair of processes, so machine noise hits all of them alike;
the JSON reports per-configuration median step times and the ratio of stage 3 to the hand-written path.

    python benchmarks/bench_stages.py --rounds 3 --steps 12 --out benchmarks/results/stages.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _common import MODEL, StepTimer, cpu_trainer, token_loader, write_report

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks


class HandWrittenFSDP2(GPTModule):
    """What a user writes for Lightning's ModelParallelStrategy: fully_shard per block, then the root."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def _run(name: str, steps: int) -> float:
    timer = StepTimer()
    if name == "model_parallel_fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy, module = (
            ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            HandWrittenFSDP2(**MODEL),
        )
    else:
        strategy, module = ShardStrategy(stage=int(name[-1])), GPTModule(**MODEL)
    trainer = cpu_trainer(strategy, steps, [timer])
    trainer.fit(module, token_loader(steps))
    return statistics.median(timer.times[2:])  # first steps warm up allocators and gloo buffers


def _bench(rounds: int, steps: int) -> dict[str, list[float]]:
    names = ["stage0", "stage1", "stage2", "stage3", "model_parallel_fsdp2"]
    results: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order each round
            results[name].append(_run(name, steps))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results/stages.json")
    args = parser.parse_args()
    raw = run_ranks(_bench, args.rounds, args.steps)[0]
    medians = {name: statistics.median(times) * 1000 for name, times in raw.items()}
    report = {
        "benchmark": "step time, 2 CPU ranks (gloo), GPT 6x256 seq 128 batch 4/rank",
        "torch": torch.__version__,
        "median_step_ms": medians,
        "per_round_step_ms": {k: [t * 1000 for t in v] for k, v in raw.items()},
        "stage3_over_handwritten_fsdp2": medians["stage3"] / medians["model_parallel_fsdp2"],
        "target": "stage3_over_handwritten_fsdp2 <= 1.05",
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
