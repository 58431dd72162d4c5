"""``ShardStrategy(gradient_compression=...)``: compressed gradient all-reduce at stages 0-1.

Stages 0-1 all-reduce gradients through ``DistributedDataParallel``, whose communication hooks are torch's
way to compress them (``torch.distributed.algorithms.ddp_comm_hooks``):

* ``"bf16"`` / ``"fp16"``: each bucket is cast before the all-reduce and back after (half the bytes); the
  same hook ``ShardPrecision(reduce_dtype=...)`` registers.
* ``"powersgd"`` or ``{"method": "powersgd", "rank": r, ...}``: PowerSGD (Vogels et al., 2019). Each
  gradient matrix M (n x m) is sent as two rank-r factors P (n x r) and Q (m x r), with error feedback:
  what the approximation missed on a rank is added to its next gradient. Torch's ``powerSGD_hook``; the
  dict's other keys are ``PowerSGDState`` arguments (``start_iter`` is ``start_powerSGD_iter``: the
  steps of plain all-reduce before compression starts, torch's default 1000; ``min_compression_rate``,
  ``warm_start``, ``orthogonalization_epsilon``, ``random_seed``...).

* ``"onebit_adam"`` or ``{"method": "onebit_adam", "freeze_step": n}`` (stage 0): 1-bit Adam
  (:mod:`lightning_shard.onebit`): the user's Adam / AdamW exact through ``freeze_step`` optimizer steps (default
  1000), then its momentum averaged as signs with error feedback and its variance frozen. Its error feedback
  is each rank's, saved under each rank's keys as PowerSGD's is.

PowerSGD's state travels in sharded checkpoints (:func:`state_dict` / :func:`load_state_dict`), keyed by
parameter name (:class:`PowerSGDHook`: DDP's buckets change between a run and its resume): the step count,
the random generator, the warm-start factors (the same on every rank) and each rank's error feedback
under its own rank's keys. Resumed on another world size, the error feedback and factors start
over (a warning says so); the step count and the generator carry on.

At stages 2-3 gradients are reduce-scattered by FSDP2, with no hook: the lever there is the reduce dtype
(``ShardPrecision(reduce_dtype=torch.bfloat16)``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    _should_compress,
    powerSGD_hook,
)

from lightning_shard.onebit import OneBitHook

log = logging.getLogger(__name__)

#: The key of PowerSGD's state in a sharded checkpoint.
STATE_KEY = "lightning_shard_powersgd"
_RENAMED = {"rank": "matrix_approximation_rank", "start_iter": "start_powerSGD_iter"}


def _powersgd_arguments() -> set[str]:
    return set(inspect.signature(PowerSGDState.__init__).parameters) - {"self", "process_group"}


def check_compression(value: Any, checkpoint: str, stage: Any) -> dict | None:
    """``gradient_compression=`` as ``{"method": ..., **options}``, or a ``ValueError`` naming the fix. Whether the
    engine has a DDP wrapper to hook at the stage is its ``Capabilities.ddp_options_stages``."""
    if value is None:
        return None
    flag = f"ShardStrategy(gradient_compression={value!r})"
    if isinstance(value, str):
        value = {"method": value}
    if not isinstance(value, dict) or value.get("method") not in ("bf16", "fp16", "powersgd", "onebit_adam"):
        raise ValueError(
            f"{flag} must be 'bf16', 'fp16', 'powersgd', 'onebit_adam' or a dict {{'method': 'powersgd', 'rank': 4,"
            " ...}} / {'method': 'onebit_adam', 'freeze_step': 1000}."
        )
    method = value["method"]
    if method == "onebit_adam":
        return _check_onebit(flag, value, checkpoint, stage)
    options = {str(_RENAMED.get(k, k)): v for k, v in value.items() if k != "method"}
    if method != "powersgd" and options:
        raise ValueError(f"{flag}: {method} takes no options; only 'powersgd' does (rank, start_iter, ...).")
    unknown = sorted(set(options) - _powersgd_arguments())
    if unknown:
        raise ValueError(
            f"{flag} has {unknown}, which PowerSGDState does not take. Use rank, start_iter or"
            f" {sorted(_powersgd_arguments())}."
        )
    if method == "powersgd" and checkpoint == "full":
        raise ValueError(
            f"{flag} keeps error feedback on every rank, which checkpoint='full' (rank 0's one file) would"
            " lose. Use checkpoint='sharded'."
        )
    return {"method": method, **options}


def _check_onebit(flag: str, value: dict[str, Any], checkpoint: str, stage: Any) -> dict[str, Any]:
    unknown = sorted(set(value) - {"method", "freeze_step"})
    if unknown:
        raise ValueError(
            f"{flag} has {unknown}; 1-bit Adam takes 'freeze_step' (the exact Adam steps before it)."
        )
    freeze_step = value.get("freeze_step", 1000)
    if not isinstance(freeze_step, int) or isinstance(freeze_step, bool) or freeze_step < 1:
        raise ValueError(
            f"{flag}: freeze_step={freeze_step!r} must be an int >= 1: the exact Adam steps that settle the variance"
            " before it is frozen (the paper uses 15-25% of the run's steps)."
        )
    if stage != 0:
        raise ValueError(
            f"{flag} needs stage=0, got stage={stage!r}: after its warm-up each rank folds its own gradient into the"
            " whole momentum, which ZeRO-1 partitions across the ranks and stages 2-3 never see unreduced"
            " (FSDP2 reduce-scatters without a hook). Use stage=0, or gradient_compression='powersgd' at stage 1."
        )
    if checkpoint == "full":
        raise ValueError(
            f"{flag} keeps error feedback on every rank, which checkpoint='full' (rank 0's one file) would"
            " lose. Use checkpoint='sharded'."
        )
    return {"method": "onebit_adam", "freeze_step": freeze_step}


def hook_and_state(compression: dict[str, Any], group: Any, module: nn.Module) -> tuple[Any, Any]:
    """The DDP communication hook and its state for ``compression`` (:func:`check_compression`'s result)."""
    method = compression["method"]
    if method == "onebit_adam":
        return OneBitHook(compression["freeze_step"]), group
    if method == "bf16":
        return default_hooks.bf16_compress_hook, group
    if method == "fp16":
        return default_hooks.fp16_compress_hook, group
    options = {k: v for k, v in compression.items() if k != "method"}
    state = PowerSGDState(process_group=group, **options)
    return PowerSGDHook(module), state


Layout = list[tuple[str, torch.Size]]


class PowerSGDHook:
    """torch's ``powerSGD_hook`` whose per-bucket state also survives a new bucket layout.

    PowerSGD keys its error feedback and warm-start factors by bucket index, as flat tensors in the
    bucket's parameter order; DDP builds new buckets after its first iteration (in the order gradients
    became ready) and a resumed run starts from the first layout again. Whenever a bucket arrives in a
    layout other than the one its state was made in, every bucket's state is taken apart by parameter
    name and put together again in the new layout, so the result is the same as if nothing had changed.
    Checkpoints hold it by parameter name (:meth:`named_state`).
    """

    def __init__(self, module: nn.Module) -> None:
        # Lightning logs a hook by its qualified name; DDP checks its name.
        self.__name__ = self.__qualname__ = "powerSGD_hook"
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.layouts: dict[int, Layout] = {}  # bucket index -> its parameters, as the state was made
        self.pending: dict[str, dict[str, Tensor]] = {"error": {}, "p": {}, "q": {}}

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future[Tensor]:
        index = bucket.index()
        layout = [(self.names[id(p)], p.shape) for p in bucket.parameters()]
        if index in self.layouts and self.layouts[index] != layout:
            self.pending = self.named_state(state)
            for tensors in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                tensors.clear()
            self.layouts.clear()
        if index not in self.layouts:
            self._assemble(state, index, layout, bucket.buffer())
        self.layouts[index] = layout
        future = powerSGD_hook(state, bucket)
        if not future.done():
            # torch's hook issues its P and Q all-reduces from callbacks of the previous all-reduce's future.
            # Where that future completes later on a worker thread (gloo), the callbacks would issue them
            # there while this thread goes on to the next bucket's all-reduce: the order of the collectives
            # would then depend on timing and differ between ranks (gloo: "Received data size doesn't
            # match expected size"). Finishing each bucket here keeps one order on every rank. (NCCL's
            # futures complete at once: the callbacks have run, in this thread, before the hook returns.)
            future.wait()
        return future

    def named_state(self, state: Any) -> dict[str, dict[str, Tensor]]:
        """``{"error" | "p" | "q": {parameter name: tensor}}`` of every bucket, plus what waits to be put back."""
        out = {kind: dict(tensors) for kind, tensors in self.pending.items()}
        for index, layout in self.layouts.items():
            if index in state.error_dict:
                sizes = [shape.numel() for _, shape in layout]
                for (name, _), piece in zip(layout, state.error_dict[index].split(sizes), strict=True):
                    out["error"][name] = piece.clone()
            if index in state.p_memory_dict:
                for kind, memory in (("p", state.p_memory_dict), ("q", state.q_memory_dict)):
                    pieces = _factor_sizes(state, layout, kind)
                    chunks = memory[index].split([size for _, size in pieces])
                    out[kind].update(
                        {name: chunk.clone() for (name, _), chunk in zip(pieces, chunks, strict=True)}
                    )
        return out

    def _assemble(self, state: Any, index: int, layout: Layout, buffer: Tensor) -> None:
        names = [name for name, _ in layout]
        errors = self.pending["error"]
        if names and all(name in errors for name in names):
            state.error_dict[index] = torch.cat([errors.pop(name) for name in names]).to(buffer)
        for kind, memory in (("p", state.p_memory_dict), ("q", state.q_memory_dict)):
            pieces = _factor_sizes(state, layout, kind)
            saved = self.pending[kind]
            if pieces and all(name in saved and saved[name].numel() == size for name, size in pieces):
                memory[index] = torch.cat([saved.pop(name).reshape(-1) for name, _ in pieces]).to(buffer)
        if (index in state.p_memory_dict) != (index in state.q_memory_dict):  # warm start needs both
            state.p_memory_dict.pop(index, None)
            state.q_memory_dict.pop(index, None)


# DDP checks a hook's annotations as objects, not the strings postponed evaluation leaves.
PowerSGDHook.__call__.__annotations__ = {
    "state": Any,
    "bucket": torch.distributed.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _factor_sizes(state: Any, layout: Layout, kind: str) -> list[tuple[str, int]]:
    """The parameters whose gradients PowerSGD compresses, in the order it lays out their P (or Q) factors
    (grouped by matrix shape, first seen first), each with its factor's size."""
    by_shape: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for name, shape in layout:
        n = shape[0] if len(shape) else 1
        m = shape.numel() // n if n else 0
        rank = min(n, m, state.matrix_approximation_rank)
        if _should_compress(n, m, rank, state.min_compression_rate)[0]:
            by_shape.setdefault((n, m), []).append((name, (n if kind == "p" else m) * rank))
    return [piece for pieces in by_shape.values() for piece in pieces]


def state_dict(hook: PowerSGDHook | OneBitHook, state: Any, rank: int, world_size: int) -> dict[str, Tensor]:
    """PowerSGD's state as tensors keyed by parameter name (``weights_only``-safe): the step, the generator
    and the warm-start factors (the same on every rank), and this rank's error feedback (1-bit Adam's: this
    rank's error feedback)."""
    if isinstance(hook, OneBitHook):
        return hook.state_dict(rank, world_size)
    _, keys, pos, has_gauss, cached = state.rng.get_state()
    out: dict[str, Tensor] = {
        "iter": torch.tensor(state.iter),
        "world_size": torch.tensor(world_size),
        "rng_keys": torch.from_numpy(keys.astype("int64")),
        "rng_rest": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "rng_gauss": torch.tensor(cached, dtype=torch.float64),
    }
    named = hook.named_state(state)
    for kind in ("p", "q"):
        out.update({f"{kind}.{name}": t for name, t in named[kind].items()})
    out.update({f"rank{rank}.error.{name}": t for name, t in named["error"].items()})
    return out


def load_target(metadata: Any, rank: int) -> dict[str, Tensor] | None:
    """Empty tensors to read this rank's PowerSGD state into: the shared entries and this rank's error
    feedback, shaped as DCP's ``metadata`` records them (None: the checkpoint holds no PowerSGD state)."""
    prefix = STATE_KEY + "."
    entries = {
        fqn[len(prefix) :]: meta
        for fqn, meta in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and hasattr(meta, "size")
    }
    if "world_size" not in entries:
        return None
    own = (
        f"rank{rank}."  # this rank's error feedback (PowerSGD's "rank{r}.error.*", 1-bit Adam's "rank{r}.*")
    )
    return {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if not key.startswith("rank") or key.startswith(own)
    }


def load_state_dict(
    hook: PowerSGDHook | OneBitHook, state: Any, saved: dict[str, Tensor], rank: int, world_size: int
) -> None:
    """Restore :func:`state_dict`'s tensors (error feedback and factors only on the same world size); they are
    put into buckets as each bucket next arrives."""
    if isinstance(hook, OneBitHook):
        hook.load_state_dict(saved, rank, world_size)
        return
    if "iter" not in saved:
        raise ValueError(
            "ShardStrategy(gradient_compression='powersgd'): the checkpoint holds another method's compression"
            " state; resume with the gradient_compression it was written with."
        )
    state.iter = int(saved["iter"])
    pos, has_gauss = (int(v) for v in saved["rng_rest"])
    keys = saved["rng_keys"].numpy().astype(np.uint32)
    state.rng.set_state(("MT19937", keys, pos, has_gauss, float(saved["rng_gauss"])))
    for tensors in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
        tensors.clear()
    hook.layouts.clear()
    hook.pending = {"error": {}, "p": {}, "q": {}}
    if int(saved["world_size"]) != world_size:
        log.warning(
            "ShardStrategy(gradient_compression='powersgd'): the checkpoint was written on %d ranks and resumes"
            " on %d: PowerSGD's error feedback and warm-start factors start over.",
            int(saved["world_size"]),
            world_size,
        )
        return
    own = f"rank{rank}.error."
    for key, tensor in saved.items():
        if key.startswith(own):
            hook.pending["error"][key[len(own) :]] = tensor
        elif key[:2] in ("p.", "q."):
            hook.pending[key[0]][key[2:]] = tensor
