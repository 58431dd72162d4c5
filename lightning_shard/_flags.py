"""ShardStrategy's cross-flag checks, run at construction, before any process starts."""

from __future__ import annotations

from typing import Any

from lightning_shard import offload

_STAGES = (0, 1, 2, 3)


def validate(
    stage: Any,
    engine: str,
    checkpoint: str,
    offload_optimizer: str | None,
    offload_params: str | None,
    nvme_path: str | None,
    device_memory: int | str | None,
    async_checkpoint: bool,
    skip_nonfinite: bool,
    max_skipped: Any,
) -> tuple[int | str, str]:
    """Check every flag against the others; return (stage, engine that will serve the flags)."""
    if stage != "auto" and (isinstance(stage, bool) or stage not in _STAGES):
        raise ValueError(
            f"ShardStrategy(stage={stage!r}) is not a ZeRO stage. Use 0 (DDP), 1 (optimizer state sharded),"
            " 2 (+ gradients), 3 (+ parameters), or 'auto' (planned from the model and device memory)."
        )
    if engine not in ("auto", "fsdp", "deepspeed"):
        raise ValueError(f"ShardStrategy(engine={engine!r}) is unknown. Use 'auto', 'fsdp' or 'deepspeed'.")
    if checkpoint not in ("sharded", "full"):
        raise ValueError(
            f"ShardStrategy(checkpoint={checkpoint!r}) is unknown. Use 'sharded' (one shard per rank, a directory)"
            " or 'full' (one file readable with torch.load)."
        )
    if async_checkpoint and checkpoint != "sharded":
        raise ValueError(
            f"ShardStrategy(async_checkpoint=True) needs checkpoint='sharded' (got checkpoint={checkpoint!r}):"
            " a single full file is gathered on one rank and cannot be written in the background per shard."
            " Use checkpoint='sharded' or async_checkpoint=False."
        )
    if isinstance(max_skipped, bool) or not isinstance(max_skipped, int) or max_skipped < 1:
        raise ValueError(
            f"ShardStrategy(max_skipped={max_skipped!r}) must be an integer >= 1: the number of consecutive"
            " non-finite steps to skip before stopping."
        )
    # With stage="auto", offload flags are checked as at stage 3, where every one of them is allowed.
    engine_name = offload.validate(
        3 if stage == "auto" else stage, offload_optimizer, offload_params, nvme_path, engine
    )
    if stage == "auto" and offload_params is not None:
        stage = 3  # parameter offload exists only at stage 3: nothing left to choose
    if device_memory is not None:
        if stage != "auto":
            raise ValueError(
                f"ShardStrategy(device_memory={device_memory!r}) is only used with stage='auto' (got stage={stage})."
                " Drop device_memory or set stage='auto'."
            )
        from lightning_shard._plan_units import parse_size

        parse_size(device_memory, "ShardStrategy(device_memory)")
    if engine_name == "deepspeed" and (async_checkpoint or skip_nonfinite):
        flag = "async_checkpoint=True" if async_checkpoint else "skip_nonfinite=True"
        raise ValueError(
            f"ShardStrategy({flag}) is not available with the DeepSpeed engine (chosen for engine={engine!r},"
            f" offload_optimizer={offload_optimizer!r}, offload_params={offload_params!r}). DeepSpeed writes its"
            " own checkpoints and skips fp16 overflow steps itself; use the FSDP2 engine for this flag."
        )
    return stage, engine_name
