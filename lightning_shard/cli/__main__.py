"""``python -m lightning_shard.cli``: the ``lightning-shard`` console script."""

import sys

from lightning_shard.cli import main

sys.exit(main())
