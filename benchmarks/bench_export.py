"""Host memory of ``lightning-shard export`` (streamed, file by file) against loading the full model.

A Hugging Face GPT-2 of a few hundred million parameters (default 24 x 1024, vocabulary 50257: ~355M
parameters, ~1.4 GB in fp32), randomly initialised and saved as our sharded checkpoint (DCP shards of
``{"state_dict": ...}`` under the ``model.`` prefix + ``meta.pt`` whose hyper-parameters hold the config, as a
LightningModule with ``self.model`` writes it; no training). With ``--source deepspeed``: the same model
saved by DeepSpeed's ``save_checkpoint`` on 2 gloo ranks at ZeRO ``--stage`` (fp32 partitions of each rank, as
the DeepSpeed engine writes them; SGD, so no optimizer state beside them). Then, each in a fresh process:

    full        ``load_model_weights(ckpt)``: the whole state dict in one process (what exporting through
                ``from_pretrained``/``save_pretrained`` of the consolidated model needs at least; for a
                DeepSpeed checkpoint, DeepSpeed's ``zero_to_fp32``, which is what the export did before it
                streamed DeepSpeed checkpoints);
    export_1    ``export_hf(ckpt, out, max_shard_size=...)`` in that process (one worker);
    export_2    the same with ``workers=2``: two spawned workers, each writing half of the files.

Memory is the peak RSS growth of each worker process: its resident high-water mark at the end (``VmHWM``)
minus its resident memory just before it started reading (``VmRSS``, after imports and planning). Not
``ru_maxrss``: a spawned process inherits its parent's peak there (across fork and exec), which hides the
growth. Reported per mode: each worker's growth in bytes,
as a fraction of the model's bytes and of the largest output file's bytes, and the wall time of the export;
with ``--repeats N``, the medians over N runs.

    python benchmarks/bench_export.py --out export.json                        # ~355M parameters
    python benchmarks/bench_export.py --source deepspeed --stage 3 --out export_ds.json
    python benchmarks/bench_export.py --layers 2 --d-model 64 --vocab 512 --max-shard-size 50KB   # smoke
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import write_report

from lightning_shard.checkpoint.hf_export import rss


def _config(layers: int, d_model: int, vocab: int) -> Any:
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers, n_embd=d_model, n_head=max(1, d_model // 64), vocab_size=vocab, n_positions=256
    )
    config.bos_token_id = config.eos_token_id = 0
    return config


def make_checkpoint(root: Path, layers: int, d_model: int, vocab: int) -> tuple[Path, int]:
    """A random GPT-2 as our sharded checkpoint; returns its path and the model's parameter bytes."""
    import torch.distributed.checkpoint as dcp
    import transformers

    config = _config(layers, d_model, vocab)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":  # tied to the embedding: stored once, as the embedding
            state["model." + name] = torch.randn(tensor.shape, generator=g) * 0.02
    path = root / "last.ckpt"
    dcp.save({"state_dict": state}, checkpoint_id=str(path), no_dist=True)
    torch.save({"hyper_parameters": {"config": config.to_dict()}, "global_step": 0}, path / "meta.pt")
    return path, sum(t.nbytes for t in state.values())


class _Holder(torch.nn.Module):
    """The Hugging Face model as ``self.model``: keys ``model.<hf key>``, as a LightningModule saves them."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def _deepspeed_save(path: str, layers: int, d_model: int, vocab: int, stage: int) -> None:
    import deepspeed  # optional: DeepSpeed
    import transformers

    from lightning_shard.checkpoint.layout import DEEPSPEED_TAG

    config = _config(layers, d_model, vocab)
    torch.manual_seed(0)
    holder = _Holder(transformers.AutoModelForCausalLM.from_config(config))
    settings = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch SGD: nothing to build, no optimizer state
    }
    engine, *_ = deepspeed.initialize(
        model=holder, optimizer=torch.optim.SGD(holder.parameters(), lr=0.1), config=settings
    )
    engine.save_checkpoint(
        path, tag=DEEPSPEED_TAG, client_state={"hyper_parameters": {"config": config.to_dict()}}
    )


def make_deepspeed_checkpoint(
    root: Path, layers: int, d_model: int, vocab: int, stage: int
) -> tuple[Path, int]:
    """A random GPT-2 saved by DeepSpeed on 2 ranks; returns its path and the model's parameter bytes (the
    embedding once: the head is tied to it)."""
    from lightning_shard.demos.ranks import run_ranks

    path = root / "last.ckpt"
    run_ranks(_deepspeed_save, str(path), layers, d_model, vocab, stage)
    config = _config(layers, d_model, vocab)
    with torch.device("meta"):
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(config)
    return path, sum(p.nbytes for p in model.parameters())


def _full(ckpt: str, queue: Any) -> None:
    from lightning_shard.checkpoint import load_model_weights

    torch.set_num_threads(1)
    baseline, start = rss()[0], time.perf_counter()
    weights = load_model_weights(ckpt)
    seconds = time.perf_counter() - start
    queue.put({"workers": [{"growth": rss()[1] - baseline}], "seconds": seconds, "bytes": len(weights)})


def _export(ckpt: str, out: str, workers: int, max_shard_size: str, queue: Any) -> None:
    from lightning_shard.checkpoint import export_hf

    torch.set_num_threads(1)
    start = time.perf_counter()
    report = export_hf(ckpt, out, max_shard_size=max_shard_size, workers=workers)
    seconds = time.perf_counter() - start
    largest = max(w.max_bytes_held for w in report.workers)
    queue.put(
        {
            "workers": [
                {
                    "growth": w.peak_rss_bytes - w.baseline_rss_bytes,
                    "files": len(w.files),
                    "read": w.bytes_read,
                }
                for w in report.workers
            ],
            "seconds": seconds,
            "files": len(report.files),
            "largest_file_bytes": largest,
        }
    )


def _in_fresh_process(target: Any, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, queue))
    process.start()
    result = queue.get()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"{target.__name__} exited with {process.exitcode}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--max-shard-size", default="100MB")
    parser.add_argument("--source", choices=["sharded", "deepspeed"], default="sharded")
    parser.add_argument(
        "--stage", type=int, choices=[1, 2, 3], default=3, help="ZeRO stage (--source deepspeed)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_export.json")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_export_"))
    try:
        if args.source == "deepspeed":
            ckpt, model_bytes = make_deepspeed_checkpoint(
                root, args.layers, args.d_model, args.vocab, args.stage
            )
        else:
            ckpt, model_bytes = make_checkpoint(root, args.layers, args.d_model, args.vocab)
        runs: dict[str, list[dict[str, Any]]] = {"full": [], "export_1": [], "export_2": []}
        for _ in range(args.repeats):  # interleaved, so that drift hits every mode alike
            runs["full"].append(_in_fresh_process(_full, str(ckpt)))
            for workers in (1, 2):
                out = root / f"hf{workers}"
                shutil.rmtree(out, ignore_errors=True)
                result = _in_fresh_process(_export, str(ckpt), str(out), workers, args.max_shard_size)
                runs[f"export_{workers}"].append(result)
        largest = runs["export_1"][0]["largest_file_bytes"]
        report: dict[str, Any] = {
            "model": {"layers": args.layers, "d_model": args.d_model, "vocab": args.vocab},
            "source": args.source if args.source == "sharded" else f"deepspeed ZeRO-{args.stage}, 2 ranks",
            "model_bytes": model_bytes,
            "max_shard_size": args.max_shard_size,
            "files": runs["export_1"][0]["files"],
            "largest_file_bytes": largest,
            "memory": "peak RSS growth (VmHWM at the end - VmRSS before reading) of each worker, bytes",
            "repeats": args.repeats,
        }
        for mode, results in runs.items():
            n_workers = len(results[0]["workers"])
            median: dict[str, float] = {"seconds": statistics.median(r["seconds"] for r in results)}
            for i in range(n_workers):
                growth = statistics.median(r["workers"][i]["growth"] for r in results)
                median[f"worker{i}_peak_growth_bytes"] = growth
                median[f"worker{i}_x_model"] = growth / model_bytes
                median[f"worker{i}_x_largest_file"] = growth / largest
            report[mode] = {"median": median, "runs": results}
        printed = {k: v["median"] if isinstance(v, dict) and "median" in v else v for k, v in report.items()}
        write_report(report, args.out, printed)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
