"""1-bit Adam (Tang et al., 2021, arXiv 2102.02888): Adam whose momentum crosses the wire as signs.

Through ``freeze_step`` optimizer steps the user's ``torch.optim.Adam`` / ``AdamW`` runs as it is, on gradients
all-reduced in full precision: the warm-up in which the variance settles. From the next step on the variance
(and its bias correction) stays as it was at ``freeze_step``, gradients are no longer all-reduced, and each
rank folds its own gradient into the momentum, which the ranks then average as signs
(:class:`CompressedAllreduce`):

1. worker side: each rank adds its worker error to its momentum, splits the result into one chunk per rank,
   and sends chunk ``j`` to rank ``j`` as its signs (8 per byte) and one scale, ``||chunk|| / sqrt(n)``; what
   the compression lost stays in the worker error for the next step;
2. server side: rank ``j`` averages the chunks it received (sign x scale), adds its server error, compresses
   the average the same way (keeping what it lost in its server error) and every rank gathers every server's
   signs and scale.

Every rank ends the step with the same momentum, and updates its weights with it and the frozen variance
exactly as torch's Adam / AdamW would (bias corrections, ``weight_decay`` as L2 for Adam and decoupled for
AdamW). On the wire after the warm-up: the momentum's signs twice (out to the servers, back from them) and two
scales per rank, about 1/32 of an fp32 all-reduce's bytes.

DeepSpeed's own implementation (``OnebitAdam``, with its NCCL / MPI compressed backends) was removed from
DeepSpeed in 2026; this one is written on ``torch.distributed`` (``all_to_all_single`` and
``all_gather_into_tensor``), so it runs on gloo and NCCL alike.

1-bit LAMB is not offered: its frozen per-layer trust ratios need a reconstruction of the fresh variance from
the compressed momentum (the paper's second stage), which this machinery does not carry.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: Bits of a packed byte, most significant first.
_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


def pack_signs(x: Tensor) -> Tensor:
    """The signs of ``x`` (``numel`` a multiple of 8), 8 per byte: bit set where ``x >= 0``."""
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8)
    return (bits << _SHIFTS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``+1`` / ``-1`` for every bit of ``packed`` (:func:`pack_signs`' inverse)."""
    bits = (packed.reshape(-1, 1) >> _SHIFTS.to(packed.device)) & 1
    return bits.reshape(-1).to(dtype) * 2 - 1


def _compress(x: Tensor, real: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of ``x`` as packed signs and one scale each (``||row|| / sqrt(real count)``), and what that lost.

    ``real`` holds each row's count of real entries; the padding after them is zero in ``x`` and stays zero in
    the error (it is never read back)."""
    scales = x.norm(dim=1) / real.clamp(min=1).sqrt()
    packed = pack_signs(x).reshape(x.shape[0], -1)
    decompressed = unpack_signs(packed, x.dtype).reshape(x.shape) * scales[:, None]
    mask = torch.arange(x.shape[1], device=x.device)[None, :] < real[:, None]
    return packed, scales, (x - decompressed) * mask


class CompressedAllreduce:
    """The mean of a flat tensor over ``group``'s ranks, sent as signs with error feedback on both sides.

    ``numel`` fixes the layout: ``world`` chunks of ``chunk`` entries (a multiple of 8), the padding at the
    end. The errors are this rank's: ``worker_error`` of the whole tensor, ``server_error`` of the chunk this
    rank serves. ``bytes_sent`` counts what this rank put on the wire (signs and scales, both phases)."""

    def __init__(self, numel: int, group: Any = None, device: torch.device | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel = numel
        self.chunk = 8 * math.ceil(numel / (8 * self.world))
        device = device or torch.device("cpu")
        starts = torch.arange(self.world, device=device) * self.chunk
        self.real = (numel - starts).clamp(0, self.chunk)  # each chunk's real entries
        self.worker_error = torch.zeros(self.world, self.chunk, device=device)
        self.server_error = torch.zeros(1, self.chunk, device=device)
        self.bytes_sent = 0

    def __call__(self, x: Tensor) -> Tensor:
        """``x`` (``numel`` entries, float32) averaged over the ranks, as every rank receives it."""
        world, chunk = self.world, self.chunk
        padded = torch.zeros(world * chunk, dtype=torch.float32, device=x.device)
        padded[: self.numel] = x.reshape(-1)
        rows = padded.reshape(world, chunk) + self.worker_error
        packed, scales, self.worker_error = _compress(rows, self.real)
        # worker -> server: chunk j's signs and scale to rank j
        received = torch.empty_like(packed)
        dist.all_to_all_single(received, packed, group=self.group)
        their_scales = torch.empty_like(scales)
        dist.all_to_all_single(their_scales, scales.contiguous(), group=self.group)
        mine = self.real[self.rank : self.rank + 1]
        signs = unpack_signs(received).reshape(world, chunk)
        mean = (signs * their_scales[:, None]).mean(dim=0, keepdim=True) * (
            torch.arange(chunk, device=x.device)[None, :] < mine[:, None]
        )
        server_packed, server_scale, self.server_error = _compress(mean + self.server_error, mine)
        # server -> every rank: each server's chunk
        gathered = torch.empty(world * server_packed.numel(), dtype=torch.uint8, device=x.device)
        dist.all_gather_into_tensor(gathered, server_packed.reshape(-1), group=self.group)
        gathered_scales = torch.empty(world, dtype=server_scale.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered_scales, server_scale, group=self.group)
        out = unpack_signs(gathered).reshape(world, chunk) * gathered_scales[:, None]
        self.bytes_sent += 2 * packed.numel() * (world - 1) // world + 2 * 4 * (world - 1)
        return out.reshape(-1)[: self.numel].to(x.dtype).reshape(x.shape)

    def state_dict(self) -> dict[str, Any]:
        """This rank's error feedback (other ranks hold their own)."""
        return {"worker_error": self.worker_error.clone(), "server_error": self.server_error.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["worker_error"].shape != self.worker_error.shape:
            raise ValueError(
                "gradient_compression='onebit_adam': the saved error feedback has the layout of"
                f" {tuple(state['worker_error'].shape)} (chunks x entries), this run {tuple(self.worker_error.shape)}:"
                " resume on the same number of ranks and the same parameters."
            )
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """A ``ValueError`` naming the fix where 1-bit Adam cannot take over ``optimizer``'s steps."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(
            f"gradient_compression='onebit_adam' compresses Adam's momentum; configure_optimizers returned"
            f" {type(optimizer).__name__}. Return torch.optim.Adam or torch.optim.AdamW, or use"
            " gradient_compression='powersgd' for other optimizers."
        )
    for group in optimizer.param_groups:
        for option in ("amsgrad", "maximize"):
            if group.get(option):
                raise ValueError(
                    f"gradient_compression='onebit_adam' freezes Adam's variance, which {option}=True changes"
                    f" at every step. Set {option}=False."
                )


class OneBitAdam:
    """Takes over the steps of the user's Adam / AdamW after ``freeze_step`` (see the module's docstring).

    The optimizer keeps its ``param_groups`` (schedulers move ``lr`` as before) and its state (``step``,
    ``exp_avg``, ``exp_avg_sq``), so its ``state_dict`` holds the frozen variance and the synchronized momentum;
    the error feedback is this rank's (:meth:`state_dict`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, freeze_step: int, group: Any = None) -> None:
        check_optimizer(optimizer)
        if not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(
                f"gradient_compression={{'method': 'onebit_adam', 'freeze_step': {freeze_step!r}}}: the variance is"
                " frozen after this many exact Adam steps, so it must be an int >= 1 (the paper uses 15-25% of the"
                " run's steps)."
            )
        self.optimizer, self.freeze_step, self.group = optimizer, freeze_step, group
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        self.allreduce = CompressedAllreduce(numel, group, self.params[0].device if self.params else None)

    def frozen(self) -> bool:
        """Whether the next step is a compressed one (the warm-up's ``freeze_step`` steps are behind): asked by
        DDP's hook for every bucket, so it reads one parameter's step count (all of them step together)."""
        state = self.optimizer.state.get(self.params[0]) if self.params else None
        return state is not None and int(state["step"]) >= self.freeze_step

    @torch.no_grad()
    def step(self) -> None:
        """One compressed step on this rank's own (not all-reduced) gradients."""
        momenta = []
        for group in self.optimizer.param_groups:
            beta1, _ = group["betas"]
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state = self.optimizer.state[p]
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                if group["weight_decay"] and not group.get("decoupled_weight_decay", False):
                    grad = grad.add(p, alpha=group["weight_decay"])  # Adam's L2 term
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                momenta.append(state["exp_avg"].reshape(-1))
        averaged = self.allreduce(torch.cat(momenta))
        offset = 0
        for group in self.optimizer.param_groups:
            beta1, beta2 = group["betas"]
            decoupled = group.get("decoupled_weight_decay", False)  # AdamW sets it
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state = self.optimizer.state[p]
                exp_avg = state["exp_avg"]
                exp_avg.copy_(averaged[offset : offset + p.numel()].reshape(p.shape))
                offset += p.numel()
                state["step"] += 1
                step = state["step"]
                lr = float(group["lr"])
                if group["weight_decay"] and decoupled:
                    p.mul_(1 - lr * group["weight_decay"])
                bias_correction1 = 1 - beta1 ** float(step)
                bias_correction2 = 1 - beta2**self.freeze_step  # the variance's, frozen with it
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

    def state_dict(self) -> dict[str, Any]:
        return self.allreduce.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.allreduce.load_state_dict(state)


class OneBitHook:
    """DDP's communication hook under ``gradient_compression='onebit_adam'`` (stage 0): through the warm-up
    the gradients' mean (torch's ``allreduce_hook``), after it each rank's own gradients, untouched, for
    :meth:`OneBitAdam.step` to fold into the momentum. :meth:`attach` hands it the optimizer, whose ``step``
    then takes the compressed path once the warm-up is over (Lightning's closure runs first, as before)."""

    def __init__(self, freeze_step: int) -> None:
        self.__name__ = self.__qualname__ = "onebit_adam_hook"  # Lightning logs a hook by its name
        self.freeze_step = freeze_step
        self.onebit: OneBitAdam | None = None
        self.pending: dict[str, Any] | None = None  # error feedback read from a checkpoint before attach

    def __call__(self, state: Any, bucket: Any) -> Any:
        if self.onebit is None or not self.onebit.frozen():
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            return default_hooks.allreduce_hook(state, bucket)
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    def attach(self, optimizer: torch.optim.Optimizer, group: Any) -> None:
        onebit = OneBitAdam(optimizer, self.freeze_step, group)
        if self.pending is not None:
            onebit.load_state_dict(self.pending)
            self.pending = None
        self.onebit = onebit
        exact = optimizer.step

        def step(closure: Any = None) -> Any:
            if not onebit.frozen():
                return exact(closure)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            onebit.step()
            return loss

        optimizer.step = step  # type: ignore[method-assign]

    def state_dict(self, rank: int, world_size: int) -> dict[str, Tensor]:
        """This rank's error feedback under its own keys (tensors only: ``weights_only``-safe)."""
        out = {"world_size": torch.tensor(world_size)}
        if self.onebit is not None:
            out.update({f"rank{rank}.{k}": v for k, v in self.onebit.state_dict().items()})
        return out

    def load_state_dict(self, saved: dict[str, Tensor], rank: int, world_size: int) -> None:
        if "iter" in saved:
            raise ValueError(
                "ShardStrategy(gradient_compression='onebit_adam'): the checkpoint holds PowerSGD's state; resume"
                " with the gradient_compression it was written with."
            )
        own = {k.split(".", 1)[1]: v for k, v in saved.items() if k.startswith(f"rank{rank}.")}
        if int(saved["world_size"]) != world_size or not own:
            import logging

            logging.getLogger(__name__).warning(
                "ShardStrategy(gradient_compression='onebit_adam'): the checkpoint was written on %d ranks and"
                " resumes on %d: the error feedback starts over (the momentum and frozen variance carry on).",
                int(saved["world_size"]),
                world_size,
            )
            return
        if self.onebit is None:
            self.pending = own
        else:
            self.onebit.load_state_dict(own)


# DDP checks a hook's annotations as objects, not the strings postponed evaluation leaves.
OneBitHook.__call__.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
