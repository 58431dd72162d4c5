"""Per-rank host memory while a model larger than one rank's share starts: meta construction and
``init_weights`` against building the whole model on every rank.

A GPT of about 1B parameters (4 GB in fp32) on 2 CPU ranks at ZeRO-3 (FSDP2 engine), SGD. Modes:

    empty    trainer.init_module(empty_init=True): parameters on the meta device, each rank allocates
             and initialises its shard at set-up (init_weights()).
    file     the same, plus ShardStrategy(init_weights=FILE.safetensors): each rank reads its slices.
    full     what users do without it: the whole model built on every rank, the whole file loaded on
             every rank (safetensors.torch.load_file + load_state_dict), then sharded by the strategy.

Memory is sampled every 2 ms on each rank from /proc/self/status, above the rank's baseline:
anonymous RSS (``RssAnon``: heap and anonymous mappings) and total RSS (``VmRSS``: also the pages of
memory-mapped files the rank touched, e.g. the slices it read). Two windows:

    setup    from just before construction to the start of the first training batch (construction,
             sharding, allocation, initialisation or loading);
    step     from then to the end of the first optimizer step (adds the gradient shards and the
             all-gathered block being computed).

Reported per mode: each rank's peaks in bytes and as a fraction of the full model's parameter bytes
(the shard alone is 0.5); with ``--repeats N``, the medians over N runs.

    python benchmarks/bench_big_init.py --out big_init.json           # ~1B parameters
    python benchmarks/bench_big_init.py --layers 2 --d-model 256        # a quick smoke run
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import write_report

from lightning_shard import ShardStrategy
from lightning_shard.demos.gpt import GPTModule
from lightning_shard.demos.ranks import run_ranks

VOCAB, SEQ = 256, 64


def rss() -> dict[str, int]:
    """This process's anonymous and total resident memory, bytes (RssAnon, VmRSS)."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("RssAnon", "VmRSS"):
                found["anon" if key == "RssAnon" else "total"] = int(line.split()[1]) * 1024
    if len(found) != 2:
        raise RuntimeError("no RssAnon / VmRSS in /proc/self/status (Linux only)")
    return found


class PeakSampler:
    """The highest anonymous and total RSS seen in each window, sampled from a background thread."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s, self.window = period_s, "setup"
        self.peaks = {f"{w}_{k}": 0 for w in ("setup", "step") for k in ("anon", "total")}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for kind, value in rss().items():
            key = f"{self.window}_{kind}"
            self.peaks[key] = max(self.peaks[key], value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.period_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class Windows(L.Callback):
    def __init__(self, sampler: PeakSampler) -> None:
        self.sampler = sampler

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.sampler.sample()
        self.sampler.window = "step"
        self.sampler.sample()


class SGDGPT(GPTModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:  # type: ignore[override]
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _model(shape: dict[str, int]) -> SGDGPT:
    return SGDGPT(vocab_size=VOCAB, seq_len=SEQ, n_heads=16, **shape)


def _loader() -> torch.utils.data.DataLoader:
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1
    )


def _rank(mode: str, shape: dict[str, int], file: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    gc.collect()
    baseline = rss()
    with PeakSampler() as sampler:
        L.seed_everything(0)
        strategy = ShardStrategy(stage=3, init_weights=file if mode == "file" else None)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Windows(sampler)],
        )
        if mode == "full":
            from safetensors.torch import load_file

            model = _model(shape)  # the whole model, initialised, on every rank
            model.load_state_dict(load_file(file), strict=False)  # the whole file, on every rank
        else:
            with trainer.init_module(empty_init=True):
                model = _model(shape)
        trainer.fit(model, _loader())
    return {
        "baseline_anon": baseline["anon"],
        "baseline_total": baseline["total"],
        **{key: value - baseline[key.rsplit("_", 1)[1]] for key, value in sampler.peaks.items()},
    }


def _write_weights(shape: dict[str, int], path: Path) -> int:
    from safetensors.torch import save_model

    torch.manual_seed(0)
    model = _model(shape)
    save_model(model, str(path))  # tied embedding / head saved once
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    gc.collect()
    return nbytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["empty", "file", "full"])
    parser.add_argument("--out", default="bench_big_init.json")
    args = parser.parse_args()
    shape = {"n_layers": args.layers, "d_model": args.d_model}
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "weights.safetensors"
        param_bytes = _write_weights(shape, file)
        print(
            f"model: {param_bytes / 2**30:.2f} GiB of fp32 parameters ({param_bytes // 4 / 1e9:.2f}B)",
            flush=True,
        )
        runs: dict[str, list[list[dict[str, Any]]]] = {mode: [] for mode in args.modes}
        for _ in range(args.repeats):
            for mode in args.modes:
                runs[mode].append(run_ranks(_rank, mode, shape, str(file)))
                print(mode, runs[mode][-1], flush=True)
    report: dict[str, Any] = {
        "parameters": param_bytes // 4,
        "parameter_bytes": param_bytes,
        "memory": "RssAnon (anon) and VmRSS (total), bytes above each rank's baseline",
    }
    for mode, repeats in runs.items():
        summary = {}
        for window in ("setup_anon", "setup_total", "step_anon", "step_total"):
            for rank in (0, 1):
                peak = statistics.median(r[rank][window] for r in repeats)
                summary[f"rank{rank}_{window}_bytes"] = peak
                summary[f"rank{rank}_{window}_x_params"] = round(peak / param_bytes, 3)
        report[mode] = {"median": summary, "runs": repeats}
    write_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
