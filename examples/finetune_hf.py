"""Fine-tune a Hugging Face causal LM bigger than one device: built on the meta device, started from
its full weights with ``ShardStrategy(stage=3, init_weights=MODEL_DIR)`` on 2 CPU ranks.

No rank ever holds the whole model: the module is built without memory
(``trainer.init_module(empty_init=True)``), sharded, and each rank reads only the slices of its own
shards from the model directory's safetensors files.

    # a small random Llama in the Hugging Face layout, standing in for a downloaded model directory
    python examples/finetune_hf.py --save-tiny outputs/tiny-llama
    # fine-tune it (any directory written by save_pretrained works the same way)
    python examples/finetune_hf.py --model-dir outputs/tiny-llama --max-steps 20
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from lightning_shard import ShardStrategy
from lightning_shard.demos import TextDataModule


class CausalLMModule(L.LightningModule):
    """Any ``AutoModelForCausalLM`` as a LightningModule; next-byte prediction on the demo text."""

    def __init__(self, model_dir: str, lr: float = 1e-4) -> None:
        super().__init__()
        import transformers

        config = transformers.AutoConfig.from_pretrained(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def save_tiny(out: str) -> None:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,  # bytes: the demo text's tokens
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out, max_shard_size="500KB")
    print(f"saved a tiny Llama to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--save-tiny", metavar="DIR")
    parser.add_argument("--model-dir")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    if args.save_tiny:
        save_tiny(args.save_tiny)
        return
    if not args.model_dir:
        parser.error("pass --model-dir DIR (or --save-tiny DIR first)")
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=ShardStrategy(stage=3, init_weights=args.model_dir),
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with trainer.init_module(empty_init=True):  # parameters on the meta device: no memory yet
        model = CausalLMModule(args.model_dir)
    trainer.fit(model, TextDataModule(seq_len=64, batch_size=4, n_sentences=400))
    print(f"fine-tuned {args.model_dir} for {trainer.global_step} steps")


if __name__ == "__main__":
    main()
