"""Train the demo GPT with a plain Lightning Fabric loop, ZeRO-3 over 2 CPU ranks.

    python examples/fabric_gpt.py --steps 20

Fabric starts the second rank itself. The model is built on the meta device and sharded before any rank
allocates it; the loop accumulates without gradient sync, clips by the global norm, and saves a sharded
checkpoint that ``Trainer.fit(ckpt_path=...)`` under ``ShardStrategy`` can read too (docs/fabric.md).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F

from lightning_shard import ShardFabricStrategy
from lightning_shard.demos import GPTModule, TextDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--checkpoint", default="checkpoints/fabric_gpt.ckpt")
    args = parser.parse_args()

    fabric = L.Fabric(
        accelerator="cpu", devices=2, strategy=ShardFabricStrategy(stage=args.stage), precision=args.precision
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

    step, batches = 0, iter(loader)
    while step < args.steps:
        for micro in range(args.accumulate):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            last = micro == args.accumulate - 1
            with fabric.no_backward_sync(model, enabled=not last):  # gradients reduced once, at the last
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
                fabric.backward(loss / args.accumulate)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
        fabric.print(f"step {step} loss {mean_loss.item():.4f} grad_norm {norm.item():.3f}")

    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": step})
    fabric.print(f"saved {args.checkpoint}")


if __name__ == "__main__":
    main()
