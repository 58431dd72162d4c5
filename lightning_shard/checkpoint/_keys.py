"""A weights file's keys matched to a module's state-dict keys (``init_weights=``), reading no tensor.

Keys match exactly, or through ONE leading prefix found by vote (:func:`find_prefix`): an HF model held as
``self.model`` in a LightningModule has keys ``model.`` + file key; a file saved from a wrapper (``module.``,
``model.``) has keys with a prefix the module lacks. A tied parameter is served by any of its names in the file.
Every mismatch (missing, unexpected, shape) is gathered for one report (:func:`mismatch_message`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

SHOWN = 5  # keys named per kind of mismatch in an error; the rest are counted


@dataclass(frozen=True)
class Prefix:
    """A leading key prefix on one side: ``on="model"``: module key = text + file key;
    ``on="file"``: file key = text + module key; ``on=""``: keys match as they are."""

    text: str = ""
    on: Literal["", "model", "file"] = ""

    def file_key(self, key: str) -> str | None:
        if self.on == "model":
            return key[len(self.text) :] if key.startswith(self.text) else None
        return self.text + key

    def describe(self) -> str:
        if self.on == "model":
            return f"the model's keys without their leading {self.text!r}"
        if self.on == "file":
            return f"the file's keys without their leading {self.text!r}"
        return "keys as they are (no prefix)"


def _dotted_prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) + "." for i in range(1, len(parts))]


def find_prefix(file_keys: list[str], model_keys: list[str]) -> Prefix:
    """The one prefix that matches the most keys; no prefix on a tie."""
    file_set, model_set = set(file_keys), set(model_keys)
    votes: Counter[Prefix] = Counter()
    for key in model_keys:
        votes.update(Prefix(p, "model") for p in _dotted_prefixes(key) if key[len(p) :] in file_set)
    for key in file_keys:
        votes.update(Prefix(p, "file") for p in _dotted_prefixes(key) if key[len(p) :] in model_set)
    exact = len(model_set & file_set)
    best = max(votes.items(), key=lambda item: item[1], default=(Prefix(), 0))
    return best[0] if best[1] > exact else Prefix()


def match(
    source: Any, targets: dict[str, tuple[torch.Size, torch.dtype]], aliases: list[set[str]]
) -> tuple[Prefix, dict[str, str], tuple[list[str], list[str], list[str]]]:
    """``(prefix, {module key: file key}, (missing, unexpected, mismatched))`` for ``source`` (a weight source:
    its ``keys()`` and each key's ``shape``) and the module's ``targets`` (key -> (global shape, dtype)). Each set
    in ``aliases`` is one tied parameter: any member in the file serves all of them."""
    file_keys = source.keys()
    prefix = find_prefix(file_keys, list(targets))
    file_set = set(file_keys)
    mapping = {t: f for t in targets if (f := prefix.file_key(t)) is not None and f in file_set}
    used = set(mapping.values())
    for group in aliases:
        present = [mapping[t] for t in targets if t in group and t in mapping]
        mapping.update({t: present[0] for t in targets if t in group and present})
    missing = [t for t in targets if t not in mapping]
    unexpected = [f for f in file_keys if f not in used]
    mismatched = [
        f"{t}: file shape {tuple(source.shape(f))}, model shape {tuple(targets[t][0])}"
        for t, f in mapping.items()
        if source.shape(f) != targets[t][0]
    ]
    return prefix, mapping, (missing, unexpected, mismatched)


def mismatch_message(
    path: Path, prefix: Prefix, missing: list[str], unexpected: list[str], mismatched: list[str]
) -> str:
    lines = [f"init_weights={str(path)!r} does not fit the model (compared {prefix.describe()}):"]
    if missing:
        lines.append(f"  {len(missing)} model keys missing from the file, e.g. {', '.join(missing[:SHOWN])}")
    if unexpected:
        shown = ", ".join(unexpected[:SHOWN])
        lines.append(f"  {len(unexpected)} file keys not in the model, e.g. {shown}")
    lines += [f"  shape mismatch: {line}" for line in mismatched]
    lines.append(
        "Check that the path holds the weights of this model, and that the model's config (layers,"
        " hidden size, heads, vocabulary size) matches the one the weights were saved with."
    )
    return "\n".join(lines)
