"""Tiled MLP and tiled loss: activation memory and step time of a Hugging Face Llama (random weights, a 32k
vocabulary) against the sequence length, with and without ``ShardStrategy(tiled_mlp=True, tiled_loss=True)``,
and the longest sequence each trains within a memory budget.

One process, one sequence per step, fp32, no activation checkpointing (so the saved bytes show what each
tiling removes: the MLPs' hidden units per layer and the logits):

* **Activation memory**: on CPU, ``torch.autograd.graph.saved_tensors_hooks`` around the step counts the bytes
  autograd keeps for backward (each storage once, parameters left out), plus, tiled, the largest tile
  recomputed in backward (one tile's logits and their gradient, or one MLP tile's hidden units); on CUDA, ``torch.cuda.max_memory_allocated``
  over the step (what the device really held, parameters and optimizer state included).
* **Step time**: the median of the steps after the first.
* **Longest sequence**: the longest ``T`` of the grid whose memory is under ``--budget``; on CUDA the grid
  can run on until the device is out of memory (``--budget device``).

    python benchmarks/bench_tiling.py --out benchmarks/results/tiling.json
    python benchmarks/bench_tiling.py --seq-lens 128 256 --vocab 2048 --steps 1 --out /tmp/t.json   # smoke
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import lightning as L
import torch
from _common import SavedBytes, cpu_trainer, write_report
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.tiling import loss_tile
from lightning_shard.units import parse_size


class _Measured(L.LightningModule):
    """A Hugging Face Llama on its own loss; per step the activation bytes and the wall time."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(config)
        self.peaks: list[int] = []
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        saved = SavedBytes(self.model)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = self.model(input_ids=ids, labels=ids).loss
        self.peaks.append(saved.peak)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.peaks[-1] = torch.cuda.max_memory_allocated()
        self.times.append(time.perf_counter() - self._start)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _transient(config: Any, seq: int, tiles: tuple[Any, Any] | None) -> int:
    """Bytes backward makes for the largest recomputed tile (fp32): the tiled loss's logits and their
    gradient, or the tiled MLP's gate, up and activated units; what the saved-tensor count does not see on
    CPU. Untiled (or a sequence no longer than one tile), the whole logits and hidden units are saved and
    counted already."""
    if tiles is None:
        return 0
    mlp, loss = tiles
    loss_size = loss_tile(seq, config.hidden_size, config.vocab_size) if loss is True else loss
    mlp_size = config.hidden_size if mlp is True else mlp
    logits = 2 * loss_size * config.vocab_size if seq > loss_size else 0
    hidden = 3 * mlp_size * config.intermediate_size if seq > mlp_size else 0
    return max(logits, hidden) * 4


def _run_one(config: Any, seq: int, tiles: tuple[Any, Any] | None, steps: int) -> dict[str, Any]:
    module = _Measured(config)
    flags = dict(tiled_mlp=tiles[0], tiled_loss=tiles[1]) if tiles is not None else {}
    strategy = ShardStrategy(stage=0, **flags)
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = cpu_trainer(strategy, steps, [], devices=1, accelerator=accelerator)
    data = torch.randint(0, config.vocab_size, (steps, seq))
    try:
        trainer.fit(module, DataLoader(TensorDataset(data), batch_size=1))
    except torch.OutOfMemoryError:
        return {"out_of_memory": True}
    timed = module.times[1:] or module.times
    peak = max(module.peaks) + (0 if accelerator == "cuda" else _transient(config, seq, tiles))
    return {"memory_bytes": peak, "step_s_median": statistics.median(timed)}


def _longest(rows: dict[int, dict[str, Any]], budget: int | None) -> int | None:
    fits = [
        seq
        for seq, row in rows.items()
        if not row.get("out_of_memory") and (budget is None or row["memory_bytes"] <= budget)
    ]
    return max(fits, default=None)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is not timed")
    parser.add_argument("--mlp-tile", type=int, default=None, help="tiled_mlp's positions (default: True)")
    parser.add_argument("--loss-tile", type=int, default=None, help="tiled_loss's tokens (default: True)")
    parser.add_argument(
        "--budget", default="512MiB", help="memory per process for the longest sequence ('device': until OOM)"
    )
    parser.add_argument("--out", default="benchmarks/results/tiling.json")
    return parser.parse_args()


def main() -> None:
    import transformers

    args = parse_args()
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=max(args.seq_lens),
    )
    results: dict[str, dict[int, dict[str, Any]]] = {"untiled": {}, "tiled": {}}
    for seq in args.seq_lens:
        for name in results:
            tiles = (args.mlp_tile or True, args.loss_tile or True) if name == "tiled" else None
            results[name][seq] = _run_one(config, seq, tiles, args.steps)
    for seq in args.seq_lens:
        untiled, tiled = results["untiled"][seq], results["tiled"][seq]
        if "memory_bytes" in untiled and "memory_bytes" in tiled:
            tiled["memory_ratio_to_untiled"] = round(tiled["memory_bytes"] / untiled["memory_bytes"], 3)
    budget = None if args.budget == "device" else parse_size(args.budget, "--budget")
    report = {
        "benchmark": "tiling",
        "machine": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "model": {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size")}
        | {"layers": args.layers},
        "tiles": {"tiled_mlp": args.mlp_tile or True, "tiled_loss": args.loss_tile or True},
        "budget_bytes": budget,
        "results": {name: {str(seq): row for seq, row in rows.items()} for name, rows in results.items()},
        "longest_sequence_in_budget": {name: _longest(rows, budget) for name, rows in results.items()},
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
