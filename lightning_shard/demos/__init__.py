"""Demo models and data shipped with the package, as Lightning ships ``lightning.pytorch.demos``.

Tests, benchmarks and the examples import the demo GPT from here (no ``sys.path`` edits), and run
their multi-rank jobs with :func:`lightning_shard.demos.ranks.run_ranks`.

    from lightning_shard.demos import GPTModule, TextDataModule
"""

from lightning_shard.demos.gpt import GPT, Block, GPTModule, TextDataModule

__all__ = ["GPT", "Block", "GPTModule", "TextDataModule"]
