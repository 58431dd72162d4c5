"""``plan()``'s arguments checked before any search, each refusal a :class:`~lightning_shard.units.PlanInputError`
naming the argument as given: every choice among those the planner weighs, every count a whole number >= 1, the
margin a fraction."""

from __future__ import annotations

from typing import Any

from lightning_shard.engines import NAMES
from lightning_shard.planner.memory import CHECKPOINTING, OPTIMIZER_STATES, PRECISION_BYTES
from lightning_shard.units import PlanInputError


def _check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if isinstance(value, bool) or value not in choices:  # True == 1 must not pass as stage=1
        listed = ", ".join(repr(c) for c in choices)
        raise PlanInputError(f"plan({name}={value!r}) is not one of {listed}. Use one of those.")


def _positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanInputError(f"plan({name}={value!r}) must be a whole number >= 1.")


def check_arguments(args: dict[str, Any]) -> None:
    for name in ("world_size", "gpus_per_node"):
        _positive(name, args[name])
    for name in (
        "micro_batch",
        "seq_len",
        "micro_batches",
        "tensor_parallel_size",
        "replicate_size",
        "pipeline_parallel_size",
    ):
        _positive(name, args[name], allow_none=True)
    if args["context_parallel_size"] != "auto":
        _positive("context_parallel_size", args["context_parallel_size"], allow_none=True)
    _check_choice(
        "context_parallel_method", args["context_parallel_method"], ("allgather", "ulysses", "ring")
    )
    _check_choice("precision", args["precision"], tuple(PRECISION_BYTES))
    _check_choice("optimizer", args["optimizer"], tuple(OPTIMIZER_STATES))
    _check_choice("stage", args["stage"], (0, 1, 2, 3, "auto"))
    _check_choice("offload_optimizer", args["offload_optimizer"], ("none", "cpu", "nvme", "auto"))
    _check_choice("offload_params", args["offload_params"], ("none", "cpu", "nvme", "auto"))
    _check_choice("activation_checkpointing", args["activation_checkpointing"], (*CHECKPOINTING, "auto"))
    _check_choice("engine", args["engine"], ("auto", *NAMES))
    margin = args["margin"]
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise PlanInputError(
            f"plan(margin={margin!r}) must be a fraction in [0, 1), e.g. 0.1 for 10% headroom."
        )
