"""Planning on paper at scale: data-parallel traffic, the pipeline bubble, and a TP x PP x DP layout.

Ring all-reduce of B bytes over N ranks: each rank sends and receives ``2(N-1)/N x B`` (a
reduce-scatter and an all-gather, each moving ``(N-1)/N x B``), so at bus bandwidth β per rank it
takes ``2(N-1)/N x B / β``. What one optimizer step moves per rank, G = gradient bytes, P = parameter
bytes, P_c = parameter bytes in the compute dtype::

    stage 0   all-reduce G                               2(N-1)/N · G
    stage 1   all-reduce G + broadcast updated shards    2(N-1)/N · G + (N-1)/N · P
    stage 2   reduce-scatter G + one all-gather          (N-1)/N · (G + P_c)
    stage 3   reduce-scatter G + all-gather twice        (N-1)/N · (G + 2 P_c)   (forward and backward)

With ``fp8`` the converted Linears' weights are gathered in float8 at stages 2-3: 1 byte each in P_c.

A pipeline of p stages and m micro-batches idles ``(p-1)/(m+p-1)`` of each step (GPipe and 1F1B
alike): the first stage waits p-1 slots for the last to start, and the last drains p-1 slots.

Layout search: tensor parallelism t stays within a node (it all-reduces activations every layer,
which needs NVLink-class bandwidth); pipeline parallelism p splits the layers; the rest, N / (t p), is
data parallelism with ZeRO over it. Parameters divide by t p; activations by t (with sequence
parallelism) but not by p (1F1B keeps p micro-batches of L/p layers in flight on the first stage).
The suggestion is, among layouts that fit: the least recompute (full recompute costs a third more
compute), then the smallest model-parallel group t x p (more data parallelism, whose traffic
overlaps backward), then t before p (no bubble), then the lowest ZeRO stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from lightning_shard.planner.experts import parallel_sizes
from lightning_shard.planner.memory import (
    CHECKPOINTING,
    PRECISION_BYTES,
    Breakdown,
    Checkpointing,
    Config,
    Setting,
    breakdown,
)


def ring_allreduce_seconds(nbytes: float, world_size: int, bandwidth: float) -> float:
    """``2(N-1)/N x nbytes / bandwidth``: the time of a bandwidth-bound ring all-reduce."""
    return 2 * (world_size - 1) / world_size * nbytes / bandwidth if world_size > 1 else 0.0


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """``(p-1)/(m+p-1)``: the idle fraction of a pipelined step."""
    return (stages - 1) / (micro_batches + stages - 1)


def step_traffic(stage: int, grad_bytes: float, param_bytes: float, gather_bytes: float, n: int) -> float:
    """Bytes each rank sends per optimizer step for data parallelism at ``stage`` (table above)."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    if stage == 0:
        return 2 * share * grad_bytes
    if stage == 1:
        return 2 * share * grad_bytes + share * param_bytes
    return share * (grad_bytes + (1 if stage == 2 else 2) * gather_bytes)


@dataclass(frozen=True)
class Communication:
    """Data-parallel traffic of one optimizer step for one configuration."""

    bandwidth: float
    gradient_bytes: int
    allreduce_seconds: float
    step_bytes: int
    step_seconds: float


def communication(s: Setting, stage: int, bandwidth: float, float8_params: int = 0) -> Communication:
    """``float8_params``: parameters FSDP gathers in float8 (``ShardStrategy(fp8=...)`` at stages 2-3, the
    converted Linears' weights), 1 byte each in P_c instead of the compute dtype's."""
    p, c, reduce = PRECISION_BYTES[s.precision]
    mp = s.tp * s.pp
    grad = s.shape.trainable / mp * reduce
    float8 = min(float8_params, s.shape.params) if stage >= 2 else 0
    gather = ((s.shape.params - float8) * (c if c < p else p) + float8) / mp
    traffic = step_traffic(stage, grad, s.shape.params / mp * p, gather, s.world_size)
    return Communication(
        bandwidth=bandwidth,
        gradient_bytes=int(grad),
        allreduce_seconds=ring_allreduce_seconds(grad, s.world_size, bandwidth),
        step_bytes=int(traffic),
        step_seconds=traffic / bandwidth,
    )


@dataclass(frozen=True)
class LayoutOption:
    tp: int
    pp: int
    dp: int
    row: Breakdown
    micro_batches: int
    bubble: float
    communication: Communication

    def key(self) -> tuple[int, int, int, int, int]:
        return (
            CHECKPOINTING.index(self.row.config.activation_checkpointing),
            self.tp * self.pp,
            self.pp,
            self.row.config.stage,
            -self.row.config.expert_parallel_size,
        )


@dataclass(frozen=True)
class Layout:
    gpus_per_node: int
    options: tuple[LayoutOption, ...]
    """The best option for each tensor-parallel size."""
    suggested: LayoutOption | None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest_layout(
    s: Setting,
    gpus_per_node: int,
    bandwidth: float,
    micro_batches: int | None,
    checkpointing: Checkpointing | str = "auto",
    judge: Callable[[Breakdown], Breakdown] = lambda row: row,
    expert_parallel_size: int | str = "auto",
) -> Layout:
    """Search t x p x d = world size (t a power of two within a node) for the layout described above.

    A mixture of experts also weighs ``expert_parallel_size`` over the d ranks (:func:`.experts.parallel_sizes`:
    ``"auto"`` every e dividing d and E within a node, an int only itself), the largest e last among equals.

    ``judge`` marks the rows the strategy refuses (see :mod:`.accepted`; each row carries its
    ``tensor_parallel_size``, ``pipeline_parallel_size`` and ``microbatches``), so none is suggested;
    :mod:`.mesh` turns the suggestion into ``ShardStrategy`` flags.
    """
    world, layers = s.world_size, max(1, s.shape.layers)
    modes = CHECKPOINTING if checkpointing == "auto" else (checkpointing,)
    per_tp: list[LayoutOption] = []
    tp = 1
    heads = s.shape.heads or 1
    while tp <= min(gpus_per_node, heads) and world % tp == 0:
        if heads % tp and not s.shape.inferred:  # ShardStrategy refuses a split that cuts attention heads
            break
        options = []
        for pp in (d for d in _divisors(world // tp) if d <= layers):
            setting = replace(s, world_size=world // (tp * pp), tp=tp, pp=pp)
            m = micro_batches or 4 * pp
            eps = parallel_sizes(setting.world_size, s.shape.experts, expert_parallel_size, gpus_per_node)
            for stage, mode, ep in ((st, md, ep) for st in (0, 1, 2, 3) for md in modes for ep in eps):
                config = Config(
                    stage,
                    activation_checkpointing=mode,  # type: ignore[arg-type]
                    tensor_parallel_size=tp,
                    pipeline_parallel_size=pp,
                    microbatches=m if pp > 1 else None,
                    expert_parallel_size=ep,
                )
                row = judge(breakdown(setting, config))
                comm = communication(setting, stage, bandwidth)
                options.append(LayoutOption(tp, pp, setting.world_size, row, m, pipeline_bubble(pp, m), comm))
        if not options:  # a fixed expert_parallel_size divides none of this TP size's data-parallel groups
            break
        fitting = [o for o in options if o.row.fits]
        runnable = [o for o in options if o.row.unsupported is None] or options
        per_tp.append(
            min(fitting, key=LayoutOption.key) if fitting else min(runnable, key=lambda o: o.row.total)
        )
        tp *= 2
    fitting = [o for o in per_tp if o.row.fits]
    return Layout(
        gpus_per_node,
        tuple(per_tp),
        min(fitting, key=LayoutOption.key) if fitting else None,
    )
