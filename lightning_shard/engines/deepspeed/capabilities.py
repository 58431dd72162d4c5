"""What the DeepSpeed engine (:mod:`.deepspeed`) serves: ZeRO 0-3, ZeRO-Offload and ZeRO-Infinity."""

from __future__ import annotations

from lightning_shard import offload
from lightning_shard.engines.capabilities import ALL_OFFLOADS, Capabilities

DEEPSPEED = Capabilities(
    name="deepspeed",
    label="DeepSpeed",
    # Its MoE experts are ZeRO-1/2 parameters; no tensor, pipeline or replicate dimension is wired here.
    dims={"ep": frozenset({1, 2})},
    offload=ALL_OFFLOADS,  # ZeRO-Offload and ZeRO-Infinity (the stage rules are the flags' own)
    checkpoint_modes=frozenset({"sharded"}),  # its own per-rank directory
    async_checkpoint=False,
    skip_nonfinite=False,  # it skips fp16 overflow steps itself
    fp8=False,
    ddp_options_stages=frozenset(),
    selective_checkpointing_stages=frozenset({0, 1, 2}),  # ZeRO-3 gathers inside the checkpointed block
    owns_step=True,
    torch_optimizer=False,  # its ZeRO optimizer wraps the torch one
    averaging_stages=frozenset(),
    module_state_after_load=False,  # it loads its own files, apart from Lightning's entries
    requires=(("deepspeed", offload.DEEPSPEED_MISSING),),
)

__all__ = ["DEEPSPEED"]
