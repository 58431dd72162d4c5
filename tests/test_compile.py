"""``ShardStrategy(compile=...)``: each block compiled inside FSDP2's hooks, the same losses as eager.

Inductor on CPU (fp32): the compiled blocks fuse elementwise ops and may reorder reductions, so losses
agree with eager to rtol 1e-5 rather than bit for bit. No block recompiles after its first graph.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_shard import ShardStrategy
from lightning_shard.compile import CompiledForward, blocks_to_compile, is_compiled
from tests.helpers import LossRecorder, tiny_gpt, token_dataset, trainer_kwargs

COMPILE_RTOL = 1e-5


def _fit(
    stage: int = 3, dropout: float = 0.1, callbacks: list[L.Callback] = (), **flags: Any
) -> dict[str, Any]:
    # Dropout on, as users have it. Inductor draws its own random numbers (set
    # torch._inductor.config.fallback_random for eager's), so its parity run has none.
    model = tiny_gpt(n_layers=2, dropout=dropout)
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=1,
        strategy=ShardStrategy(stage=stage, **flags),
        callbacks=[recorder, *callbacks],
        **trainer_kwargs(max_steps=4),
    )
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    trainer.fit(model, DataLoader(token_dataset(64), batch_size=8))
    return {
        "losses": recorder.losses,
        "graphs": counters["stats"]["unique_graphs"] - graphs,
        "recompiles": trainer.strategy.recompiles,
        "compiled": [is_compiled(block) for block in model.model.blocks],
    }


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True, scope="module")
def _one_rank_group_released():
    """These runs make a one-rank process group in the test process (kept until exit, as under DDP);
    release it and its address after the module, so later tests start from a process without one."""
    import os

    import torch.distributed as dist

    made_here = not dist.is_initialized()
    yield
    if made_here and dist.is_initialized():
        dist.destroy_process_group()
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)


@pytest.mark.parametrize(
    "flags",
    [
        dict(stage=3, compile=True, dropout=0.0),  # inductor
        dict(stage=2, compile={"backend": "aot_eager"}, activation_checkpointing="selective"),
        dict(stage=0, compile={"backend": "aot_eager"}, activation_checkpointing="full"),
    ],
    ids=["stage3 inductor", "stage2 selective", "stage0 full"],
)
def test_compiled_blocks_follow_eager_without_recompiles(flags):
    stage = flags.pop("stage")
    eager = _fit(stage, **{k: v for k, v in flags.items() if k != "compile"})
    assert eager["recompiles"] == 0
    compiled = _fit(stage, **flags)
    assert compiled["compiled"] == [True, True] and eager["compiled"] == [False, False]
    assert compiled["graphs"] >= 1 and eager["graphs"] == 0  # dynamo really ran
    assert compiled["recompiles"] == 0
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=COMPILE_RTOL, atol=0)


def test_blocks_compile_after_mfu_monitor_counts_the_first_step():
    """MFUMonitor counts the first step's FLOPs under a dispatch mode, where dynamo does not compile and
    remembers that for the code for good: the blocks run that step eagerly and compile from the next."""
    from lightning_shard.callbacks import MFUMonitor

    eager_monitor, compiled_monitor = MFUMonitor(peak_flops=1e12), MFUMonitor(peak_flops=1e12)
    eager = _fit(3, dropout=0.0, callbacks=[eager_monitor])
    compiled = _fit(3, dropout=0.0, callbacks=[compiled_monitor], compile={"backend": "aot_eager"})
    assert compiled["graphs"] >= 1 and compiled["recompiles"] == 0
    assert compiled_monitor.counted["model_flops"] == eager_monitor.counted["model_flops"] > 0
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=COMPILE_RTOL, atol=0)


def test_mfu_monitor_leaves_a_users_compiled_module_compiled():
    """Any strategy: a submodule the user compiled runs eagerly in the counted step, compiled after it."""
    from torch._dynamo.utils import counters

    from lightning_shard.callbacks import MFUMonitor

    model = tiny_gpt(n_layers=2)
    model.model.blocks[0].compile(backend="eager")
    trainer = L.Trainer(devices=1, callbacks=[MFUMonitor(peak_flops=1e12)], **trainer_kwargs(max_steps=3))
    frames = counters["frames"]["ok"]
    trainer.fit(model, DataLoader(token_dataset(32), batch_size=8))
    assert counters["frames"]["ok"] > frames


def test_a_recompile_is_counted_and_reported():
    torch.manual_seed(0)
    model = tiny_gpt(n_layers=2)
    strategy = ShardStrategy(stage=3, compile={"backend": "eager", "dynamic": False})
    trainer = L.Trainer(devices=1, strategy=strategy, **trainer_kwargs(max_steps=2))
    # the last batch is shorter: a static-shape graph is compiled again for it
    loader = DataLoader(token_dataset(12), batch_size=8)
    with pytest.warns(UserWarning, match=r"recompiled the blocks \d+ time\(s\).*TORCH_LOGS=recompiles"):
        trainer.fit(model, loader)
    assert strategy.recompiles >= 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"mode": "default", "fullgrph": True}, r"has \['fullgrph'\], which torch.compile does not take"),
        ("yes", r"must be True, False or a dict of torch.compile keyword arguments"),
    ],
)
def test_bad_compile_flags_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        ShardStrategy(compile=value)


def test_compile_is_taken_by_the_deepspeed_engine():
    pytest.importorskip("deepspeed")
    # Compiled on 2 ranks at ZeRO-1 and ZeRO-3 in tests/test_compile_multirank.py.
    assert ShardStrategy(stage=2, engine="deepspeed", compile=True).config.compile == {}


def test_a_model_without_repeated_blocks_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(
        ValueError, match=r"compile=True\) compiles each repeated block.*shard_modules=\[\.\.\.\]"
    ):
        blocks_to_compile(model, None, {})


def test_a_model_compiled_whole_is_refused_before_it_runs():
    # Lightning refuses torch.compile(model) for strategies outside its list, ours included, before set-up:
    # it never runs uncompiled. ShardStrategy(compile=True) is the way (docs/compile.md).
    model = tiny_gpt(n_layers=2)
    trainer = L.Trainer(devices=1, strategy=ShardStrategy(stage=3), **trainer_kwargs(max_steps=1))
    with pytest.raises(
        RuntimeError, match=r"compiled model is incompatible with the current strategy: `ShardStrategy`"
    ):
        trainer.fit(torch.compile(model), DataLoader(token_dataset(16), batch_size=8))


def test_a_compiled_forward_deep_copies_and_compiles_again():
    import copy

    block = torch.nn.Linear(4, 4)
    block.forward = CompiledForward(block.forward, {"backend": "eager"})  # type: ignore[method-assign]
    x = torch.randn(2, 4)
    expected = block(x)
    clone = copy.deepcopy(block)
    assert clone.forward._compiled is None and is_compiled(clone)
    torch.testing.assert_close(clone(x), expected)
