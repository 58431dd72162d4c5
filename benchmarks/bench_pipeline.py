"""Pipeline schedules on CPU ranks: the measured bubble against (p-1)/(m+p-1), and activation memory per rank.

torch's schedules (``torch.distributed.pipelining``: ``ScheduleGPipe``, ``Schedule1F1B``), which
``ShardStrategy(pipeline_parallel_size=p, pipeline_schedule=...)`` runs, on a stack of ``DEPTH`` equal
Linear+tanh layers cut into ``p`` equal stages, one per rank (gloo), ``m`` micro-batches per step.

* **Bubble.** Each rank times its stage's own work alone (forward and backward of ``m`` micro-batches, no
  pipeline around them) just before each pipelined step; its idle fraction is ``1 - busy / step``. With every stage's work equal and
  communication free, a pipelined step idles ``(p-1)/(m+p-1)`` on each rank (GPipe and 1F1B alike):
  ``m`` slots of work in ``m + p - 1`` slots of time.
* **Activation memory.** ``torch.autograd.graph.saved_tensors_hooks`` counts the bytes autograd holds for
  backward on each rank; the peak over a step is the activation memory. GPipe runs every forward first, so a
  rank holds all ``m`` micro-batches' activations; 1F1B starts backward once the pipeline is full, so the
  first stage holds at most ``p`` (the last stage, 1).

    python benchmarks/bench_pipeline.py --stages 2 --microbatches 4 8 16 --out benchmarks/results/pipeline.json

More ranks than cores (``--stages 4`` on 2 cores) still measures memory exactly; its bubble figures then
include time-slicing between ranks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import SavedBytes, write_report
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from lightning_shard.demos.ranks import run_ranks
from lightning_shard.planner.layout import pipeline_bubble

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
WIDTH, DEPTH, MICROBATCH = 1024, 16, 64


def _work_alone(module: nn.Module, microbatches: int, first: bool) -> float:
    """Seconds this stage's forward and backward of ``microbatches`` take with no pipeline around them: the
    busy part of a pipelined step."""
    start = time.perf_counter()
    for _ in range(microbatches):
        x = torch.randn(MICROBATCH, WIDTH, requires_grad=not first)
        y = module(x)
        y.backward(torch.ones_like(y))
    module.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _stage(rank: int, stages: int) -> nn.Module:
    torch.manual_seed(rank)
    layers: list[nn.Module] = []
    for _ in range(DEPTH // stages):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _run(schedule_name: str, microbatches: int, steps: int) -> dict[str, Any]:
    rank, stages = dist.get_rank(), dist.get_world_size()
    module = _stage(rank, stages)
    stage = PipelineStage(module, rank, stages, torch.device("cpu"))
    schedule = SCHEDULES[schedule_name](stage, microbatches, loss_fn=lambda out, target: out.pow(2).mean())
    batch = torch.randn(microbatches * MICROBATCH, WIDTH)
    fractions, peaks = [], []
    for step in range(steps + 1):  # the first step warms up (buffers, sockets): not counted
        saved = SavedBytes(module)
        busy = _work_alone(module, microbatches, first=rank == 0)
        dist.barrier()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            if rank == 0:
                schedule.step(batch)
            elif rank == stages - 1:
                schedule.step(target=batch)
            else:
                schedule.step()
        elapsed = time.perf_counter() - start
        module.zero_grad(set_to_none=True)
        if step:
            fractions.append(1 - busy / elapsed)
            peaks.append(saved.peak)
    return {"idle_fraction": statistics.median(fractions), "peak_saved_bytes": max(peaks)}


def _bench(microbatches: list[int], steps: int, width: int) -> dict[str, Any]:
    global WIDTH
    WIDTH = width
    dist.init_process_group("gloo")  # run_ranks set the torchrun environment
    out: dict[str, Any] = {}
    for m in microbatches:
        for name in SCHEDULES:
            out[f"{name}/m={m}"] = _run(name, m, steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=WIDTH, help="layer width (smaller for a smoke run)")
    parser.add_argument("--out", default="benchmarks/results/pipeline.json")
    args = parser.parse_args()
    per_rank = run_ranks(_bench, args.microbatches, args.steps, args.width, world_size=args.stages)
    # Per micro-batch a stage keeps its input and each layer's output (a tanh output is the next Linear's input).
    per_microbatch = (DEPTH // args.stages + 1) * MICROBATCH * args.width * 4
    rows = {}
    for key in per_rank[0]:
        m = int(key.split("m=")[1])
        rows[key] = {
            "measured_bubble_median_over_ranks": statistics.median(r[key]["idle_fraction"] for r in per_rank),
            "formula_bubble": pipeline_bubble(args.stages, m),
            "peak_activation_bytes_per_rank": [r[key]["peak_saved_bytes"] for r in per_rank],
            "peak_activation_microbatches_per_rank": [
                round(r[key]["peak_saved_bytes"] / per_microbatch, 2) for r in per_rank
            ],
        }
    report = {
        "benchmark": f"{DEPTH} x Linear({args.width})+tanh in {args.stages} stages on {args.stages} CPU ranks (gloo),"
        f" micro-batch {MICROBATCH}; medians over {args.steps} steps",
        "results": rows,
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
