"""Which optimizers need whole matrices (Muon, Shampoo, SOAP: ``ShardStrategy(matrix_optimizer=...)``), and the
refusal of one that distributes its own step over the world: read by both engines, each of which steps such an
optimizer its own way (the FSDP engine: :mod:`.fsdp.whole_matrix`; DeepSpeed's: :mod:`.deepspeed.whole_matrix`).

Classes are recognised by module and name, so no optional optimizer package is imported to ask.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

#: Optimizer classes recognised as needing whole matrices, by module prefix and class name (none imported).
KNOWN: tuple[tuple[str, str], ...] = (
    ("torch.optim", "Muon"),
    ("heavyball", "Muon"),
    ("heavyball", "MuonAdamW"),
    ("heavyball", "SOAP"),
    ("heavyball", "ForeachSOAP"),
    ("heavyball", "ForeachMuon"),
    ("muon", "Muon"),
    ("muon", "MuonWithAuxAdam"),
    ("muon", "SingleDeviceMuon"),
    ("muon", "SingleDeviceMuonWithAuxAdam"),
)
#: Optimizers that spread their own work over every rank of the world, each assumed to hold every weight whole.
SELF_DISTRIBUTED: tuple[tuple[str, str], ...] = (("muon", "Muon"), ("muon", "MuonWithAuxAdam"))


def needs_whole_matrices(optimizer: Optimizer, flag: Any = None) -> bool:
    """``flag`` (``ShardStrategy(matrix_optimizer=...)``): ``None`` recognises the known classes (:data:`KNOWN`,
    subclasses included), ``True`` / ``False`` say it for every optimizer, a sequence of classes names them."""
    if isinstance(flag, bool):
        return flag
    if flag is not None:
        return isinstance(optimizer, tuple(flag))
    return any(_named(cls, KNOWN) for cls in type(optimizer).__mro__)


def _named(cls: type, known: tuple[tuple[str, str], ...]) -> bool:
    """``cls`` is one of ``known``: its name, in the package (or a module of the package) named."""
    return any(
        cls.__name__ == name and (cls.__module__ == package or cls.__module__.startswith(f"{package}."))
        for package, name in known
    )


def split_dims(p: Any) -> tuple[int, ...]:
    """The mesh dimensions a DTensor parameter is split over (none for a plain tensor or a replicated one)."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(i for i, placement in enumerate(p.placements) if not placement.is_replicate())


def check_own_distribution(optimizer: Optimizer, stage: int) -> None:
    """Refuse an optimizer that distributes its own step over the world where the ranks do not all hold every
    weight whole (anywhere but DDP's stage 0 without tensor parallelism)."""
    split = any(split_dims(p) for group in optimizer.param_groups for p in group["params"])
    if _named(type(optimizer), SELF_DISTRIBUTED) and (stage != 0 or split):
        name = type(optimizer).__name__
        raise ValueError(
            f"ShardStrategy(stage={stage}) cannot step muon.{name}: its step spreads the matrices over every rank"
            " and all-gathers each one over the world, assuming every rank holds every weight whole, which only"
            f" stage 0 without tensor parallelism gives. Use muon.SingleDevice{name}, the same update without its"
            " own distribution: ShardStrategy then steps each matrix whole on one owner rank (docs/optimizers.md)."
        )
