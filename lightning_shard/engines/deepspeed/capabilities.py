"""What the DeepSpeed engine (:mod:`.deepspeed`) serves: ZeRO 0-3, ZeRO-Offload and ZeRO-Infinity, AutoTP."""

from __future__ import annotations

from lightning_shard import offload
from lightning_shard.engines.capabilities import ALL_OFFLOADS, ALL_STAGES, Capabilities

DEEPSPEED = Capabilities(
    name="deepspeed",
    label="DeepSpeed",
    # Its MoE experts are ZeRO-1/2 parameters; its AutoTP splits layers at every ZeRO stage (checked on 2 CPU
    # ranks, 0.19.8); no pipeline or replicate dimension is wired here.
    dims={"ep": frozenset({1, 2}), "tp": ALL_STAGES},
    offload=ALL_OFFLOADS,  # ZeRO-Offload and ZeRO-Infinity (the stage rules are the flags' own)
    checkpoint_modes=frozenset({"sharded"}),  # its own per-rank directory
    async_checkpoint=True,  # DeepSpeed's own files, written in the background: .async_save
    skip_nonfinite=False,  # it skips fp16 overflow steps itself
    fp8=True,  # torchao's Float8Linear are plain modules to it (checked on 2 CPU ranks at ZeRO 0-3)
    fp8_all_gather=False,
    ddp_options_stages=frozenset(),
    selective_checkpointing_stages=frozenset({0, 1, 2}),  # ZeRO-3 gathers inside the checkpointed block
    owns_step=True,
    torch_optimizer=False,  # its ZeRO optimizer wraps the torch one
    averaging_stages=frozenset(),
    module_state_after_load=False,  # it loads its own files, apart from Lightning's entries
    tensor_parallel="engine",  # AutoTP, inside deepspeed.initialize
    absent_because={
        "replicate": (
            "DeepSpeed removed MiCS, its sharding within a group and replication across groups (0.19 refuses"
            " zero_optimization.mics_shard_size), and ZeRO++'s hpZ (zero_hpz_partition_size) keeps only a second"
            " copy of the weights within a node while the optimizer state stays sharded over every rank, which"
            " is not replicate_size's layout"
        ),
    },
    requires=(("deepspeed", offload.DEEPSPEED_MISSING),),
)

__all__ = ["DEEPSPEED"]
