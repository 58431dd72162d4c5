"""The ``lightning-shard`` console script.

``lightning-shard consolidate CKPT OUT.pt`` writes one plain state-dict file (``torch.load`` +
``module.load_state_dict``) from a sharded checkpoint directory or a full checkpoint file.
"""

from __future__ import annotations

import argparse
import sys

from lightning_shard import checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-shard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    consolidate = sub.add_parser("consolidate", help="write a sharded checkpoint's model weights as one file")
    consolidate.add_argument("checkpoint", help="a sharded checkpoint directory or a full checkpoint file")
    consolidate.add_argument("out", help="output file, e.g. model.pt")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "consolidate":
        try:
            out = checkpoint.consolidate(args.checkpoint, args.out)
        except (FileNotFoundError, ValueError) as err:
            print(f"lightning-shard consolidate: {err}", file=sys.stderr)
            return 2
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
