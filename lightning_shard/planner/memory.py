"""Bytes per device for one configuration (stage, offloads, checkpointing), and the search for the cheapest.

Model state follows the ZeRO table in docs/strategy.md ("Memory per rank"): Ψ parameters over N
ranks, p bytes per stored parameter, gradients of the parameter's dtype, K = n·p bytes of optimizer
state (Adam: n = 2). Mixed-precision Adam is 4 + 4 + 8 = 16 bytes per parameter, the ZeRO paper's 2 + 2 + 12 in another
split (its fp16 parameter and gradient plus fp32 master, exp_avg and exp_avg_sq): the same 16Ψ at
stages 0 and 3. Offloading moves bytes to host memory: ``offload_optimizer`` the optimizer state,
``offload_params`` the parameter shards (stage 3), and both together (FSDP2 ``CPUOffloadPolicy``, the
optimizer steps on the host) the gradient shards as well. Which flag combinations run at all is the
strategy's rule, not this module's: :mod:`lightning_shard.planner.accepted` asks ``ShardConfig``.
With ``expert_parallel_size`` = e a device holds E / e experts of each experts module: the experts' Ψ_E
count Ψ_E / e at stages 0-1 and Ψ_E / N at stages 2-3 (their optimizer state Ψ_E / N from stage 1: each
block's partitioned over the N / e ranks holding it), its parameter copies and gradient buffers are of
those E / e, and the all-to-all's buffers join the working buffers (:mod:`lightning_shard.planner.experts`).
Where the model's tensors are known (a module, not a bare count) the model state is instead counted tensor by
tensor for the first and last rank of each pipeline stage's shard group (:mod:`.shards`: TP's whole embeddings,
FSDP2's padded dim-0 chunks, experts fewer than their shard group, ZeRO-1's whole-tensor partition), and a row
carries the worst of them.

Working buffers are what exists only during a step, on top of the model state and activations:

* parameter copies (of the E / e experts a device holds, under expert parallelism): stage 2 holds every
  unit's gathered parameters from forward to backward (Ψ·c);
  stage 3 the root unit and two blocks (the one computing and the one prefetched); stages 0-1 in mixed
  precision keep autocast's low-precision weight copies for backward (except inside checkpointed blocks);
* gradient buffers: DDP's buckets, a second copy of the gradients (stages 0-1); the unsharded gradients
  of two units before their reduce-scatter (stages 2-3);
* the loss: a language model's fp32 log-softmax of the logits and its gradient, 8 bytes x tokens x V;
* recompute: the activations of the one block being recomputed in backward;
* all-to-all (expert parallelism): one layer's send and receive buffers of its tokens' routed rows.
* whole matrices (a whole-matrix optimizer, ``muon``, where parameters are split: stages 2-3, tensor
  parallelism): during the step each rank holds the matrices it owns whole with their gradients (about 1/N of
  them, plus the largest matrix for the owners' imbalance), and one other matrix and its gradient as they
  pass through (``engines/fsdp/whole_matrix.py``). Its optimizer state is 1/N per device, as ZeRO's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_shard.planner import shards
from lightning_shard.planner.activations import activation_bytes, block_activation_bytes
from lightning_shard.planner.experts import all_to_all_bytes
from lightning_shard.planner.model import Checkpointing, ModelShape
from lightning_shard.planner.shards import Place
from lightning_shard.tiling import loss_tile

Offload = Literal["none", "cpu", "nvme"]
Optimizer = Literal["adam", "adamw", "sgd", "momentum", "muon"]
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 0, "momentum": 1, "muon": 1}
#: Optimizers whose update needs whole matrices: stepped whole on one owner rank where parameters are split.
WHOLE_MATRIX = frozenset({"muon"})
CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "selective", "full")
# precision: (stored parameter bytes p, compute bytes c, gradient-reduction bytes)
PRECISION_BYTES: dict[str, tuple[int, int, int]] = {
    "32-true": (4, 4, 4),
    "bf16-mixed": (4, 2, 4),
    "16-mixed": (4, 2, 4),
    "bf16-true": (2, 2, 2),
}


@dataclass(frozen=True)
class Config:
    """One way to run: the flags of ``ShardStrategy`` the planner chooses between."""

    stage: int
    offload_optimizer: Offload = "none"
    offload_params: Offload = "none"
    activation_checkpointing: Checkpointing = "none"
    replicate_size: int = 1
    """HSDP: replicas of the shard group (stages 2-3); 1 shards over every data-parallel rank."""
    tensor_parallel_size: int = 1
    """Ranks of one tensor-parallel group (within a node); 1 is data parallelism alone."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (the outermost mesh dimension); 1 is none."""
    microbatches: int | None = None
    """With pipeline stages: the pieces each batch is cut into (None: the strategy's default)."""
    context_parallel_size: int = 1
    """Ranks each sequence is cut over (:mod:`lightning_shard.context_parallel`); 1 is none."""
    context_parallel_method: str = "allgather"
    """How attention runs across the cut sequence: ``"allgather"``, ``"ulysses"`` or ``"ring"``."""
    tiled_mlp: bool = False
    """``ShardStrategy(tiled_mlp=True)``: the MLPs' hidden units are recomputed tile by tile, not kept."""
    tiled_loss: bool = False
    """``ShardStrategy(tiled_loss=True)``: the logits exist one tile at a time (:mod:`lightning_shard.tiling`)."""
    expert_parallel_size: int = 1
    """Ranks each experts module's experts are split over (:mod:`.experts`); 1 is none."""

    @property
    def offloads(self) -> int:
        return (self.offload_optimizer != "none") + (self.offload_params != "none")

    def cost(self) -> tuple[int, int, int, int, int]:
        """Cheapest first: lowest stage, then fewest offloads, then least recompute, then the most expert
        parallelism.

        Between one offload and another, the optimizer's goes first: it crosses to the host once per
        step, offloaded parameters twice per micro-batch (gathered for forward and for backward). A
        larger ``expert_parallel_size`` holds (stage 0) or gathers (stages 2-3) fewer experts per device
        and reduces their gradients over fewer ranks, for the same all-to-all per token.
        """
        return (
            self.stage,
            self.offloads,
            CHECKPOINTING.index(self.activation_checkpointing),
            self.offload_params != "none",
            -self.expert_parallel_size,
        )

    def strategy_kwargs(self, engine: str = "auto", nvme_path: str | None = None) -> dict[str, Any]:
        """These flags as ``ShardStrategy`` keyword arguments, defaults left out.

        ``engine`` and ``nvme_path`` are not searched: they are kept as the user fixed them (the path
        only where something goes to NVMe, since the strategy refuses a path that nothing uses).
        """
        kwargs: dict[str, Any] = {"stage": self.stage}
        if engine != "auto":
            kwargs["engine"] = engine
        for size in (
            "replicate_size",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "context_parallel_size",
            "expert_parallel_size",
        ):
            if getattr(self, size) != 1:
                kwargs[size] = getattr(self, size)
        if self.context_parallel_size > 1 and self.context_parallel_method != "allgather":
            kwargs["context_parallel_method"] = self.context_parallel_method
        if self.pipeline_parallel_size > 1 and self.microbatches is not None:
            kwargs["microbatches"] = self.microbatches
        for tiled in ("tiled_mlp", "tiled_loss"):
            if getattr(self, tiled):
                kwargs[tiled] = True
        for flag in ("offload_optimizer", "offload_params", "activation_checkpointing"):
            if getattr(self, flag) != "none":
                kwargs[flag] = getattr(self, flag)
        if nvme_path is not None and "nvme" in (self.offload_optimizer, self.offload_params):
            kwargs["nvme_path"] = nvme_path
        return kwargs

    def strategy_line(self, engine: str = "auto", nvme_path: str | None = None) -> str:
        """The exact ``ShardStrategy(...)`` call, naming only flags that differ from the defaults."""
        return format_strategy(self.strategy_kwargs(engine, nvme_path))


def format_strategy(kwargs: dict[str, Any]) -> str:
    """``ShardStrategy(stage=3, offload_optimizer="cpu")``: Python that evaluates to the strategy."""
    # json.dumps quotes and escapes a string as a valid Python literal too (paths with quotes or backslashes).
    args = [f"{name}={json.dumps(v) if isinstance(v, str) else repr(v)}" for name, v in kwargs.items()]
    return f"ShardStrategy({', '.join(args)})"


def unsupported(config: Config, layers: int) -> str | None:
    """Why this model cannot run ``config``, or None; the flags themselves are checked by the strategy."""
    if config.activation_checkpointing != "none" and layers == 0:
        return (
            f'activation_checkpointing="{config.activation_checkpointing}" needs repeated blocks, and the'
            ' model has none. Use activation_checkpointing="none".'
        )
    return None


@dataclass(frozen=True)
class Breakdown:
    """Bytes on one device (and on its host, for offloaded state) for one configuration."""

    config: Config
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    host: int
    usable: int
    buffers_detail: dict[str, int] = field(default_factory=dict)
    expert_parameters: int = 0
    """Of ``parameters``: the experts' (mixture of experts), ``Ψ_E x p / e`` at stage 0, ``/ N`` at stages 2-3."""
    unsupported: str | None = None
    """Why this configuration cannot run (the strategy's or the model's reason), or None."""
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    """The ``ShardStrategy`` keyword arguments this row stands for (filled when it is checked)."""
    places: tuple[Place, ...] = ()
    """Model state of the first and last rank of each pipeline stage's shard group, read off the model's tensors
    (:mod:`.shards`); ``parameters``, ``gradients`` and ``optimizer`` are the worst of them. Empty: the even split."""
    sharding: shards.Sharding | None = field(default=None, repr=False, compare=False)
    tensors: shards.TensorTable | None = field(default=None, repr=False, compare=False)

    def rank_figures(self, stage: int, index: int) -> dict[str, int] | None:
        """``parameters``, ``gradients``, ``optimizer`` and ``host`` of the rank at ``index`` of its shard group on
        pipeline stage ``stage`` (None without the model's tensors)."""
        if self.sharding is None or self.tensors is None:
            return None
        place = shards.place_state(self.tensors, self.sharding, stage, index)
        params, grads, optim, host = offloaded(
            self.config, place.parameters, place.gradients, place.optimizer
        )
        return {
            "parameters": int(params),
            "gradients": int(grads),
            "optimizer": int(optim),
            "host": int(host),
        }

    @property
    def strategy_line(self) -> str:
        return format_strategy(self.strategy_kwargs or self.config.strategy_kwargs())

    @property
    def model_state(self) -> int:
        """Parameters + gradients + optimizer state on the device: the ZeRO table's figure."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.buffers

    @property
    def fits(self) -> bool:
        return self.unsupported is None and self.total <= self.usable


@dataclass(frozen=True)
class Setting:
    """Everything about a run except the configuration being weighed."""

    shape: ModelShape
    world_size: int
    """The ranks sharded state divides over: the data-parallel ranks, or one shard group under HSDP."""
    usable: int
    precision: str
    optimizer: str
    micro_batch: int | None
    seq_len: int | None
    tp: int = 1
    pp: int = 1


def breakdown(s: Setting, config: Config) -> Breakdown:
    """Per-device bytes of ``config`` in setting ``s`` (formulas in the module docstring)."""
    p, c, reduce = PRECISION_BYTES[s.precision]
    mixed = c < p
    n, mp, stage = s.world_size, s.tp * s.pp, config.stage
    ep = config.expert_parallel_size
    # Under expert parallelism the experts stay whole over the tensor-parallel ranks (replicated: each routes
    # the same tokens), so only pipeline stages divide them; without it a plan splits them with the rest.
    experts = s.shape.expert_params / (s.pp if ep > 1 else mp)
    whole_over_tp = experts - s.shape.expert_params / mp
    psi, trainable = s.shape.params / mp + whole_over_tp, s.shape.trainable / mp + whole_over_tp
    # A device holds E / e experts of each experts module (the experts' weights count as trainable): it
    # computes with, gathers and reduces those; sharded over the N / e ranks left at stages 2-3, the state
    # per device is psi / N as without them (formulas in :mod:`.experts`).
    unheld = 1 - 1 / ep
    held_params, held_trainable = psi - experts * unheld, trainable - min(experts, trainable) * unheld
    per_module = s.shape.expert_params / s.shape.moe_layers if s.shape.moe_layers else 0.0
    block = (
        max(0.0, s.shape.block_params - per_module) / s.tp + per_module / ep
        if ep > 1
        else s.shape.block_params / s.tp
    )
    root = s.shape.root_params / mp
    params = (psi / n if stage >= 2 else held_params) * p
    expert_bytes = (experts / n if stage >= 2 else experts / config.expert_parallel_size) * p
    grads = (trainable / n if stage >= 2 else held_trainable) * p
    # Stage 1 partitions the rest over N ranks and each expert block over the N / e holding it: Ψ_E / N too.
    optim = (trainable / n if stage >= 1 else held_trainable) * OPTIMIZER_STATES[s.optimizer] * p
    sharding = _sharding(s, config, p)
    places: tuple[Place, ...] = ()
    if sharding is not None and s.shape.tensors is not None:  # the worst rank's bytes (:mod:`.shards`)
        places = shards.places(s.shape.tensors, sharding)
        worst = max(places, key=lambda place: place.model_state)
        params, grads, optim = worst.parameters, worst.gradients, worst.optimizer
    if config.offload_params != "none":
        expert_bytes = 0.0
    params, grads, optim, host = offloaded(config, params, grads, optim)
    ckpt = config.activation_checkpointing
    detail = _buffers(s, config, held_params, held_trainable, block, root, p, c, reduce, mixed)
    if s.optimizer in WHOLE_MATRIX and (stage >= 2 or s.tp > 1):
        largest = (
            max(s.shape.hidden * max(s.shape.ffn, s.shape.hidden), s.shape.vocab * s.shape.hidden) / s.pp
        )
        owned = (trainable / n if stage >= 2 else trainable) + largest
        detail["whole_matrices"] = int((owned + largest) * 2 * p)
    acts = 0.0
    if s.micro_batch and s.seq_len:
        r = p  # under autocast the residual stream keeps the stored dtype (fp32 in mixed precision)
        cp, method = config.context_parallel_size, config.context_parallel_method
        acts = activation_bytes(
            s.shape,
            s.micro_batch,
            s.seq_len,
            ckpt,
            r,
            c,
            s.tp,
            cp,
            method,
            config.tiled_mlp,
            config.tiled_loss,
        )
        tokens = s.micro_batch * s.seq_len / cp  # each rank of a context-parallel group holds T / cp of them
        if config.expert_parallel_size > 1 and s.shape.moe_layers:
            detail["all_to_all"] = int(all_to_all_bytes(tokens, s.shape.top_k, s.shape.hidden, r))
        if ckpt != "none" and s.shape.layers:
            kept = block_activation_bytes(s.shape, ckpt, r, c)
            detail["recompute"] = int(tokens * (block_activation_bytes(s.shape, "none", r, c) - kept) / s.tp)
        if s.shape.vocab:
            # The fp32 log-softmax and its gradient: of every token, or of one tile under tiled_loss.
            held = (
                min(tokens, loss_tile(int(tokens), s.shape.hidden, s.shape.vocab))
                if config.tiled_loss
                else tokens
            )
            detail["loss"] = int(8 * held * s.shape.vocab / s.tp)
    return Breakdown(
        config=config,
        parameters=int(params),
        gradients=int(grads),
        optimizer=int(optim),
        activations=int(acts),
        buffers=sum(detail.values()),
        host=int(host),
        usable=s.usable,
        buffers_detail=detail,
        expert_parameters=int(expert_bytes),
        unsupported=unsupported(config, s.shape.layers),
        places=places,
        sharding=sharding,
        tensors=s.shape.tensors,
    )


def offloaded(config: Config, params: float, grads: float, optim: float) -> tuple[float, float, float, float]:
    """(parameters, gradients, optimizer, host): what the offloads of ``config`` move to the host."""
    host = 0.0
    if config.offload_optimizer != "none":
        host, optim = host + optim, 0.0
    if config.offload_params != "none":
        host, params = host + params, 0.0
        if config.offload_optimizer != "none":  # the optimizer steps on the host, so gradients land there
            host, grads = host + grads, 0.0
    return params, grads, optim, host


def _sharding(s: Setting, config: Config, p: int) -> shards.Sharding | None:
    """How :mod:`.shards` reads the model's tensors for ``config`` (None: no tensors to read, the even split)."""
    if s.shape.tensors is None:
        return None
    return shards.Sharding(
        tp=s.tp,
        pp=s.pp,
        shard=s.world_size,
        ep=config.expert_parallel_size,
        zero=config.stage,
        param_bytes=p,
        states=OPTIMIZER_STATES[s.optimizer],
        step_bytes=4 if s.optimizer in ("adam", "adamw") else 0,
    )


def _buffers(
    s: Setting,
    config: Config,
    psi: float,
    trainable: float,
    block: float,
    root: float,
    p: int,
    c: int,
    reduce: int,
    mixed: bool,
) -> dict[str, int]:
    layers_here = -(-s.shape.layers // s.pp)  # ceil: the pipeline stage with the most layers
    gather = c if mixed else p  # FSDP2 gathers in the compute dtype in mixed precision
    if config.stage >= 2:
        two_units = min(psi, root + 2 * block) if layers_here else psi
        copies = psi * gather if config.stage == 2 else two_units * gather
        grad_buffers = (min(trainable, 2 * block) if layers_here else trainable) * reduce
    else:
        checkpointed = layers_here * block if config.activation_checkpointing != "none" else 0.0
        copies = max(0.0, psi - checkpointed) * c if mixed else 0.0
        grad_buffers = trainable * p
    return {"parameter_copies": int(copies), "gradient_buffers": int(grad_buffers)}


def candidates(
    stages: tuple[int, ...],
    offload_optimizer: Offload | Literal["auto"],
    offload_params: Offload | Literal["auto"],
    checkpointing: Checkpointing | Literal["auto"],
    replicate_size: int = 1,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    microbatches: int | None = None,
    context_parallel_size: int = 1,
    context_parallel_method: str = "allgather",
    tiled_mlp: bool = False,
    tiled_loss: bool = False,
    expert_parallel_sizes: tuple[int, ...] = (1,),
) -> list[Config]:
    """Every configuration the search weighs; ``"auto"`` tries none and cpu (nvme needs a path).

    The mesh sizes are not searched here: they are fixed, or chosen from the layout (:mod:`.mesh`);
    ``expert_parallel_sizes`` are each weighed (:func:`.experts.parallel_sizes`).
    """
    opt_choices: tuple[Offload, ...] = (
        ("none", "cpu") if offload_optimizer == "auto" else (offload_optimizer,)
    )
    param_choices: tuple[Offload, ...] = ("none", "cpu") if offload_params == "auto" else (offload_params,)
    ckpt_choices: tuple[Checkpointing, ...] = CHECKPOINTING if checkpointing == "auto" else (checkpointing,)
    return [
        Config(
            stage,
            opt,
            par,
            ckpt,
            replicate_size,
            tensor_parallel_size,
            pipeline_parallel_size,
            microbatches,
            context_parallel_size,
            context_parallel_method,
            tiled_mlp,
            tiled_loss,
            ep,
        )
        for stage in stages
        for opt in opt_choices
        for par in param_choices
        for ckpt in ckpt_choices
        for ep in expert_parallel_sizes
    ]


def cheapest(rows: list[Breakdown]) -> Breakdown | None:
    """The cheapest row that fits; if none fits, the supported one with the fewest bytes; None if none runs."""
    fitting = [row for row in rows if row.fits]
    if fitting:
        return min(fitting, key=lambda row: row.config.cost())
    runnable = [row for row in rows if row.unsupported is None]
    return min(runnable, key=lambda row: (row.total, row.config.cost())) if runnable else None
