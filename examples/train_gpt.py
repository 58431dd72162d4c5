"""Train the demo GPT with LightningCLI: every flag comes from a YAML in configs/.

    python examples/train_gpt.py fit --config configs/zero3.yaml

The LightningModule (lightning_shard/demos/gpt.py) knows nothing about sharding; ShardStrategy and
the callbacks are chosen in the YAML.
"""

from lightning.pytorch.cli import LightningCLI

import lightning_shard  # noqa: F401  (registers strategy="zero1"/"zero2"/"zero3")
from lightning_shard.demos import GPTModule, TextDataModule


def main() -> None:
    LightningCLI(GPTModule, TextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
