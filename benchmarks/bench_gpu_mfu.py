"""MFU of a ~1B GPT on one GPU at stage 3 in bf16, eager against ``ShardStrategy(compile=True)``.

Each mode runs in a process of its own (fresh GPU memory and compile caches), through a Lightning Trainer
with ``ShardStrategy(stage=3)``, ``precision="bf16-mixed"``, the model built on the meta device
(``trainer.init_module(empty_init=True)``) and AdamW. Per mode it reports:

- the median step time over the steps after ``--warmup`` (each step ends with a device sync);
- MFU against the datasheet peak (989 TFLOP/s dense bf16 on an H100 SXM / H200) and against a bf16
  8192^3 matmul measured on the same device in the same run, from two FLOP counts: the PaLM formula
  (6 N per token plus 12 L d s per token for attention; N: the blocks' parameters and the head's matmul) and ``MFUMonitor``'s count
  of the ops the first step ran;
- where the device time of ``--profile-steps`` profiled steps goes: kernel time by kind (matmul,
  attention, elementwise / norm, optimizer, copies, communication) and the time no kernel ran;
- the chrome trace of those steps (gzipped) next to the JSON;
- with ``--saves sync async``: the same run saving a sharded checkpoint every ``--save-every`` steps, the
  time each save blocked the loop and the run's wall time against the run without saves;
- with ``--modes ... fp8_compiled`` (or ``fp8``): ``ShardStrategy(fp8=True)`` (torchao float8 on the Linears
  the size rule picks, float8 all-gathers), compiled or not. Its MFU is reported against the bf16 peak (the
  same yardstick as the other modes) and against the fp8 peak ``MFUMonitor`` picks for a model with float8
  layers (``peak_source`` says which), and tokens/s against the compiled bf16 run (torchtitan's H100 table:
  +28% for Float8 over compile alone on Llama-3.1-8B).

    python benchmarks/bench_gpu_mfu.py --out benchmarks/results/gpu_mfu.json
    python benchmarks/bench_gpu_mfu.py --device cpu --layers 2 --d-model 64 --heads 2 --seq 32 \\
        --vocab 128 --batch 2 --steps 6 --warmup 2   # the suite's smoke size
    python benchmarks/bench_gpu_mfu.py --layers 16 --batch 4 --steps 10 --warmup 4 --profile-steps 0 \\
        --modes eager compiled fp8_compiled --out benchmarks/results/gpu_fp8.json   # ~1B, fp8 (< 4 min, H100)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import Profile, SaveEvery, StepTimer, token_loader

from lightning_shard import ShardStrategy
from lightning_shard.callbacks import MFUMonitor
from lightning_shard.callbacks._peaks import table_peak
from lightning_shard.demos import GPTModule

# ~1.08B parameters: 20 blocks of 12 d^2 (1.007B) plus a 32768 x 2048 tied embedding.
GPT_1B = dict(n_layers=20, d_model=2048, n_heads=16, seq_len=2048, vocab_size=32768)


#: Kernel name fragments (lower case) -> the kind of work; the first match wins, the rest is "other".
KERNEL_KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90_", "matmul")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "sgd")),
    ("copy", ("memcpy", "memset", "copy", "cat", "split_with_sizes", "chunk_cat")),
    ("elementwise_norm_loss", ("elementwise", "reduce", "norm", "softmax", "gelu", "triton", "nll", "log")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, fragments in KERNEL_KINDS:
        if any(f in low for f in fragments):
            return kind
    return "other"


def kernel_breakdown(events: Any, wall_us: float, steps: int) -> dict[str, Any]:
    """Per step: device time by kernel kind, the union of kernel intervals (busy) and the wall time."""
    by_kind: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    intervals: list[tuple[float, float]] = []
    for e in events:
        # kernels, copies and sets on the device; not the ranges record_function / the optimizer annotate
        if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        start, end = e.time_range.start, e.time_range.end
        kind = kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (end - start)
        by_kernel[e.name] = by_kernel.get(e.name, 0.0) + (end - start)
        intervals.append((start, end))
    busy, last = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > last:
            busy += end - max(start, last)
            last = end
    top = sorted(by_kernel.items(), key=lambda kv: kv[1], reverse=True)[:20]
    return {
        "wall_ms_per_step": wall_us / 1000 / steps,
        "kernels_per_step": len(intervals) / steps,
        "kernel_busy_ms_per_step": busy / 1000 / steps,
        "kernel_ms_per_step_by_kind": {k: v / 1000 / steps for k, v in sorted(by_kind.items())},
        "top_kernels_ms_per_step": {name[:120]: v / 1000 / steps for name, v in top},
    }


def palm_flops_per_batch(model: dict[str, Any], batch: int) -> float:
    """Training FLOPs of one batch by the PaLM paper's count: 6 N + 12 L d s per token, N without the
    embeddings (the tied head's matmul is counted once, in 6 N, through the vocabulary term)."""
    d, layers, s, v = model["d_model"], model["n_layers"], model["seq_len"], model["vocab_size"]
    n_blocks = layers * (12 * d * d + 13 * d)  # qkv, proj, mlp weights and biases, two norms
    n_matmul = n_blocks + v * d  # the head's matmul runs once per token
    return (6 * n_matmul + 12 * layers * d * s) * batch * s


def matmul_peak(device: torch.device, size: int = 8192, reps: int = 10) -> float | None:
    """bf16 ``size``^3 matmul FLOP/s on random data on ``device`` (CUDA only)."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * reps / (time.perf_counter() - t0)


def run_names(args: argparse.Namespace) -> list[str]:
    """One run per mode and save kind: ``eager``, ``compiled``, ``eager+async_save``, ..."""
    return [m if s == "none" else f"{m}+{s}_save" for m in args.modes for s in args.saves]


def run_one(args: argparse.Namespace, name: str) -> dict[str, Any]:
    mode, _, save = name.partition("+")
    model = model_shape(args)
    total = args.steps + args.profile_steps
    timer = StepTimer()  # first: its step times leave the saves' blocking out
    mfu = MFUMonitor(log_every_n_steps=args.steps, window=args.steps - args.warmup)
    trace = Path(args.out).with_name(f"{Path(args.out).stem}_{name.replace('+', '_')}_trace.json.gz")
    profile = Profile(str(trace), start=args.steps, steps=args.profile_steps)
    callbacks: list[L.Callback] = [timer, mfu] + ([profile] if args.profile_steps else [])
    directory = tempfile.mkdtemp(prefix="bench_gpu_mfu_", dir=args.save_dir) if save else None
    saver = SaveEvery(args.save_every, directory) if directory is not None else None
    callbacks += [saver] if saver is not None else []
    strategy = ShardStrategy(
        stage=args.stage,
        compile=mode in ("compiled", "fp8_compiled"),
        async_checkpoint=save == "async_save",
        fp8=mode.startswith("fp8"),
    )
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=total,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with trainer.init_module(empty_init=True):
        module = GPTModule(**model, dropout=0.0, max_steps=total)
    from torch._dynamo.utils import counters

    t0 = time.perf_counter()
    loader = token_loader(total, args.batch, world_size=1, model=model)
    trainer.fit(module, loader)  # teardown waits for an async save
    run_s = time.perf_counter() - t0
    saves: dict[str, Any] = {}
    if saver is not None and directory is not None:
        written = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
        saves = {
            "blocked_s_per_save": saver.blocked,
            "checkpoint_gb": written / 1e9 / max(1, len(saver.blocked)),
        }
        shutil.rmtree(directory, ignore_errors=True)
    device = trainer.strategy.root_device
    step_s = statistics.median(timer.times[args.warmup : args.steps])
    palm = palm_flops_per_batch(model, args.batch)
    counted = (mfu.counted or {}).get("model_flops")
    measured_peak = matmul_peak(device)
    result = {
        "mode": mode,
        "run_s": run_s,
        **saves,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "step_ms_median": step_s * 1000,
        "step_ms": [t * 1000 for t in timer.times],
        "tokens_per_s": args.batch * model["seq_len"] / step_s,
        "palm_tflops_per_step": palm / 1e12,
        "counted_tflops_per_step": None if counted is None else counted / 1e12,
        "datasheet_peak_tflops": None if mfu.device_peak is None else mfu.device_peak / 1e12,
        "peak_source": mfu.peak_source,
        "fp8_layers": sum(type(m).__name__ == "Float8Linear" for m in module.modules()),
        "measured_matmul_tflops": None if measured_peak is None else measured_peak / 1e12,
        "mfu_monitor": mfu.metrics if hasattr(mfu, "metrics") else None,
        "recompiles": trainer.strategy.recompiles,
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "profile": kernel_breakdown(profile.events, profile.wall_us, args.profile_steps)
        if profile.events is not None
        else {},
        "trace": trace.name if args.profile_steps else None,
    }
    if mfu.device_peak:
        result["mfu_palm"] = palm / step_s / mfu.device_peak
        if counted:
            result["mfu_counted"] = counted / step_s / mfu.device_peak
    if measured_peak:
        result["mfu_palm_vs_measured_matmul"] = palm / step_s / measured_peak
    bf16_peak = table_peak(result["device"], "bf16")
    if bf16_peak:
        result["mfu_palm_vs_bf16_peak"] = palm / step_s / bf16_peak
    return result


def model_shape(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        seq_len=args.seq,
        vocab_size=args.vocab,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--layers", type=int, default=GPT_1B["n_layers"])
    parser.add_argument("--d-model", type=int, default=GPT_1B["d_model"])
    parser.add_argument("--heads", type=int, default=GPT_1B["n_heads"])
    parser.add_argument("--seq", type=int, default=GPT_1B["seq_len"])
    parser.add_argument("--vocab", type=int, default=GPT_1B["vocab_size"])
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=15, help="timed window: steps --warmup .. --steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile-steps", type=int, default=2, help="profiled steps after the timed ones")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["eager", "compiled", "fp8", "fp8_compiled"],
        default=["eager", "compiled"],
    )
    parser.add_argument(
        "--saves",
        nargs="+",
        choices=["none", "sync", "async"],
        default=["none"],
        help="runs without saves, and with a sync / async sharded save every --save-every steps",
    )
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--save-dir", default=None, help="where the saves go (default: the temp dir)")
    parser.add_argument("--out", default="benchmarks/results/gpu_mfu.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's run name
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps - args.warmup < 2:
        parser.error(f"--steps {args.steps} --warmup {args.warmup}: need warmup >= 1 and 2 timed steps")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.one is not None:  # a child: one mode, its result as the last line of stdout
        print("RESULT " + json.dumps(run_one(args, args.one)), flush=True)
        return
    argv = sys.argv[1:] if argv is None else argv
    results: dict[str, Any] = {}
    for mode in run_names(args):
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *argv, "--one", mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:  # one mode failing still reports the others
            print(proc.stdout[-4000:], file=sys.stderr)
            results[mode] = {"mode": mode, "error": f"exit status {proc.returncode}, see stderr"}
            continue
        results[mode] = json.loads(lines[-1][len("RESULT ") :])
    model = model_shape(args)
    report = {
        "benchmark": (
            f"GPT {args.layers}x{args.d_model} (heads {args.heads}, seq {args.seq}, vocab {args.vocab}),"
            f" batch {args.batch}, ShardStrategy(stage={args.stage}), {args.precision}, AdamW, one"
            f" {args.device} device; medians of steps {args.warmup}..{args.steps - 1}"
        ),
        "model": model,
        "results": results,
    }
    if all("step_ms_median" in results.get(m, {}) for m in ("eager", "compiled")):
        report["compiled_over_eager_step_time"] = (
            results["compiled"]["step_ms_median"] / results["eager"]["step_ms_median"]
        )
    if all("tokens_per_s" in results.get(m, {}) for m in ("compiled", "fp8_compiled")):
        report["fp8_compiled_over_compiled_tokens_per_s"] = (
            results["fp8_compiled"]["tokens_per_s"] / results["compiled"]["tokens_per_s"]
        )
    for mode in args.modes:  # the whole run's wall time with saves against the same run without
        for save in ("sync", "async"):
            with_saves, without = results.get(f"{mode}+{save}_save", {}), results.get(mode, {})
            if "run_s" in with_saves and "run_s" in without:
                report[f"{mode}_{save}_saving_run_over_no_save_run"] = with_saves["run_s"] / without["run_s"]
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    summary = {
        mode: {
            k: r.get(k)
            for k in (
                "step_ms_median",
                "tokens_per_s",
                "mfu_palm",
                "mfu_palm_vs_bf16_peak",
                "peak_source",
                "fp8_layers",
                "mfu_counted",
                "mfu_palm_vs_measured_matmul",
                "recompiles",
                "dynamo_graphs",
                "peak_memory_gb",
                "run_s",
                "blocked_s_per_save",
                "checkpoint_gb",
                "profile",
                "error",
            )
        }
        for mode, r in results.items()
    }
    print(json.dumps({**{k: v for k, v in report.items() if k != "results"}, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
