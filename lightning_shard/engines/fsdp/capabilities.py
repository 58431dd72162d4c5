"""What the FSDP engine (:mod:`.fsdp`) serves: stages 0-3 on torch's DDP, ZeroRedundancyOptimizer and FSDP2."""

from __future__ import annotations

from lightning_shard.engines.capabilities import ALL_STAGES, Capabilities

FSDP = Capabilities(
    name="fsdp",
    label="FSDP2",
    # HSDP shards within each replica group (stages 2-3); ZeroRedundancyOptimizer takes no DTensor (stage 1).
    dims={
        "replicate": frozenset({2, 3}),
        "tp": frozenset({0, 2, 3}),
        "pp": ALL_STAGES,
        "ep": ALL_STAGES,
        "ft": ALL_STAGES,
    },
    offload=frozenset({(None, None), ("cpu", "cpu")}),  # CPUOffloadPolicy: both together, at stage 3
    checkpoint_modes=frozenset({"sharded", "full"}),
    async_checkpoint=True,
    skip_nonfinite=True,
    fp8=True,
    ddp_options_stages=frozenset({0, 1}),
    selective_checkpointing_stages=ALL_STAGES,
    owns_step=False,
    torch_optimizer=True,
    averaging_stages=frozenset({0, 1}),  # whole parameters: DDP's
    module_state_after_load=True,
)

__all__ = ["FSDP"]
