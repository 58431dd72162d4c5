"""``fault_tolerance={"semi_sync": ..., ...}``, checked: DiLoCo or local SGD between replica groups.

With ``semi_sync`` the groups no longer average their gradients at every step: each trains alone for
``sync_every`` (H) optimizer steps, then the groups average their weights' change (DiLoCo, arXiv 2311.08105:
the pseudo-gradient, last-sync weights minus current ones, stepped by an outer SGD with Nesterov momentum) or
the weights themselves (``"local_sgd"``). The run-time side is :mod:`.diloco`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

SemiSyncKind = Literal["diloco", "local_sgd"]
#: The semi-synchronous keys of ``fault_tolerance={...}``.
SEMI_SYNC_KEYS = (
    "semi_sync",
    "sync_every",
    "fragments",
    "fragment_sync_delay",
    "fragment_update_alpha",
    "outer_optimizer",
)
_OUTER_KEYS = ("lr", "momentum", "nesterov")


@dataclass(frozen=True)
class OuterOptimizer:
    """``fault_tolerance["outer_optimizer"]``: the DiLoCo paper's outer ``torch.optim.SGD``."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass(frozen=True)
class SemiSync:
    """Semi-synchronous training between replica groups (``fault_tolerance["semi_sync"]`` and its keys)."""

    kind: SemiSyncKind
    #: H: the optimizer steps each group takes alone between two syncs of a fragment.
    sync_every: int
    #: k: the model's trainable parameters cut in k fragments (module order), fragment i synced after the steps s
    #: where ``s % H == i * H // k`` (streaming DiLoCo: one fragment's traffic at a time).
    fragments: int = 1
    #: w = alpha * local + (1 - alpha) * synced, after each sync (0: the synced weights).
    fragment_update_alpha: float = 0.0
    #: DiLoCo's outer optimizer (``None`` for local SGD: the weights' plain mean).
    outer: OuterOptimizer | None = None

    def due(self, step: int) -> int | None:
        """The fragment synced after optimizer step ``step`` (counted from 1), if any."""
        for fragment in range(self.fragments):
            if step % self.sync_every == fragment * self.sync_every // self.fragments:
                return fragment
        return None


def semi_sync_from(given: dict[str, Any], flag: str) -> SemiSync | None:
    """The :class:`SemiSync` of the given keys (``None`` without ``semi_sync``); ``flag`` names the argument."""
    kind = given.get("semi_sync")
    if kind is None:
        extra = [key for key in SEMI_SYNC_KEYS if key in given and key != "semi_sync"]
        if extra:
            raise ValueError(
                f"{flag}: {extra[0]}={given[extra[0]]!r} is read only with semi_sync='diloco' or 'local_sgd'"
                " (without, gradients are averaged over the groups at every step). Set semi_sync, or drop it."
            )
        return None
    if kind not in ("diloco", "local_sgd"):
        raise ValueError(
            f"{flag}: semi_sync={kind!r} is unknown. Use 'diloco' (an outer SGD over the averaged weight change),"
            " 'local_sgd' (the weights' plain mean) or None (gradients averaged at every step)."
        )
    every = given.get("sync_every")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"{flag}: semi_sync={kind!r} needs sync_every=H, an integer >= 1 (got sync_every={every!r}): the"
            " optimizer steps each group takes alone between syncs. Set e.g. sync_every=100."
        )
    fragments = given.get("fragments", 1)
    if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= every:
        raise ValueError(
            f"{flag}: fragments={fragments!r} must be an integer in [1, sync_every={every}]: fragment i is synced"
            " at the steps where step % sync_every == i * sync_every // fragments, and more fragments than"
            " sync_every would put two on one step. Use fewer fragments or a larger sync_every."
        )
    delay = given.get("fragment_sync_delay", 0)
    if delay != 0:
        raise ValueError(
            f"{flag}: fragment_sync_delay={delay!r} is not supported: a sync is taken whole after its step (the"
            " all-reduce is not overlapped with the next steps' compute). Drop it, or set fragment_sync_delay=0."
        )
    alpha = given.get("fragment_update_alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(
            f"{flag}: fragment_update_alpha={alpha!r} must be a number in [0, 1]: the local weights' share after"
            " a sync (w = alpha * local + (1 - alpha) * synced). Use 0.0 for the synced weights."
        )
    return SemiSync(kind, every, fragments, float(alpha), _outer(kind, given.get("outer_optimizer"), flag))


def _outer(kind: str, value: Any, flag: str) -> OuterOptimizer | None:
    if kind == "local_sgd":
        if value is not None:
            raise ValueError(
                f"{flag}: outer_optimizer={value!r} is read only with semi_sync='diloco' ('local_sgd' takes the"
                " weights' plain mean). Use semi_sync='diloco', or drop outer_optimizer."
            )
        return None
    if value is None:
        return OuterOptimizer()
    unknown = sorted(set(value) - set(_OUTER_KEYS)) if isinstance(value, dict) else ["(not a dict)"]
    if unknown:
        raise ValueError(
            f"{flag}: outer_optimizer={value!r} must be a dict of {', '.join(_OUTER_KEYS)} (torch.optim.SGD's),"
            f" got {unknown[0]!r}. The paper's: {{'lr': 0.7, 'momentum': 0.9, 'nesterov': True}}."
        )
    outer = OuterOptimizer(
        lr=float(value.get("lr", 0.7)),
        momentum=float(value.get("momentum", 0.9)),
        nesterov=bool(value.get("nesterov", True)),
    )
    if outer.lr <= 0 or outer.momentum < 0 or (outer.nesterov and outer.momentum == 0):
        raise ValueError(
            f"{flag}: outer_optimizer={value!r} needs lr > 0, momentum >= 0, and momentum > 0 with nesterov"
            " (torch.optim.SGD's rule). The paper's: {'lr': 0.7, 'momentum': 0.9, 'nesterov': True}."
        )
    return outer
