"""Train the example GPT with LightningCLI: every flag comes from a YAML in configs/.

    python examples/train_gpt.py fit --config configs/zero3.yaml

The LightningModule (examples/gpt.py) knows nothing about sharding; ShardStrategy and the
callbacks are chosen in the YAML.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_shard  # noqa: E402,F401  (registers strategy="zero1"/"zero2"/"zero3")
from examples.gpt import GPTModule, TextDataModule  # noqa: E402


def main() -> None:
    LightningCLI(GPTModule, TextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
