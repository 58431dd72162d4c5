"""Train the demo GPT with a plain Lightning Fabric loop, ZeRO-3 over 2 CPU ranks.

    python examples/fabric_gpt.py --steps 20

Fabric starts the second rank itself. The model is built on the meta device and sharded before any rank
allocates it; the loop accumulates without gradient sync, clips by the global norm, logs throughput, MFU
and each rank's time per batch (the same callbacks as under the Trainer, called with ``fabric.call``), and
saves a sharded checkpoint that ``Trainer.fit(ckpt_path=...)`` under ``ShardStrategy`` can read too
(docs/fabric.md).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F

from lightning_shard import ShardFabricStrategy
from lightning_shard.callbacks import MFUMonitor, StragglerDetector
from lightning_shard.demos import GPTModule, TextDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--checkpoint", default="checkpoints/fabric_gpt.ckpt")
    args = parser.parse_args()

    mfu = MFUMonitor(log_every_n_steps=10, window=10)  # counted per micro-batch, as under the Trainer
    straggler = StragglerDetector(every_n_steps=10)
    fabric = L.Fabric(
        accelerator="cpu",
        devices=2,
        strategy=ShardFabricStrategy(stage=args.stage),
        precision=args.precision,
        callbacks=[mfu, straggler],
    )
    fabric.launch()
    fabric.seed_everything(0)

    data = TextDataModule(batch_size=8, seq_len=64, n_sentences=400)
    data.setup("fit")
    with fabric.init_module(empty_init=True):  # parameters on the meta device until setup shards them
        model = GPTModule(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    loader = fabric.setup_dataloaders(data.train_dataloader())

    step, micro_batches, batches = 0, 0, iter(loader)
    while step < args.steps:
        for micro in range(args.accumulate):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(loader)
                batch = next(batches)
            fabric.call(
                "on_train_batch_start", trainer=fabric, pl_module=model, batch=batch, batch_idx=micro_batches
            )
            x, y = batch
            last = micro == args.accumulate - 1
            with fabric.no_backward_sync(model, enabled=not last):  # gradients reduced once, at the last
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
                fabric.call("on_before_backward", trainer=fabric, pl_module=model, loss=loss)
                fabric.backward(loss / args.accumulate)
            if last:
                norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
            fabric.call(
                "on_train_batch_end",
                trainer=fabric,
                pl_module=model,
                outputs=loss,
                batch=batch,
                batch_idx=micro_batches,
            )
            micro_batches += 1
        step += 1
        mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
        fabric.print(f"step {step} loss {mean_loss.item():.4f} grad_norm {norm.item():.3f}")
        if mfu.metrics and micro_batches % 10 == 0:  # new figures every 10 micro-batches
            perf = mfu.metrics
            fabric.print(
                f"  {perf['perf/tokens_per_sec']:.0f} tokens/s, MFU {perf.get('perf/mfu', float('nan')):.2%},"
                f" slowest rank {straggler.metrics['straggler/max_ratio']:.2f}x the median"
            )

    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": step})
    fabric.print(f"saved {args.checkpoint}")


if __name__ == "__main__":
    main()
