"""One training step of a dry-run rank traced under fake tensors: its peak memory by category, and the bytes of
the collectives the fake group receives.

Where the step is traced (``dryrun(..., trace_step=True)``), the rank is set up as without it, but its module is
laid out on the CPU under torch's ``FakeTensorMode`` instead of on the meta device (FSDP2 refuses a forward on
meta shards; fake tensors carry shapes, dtypes and devices and allocate nothing). After the set-up's step on zero
gradients, which leaves the optimizer's state, one forward of a batch of token ids, a backward of the mean of the
output and the optimizer's step run inside torch's memory tracker (``FSDPMemTracker`` over an FSDP2 module,
``MemTracker`` otherwise), which records the live bytes of each category at the step's peak; a dispatch mode
counts every collective the fake group receives by kind.

Not traced (the report's ``notes`` say why): pipeline stages (the stage runner sends activations between ranks)
and context parallelism (the sequence is split by the runner's buffers). ``CommDebugMode`` is not used: in
torch 2.13 its module tracker fails on FSDP2's forward hooks (``IndexError`` in ``_fw_set_module_hook``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_shard.parallel import ParallelDims

_KINDS = (
    ("all_gather", ("allgather", "all_gather")),
    ("reduce_scatter", ("reduce_scatter",)),
    ("all_reduce", ("allreduce", "all_reduce")),
    ("all_to_all", ("alltoall", "all_to_all")),
    ("broadcast", ("broadcast",)),
)


@contextmanager
def fake_tensors() -> Iterator[None]:
    """Tensors made under it are fake (on their device, nothing allocated), but the device meshes FSDP2 joins
    for a tensor-parallel parameter (``DeviceMesh._concatenate``) are built on real tensors: a mesh reads its
    rank map back as numbers, which a fake tensor does not hold."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate  # private torch API: the static method FSDP2's TP sharding calls

    def real(meshes: Any) -> Any:
        with unset_fake_temporarily():
            return concatenate(meshes)

    DeviceMesh._concatenate = staticmethod(real)  # type: ignore[method-assign,assignment]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign,assignment]


def untraceable(dims: ParallelDims) -> str | None:
    """Why a step of this layout is not traced, or ``None``."""
    if dims.pp > 1:
        return (
            "the step is not traced with pipeline stages (the stage runner sends activations between ranks)"
        )
    if dims.cp > 1:
        return (
            "the step is not traced with context parallelism (the sequence is split by the runner's buffers)"
        )
    return None


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _kind(name: str) -> str | None:
    for kind, marks in _KINDS:
        if any(mark in name for mark in marks):
            return kind
    return None


class CollectiveCounter(TorchDispatchMode):
    """Bytes of each collective dispatched under it, by kind: the call's largest buffer (all-gather's output,
    reduce-scatter's input, all-reduce's tensor), as :func:`~lightning_shard.dryrun.measure.collective_bytes`
    counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        namespace = getattr(func, "namespace", "")
        kind = _kind(func.__name__) if "c10d" in namespace else None
        if kind is not None and not func.__name__.startswith("wait"):
            size = max([_bytes(a) for a in (*args, *(kwargs or {}).values())] + [_bytes(out)])
            self.bytes[kind] = self.bytes.get(kind, 0) + size
            self.calls[kind] = self.calls.get(kind, 0) + 1
        return out


def sequence_length(module: nn.Module) -> int:
    """The model's own context length, found as the planner finds it (``seq_len``, ``max_position_embeddings``,
    ...), else 2048."""
    from lightning_shard.planner.model import _SEQ, _find_int

    return _find_int(module, _SEQ, deep=True) or 2048


def _loss(output: Any) -> torch.Tensor:
    """A scalar from the model's output: a tensor, a Hugging Face output's ``logits``, a tuple's first tensor."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        output = logits
    if not isinstance(output, torch.Tensor):
        output = next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor))
    return output.float().mean()


def _fsdp_root(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _tracker(model: nn.Module, optimizers: list[Optimizer]) -> Any:
    if _fsdp_root(model):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizers[0] if optimizers else None)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *optimizers)
    return tracker


def _key(category: Any) -> str:
    return str(getattr(category, "value", category)).lower().replace(" ", "_")


@contextmanager
def _quiet() -> Iterator[None]:
    """The trackers' own warnings about modules they see twice, silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def traced_step(
    model: nn.Module, optimizers: list[Optimizer], micro_batch: int, seq_len: int
) -> dict[str, Any]:
    """One step of ``model`` on a ``(micro_batch, seq_len)`` batch of token ids, on fake tensors: ``peak_bytes``,
    ``peak_breakdown`` (the live bytes of each category at the peak), ``traced_state_bytes`` (the parameters,
    gradients and optimizer state live after the backward) and ``traced_collective_bytes`` by kind."""
    tokens = torch.zeros((micro_batch, seq_len), dtype=torch.long, device="cpu")
    tracker, counter = _tracker(model, optimizers), CollectiveCounter()
    if _fsdp_root(model):
        tracker.track_inputs((tokens,))
    with _quiet(), tracker, counter:
        loss = _loss(model(tokens))
        loss.backward()
        held = _categories(tracker.get_tracker_snapshot("current"))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    at_peak = _categories(tracker.get_tracker_snapshot("peak"))
    total = at_peak.pop("total", sum(at_peak.values()))
    state = {kind: sum(held.get(name, 0) for name in names) for kind, names in _STATE.items()}
    return {
        "peak_bytes": total,
        "peak_breakdown": {k: v for k, v in at_peak.items() if v},
        "traced_state_bytes": state,
        "traced_collective_bytes": dict(sorted(counter.bytes.items())),
    }


#: The model state in the trackers' categories (``FSDPMemTracker``'s, ``MemTracker``'s).
_STATE = {
    "parameters": ("sharded_param", "parameter"),
    "gradients": ("sharded_grad", "gradient"),
    "optimizer": ("optstate",),
}


def _categories(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """The CPU's bytes by category in a tracker's snapshot (its keys as snake-case names)."""
    device = next((d for d in snapshot if getattr(d, "type", None) == "cpu"), None)
    return {_key(k): int(v) for k, v in (snapshot.get(device) or {}).items()}
