"""The CPU ranks' collectives: through shared memory (``engines/_shm.py``) against gloo, side by side.

Per size: all-gather (gloo's ``all_gather_single``), reduce-scatter (the all-to-all plus a sum the FSDP
engine uses where shared memory is unavailable, and gloo's own, which torch runs as an all-reduce) and
all-reduce (gloo's), each against the shared-memory call, interleaved call by call after a barrier, on
ranks of one thread each. Medians in ms; ``size_mb`` is the full buffer (an all-gather's output, a
reduce-scatter's input).

    python benchmarks/bench_collectives.py --out benchmarks/results/collectives.json
    python benchmarks/bench_collectives.py --smoke          # 1 MB, 5 calls
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import write_report

from lightning_shard.demos.ranks import run_ranks


def _time_size(shm: Any, size_mb: float, calls: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from lightning_shard.engines._gloo import CpuReduceScatter

    group, n = shm.group, shm.size
    numel = int(size_mb * 2**20) // 4 // n * n
    full, out = torch.randn(numel), torch.empty(numel)
    chunk, shard = full[: numel // n].clone(), torch.empty(numel // n)
    sum_ = dist.ReduceOp.SUM
    runs: dict[str, Callable[[], object]] = {
        "all_gather_gloo": lambda: dist.all_gather_single(out, chunk, group=group),
        "all_gather_shm": lambda: shm.all_gather(out, chunk),
        "reduce_scatter_all_to_all": lambda: CpuReduceScatter(False)(shard, full, group, sum_),
        "reduce_scatter_gloo": lambda: dist.reduce_scatter_single(shard, full, group=group),
        "reduce_scatter_shm": lambda: shm.reduce_scatter(shard, full, sum_),
        "all_reduce_gloo": lambda: dist.all_reduce(out, group=group),
        "all_reduce_shm": lambda: shm.all_reduce(out, sum_),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(calls + 1):  # the first call of each maps (or grows) the files: untimed
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            assert run() is not False, f"{name}: shared memory unavailable"
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def _bench(sizes_mb: list[float], calls: int) -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    from lightning_shard.engines._shm import SharedMemoryGroup

    dist.init_process_group("gloo")
    shm = SharedMemoryGroup(dist.group.WORLD)
    results = {f"{size_mb:g}": _time_size(shm, size_mb, calls) for size_mb in sizes_mb}
    dist.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 19, 100])
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="1 MB, 5 calls")
    parser.add_argument("--out", default="benchmarks/results/collectives.json")
    args = parser.parse_args()
    if args.smoke:
        args.sizes_mb, args.calls = [1], 5
    median_ms = run_ranks(_bench, args.sizes_mb, args.calls, world_size=args.world_size)[0]
    report = {
        "benchmark": f"collectives on {args.world_size} CPU ranks (one thread each): shared memory vs gloo",
        "calls": args.calls,
        "median_ms": median_ms,
        "shm_over_gloo": {
            size: {
                "all_gather": ms["all_gather_shm"] / ms["all_gather_gloo"],
                "reduce_scatter_vs_all_to_all": ms["reduce_scatter_shm"] / ms["reduce_scatter_all_to_all"],
                "reduce_scatter_vs_gloo": ms["reduce_scatter_shm"] / ms["reduce_scatter_gloo"],
                "all_reduce": ms["all_reduce_shm"] / ms["all_reduce_gloo"],
            }
            for size, ms in median_ms.items()
        },
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
