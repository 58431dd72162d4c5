"""The planner's context-parallel dimension: activations of T / c tokens plus what attention across the group
keeps, ``stage="auto"`` fed the strategy's size, and the CLI cutting a sequence that does not fit."""

from __future__ import annotations

import pytest

from lightning_shard.cli import main
from lightning_shard.planner import plan
from lightning_shard.units import PlanInputError

# Llama-3-8B's shape: one 131072-token sequence's activations do not fit an 80 GB device.
LLAMA = dict(params="8e9", layers=32, hidden=4096, vocab=128256, device_memory="80GB", world_size=8)


def _acts(seq: int, cp: int | None, method: str = "allgather") -> int:
    row = plan(
        **LLAMA,
        seq_len=seq,
        stage=0,
        activation_checkpointing="none",
        context_parallel_size=cp,
        context_parallel_method=method,
    ).recommended
    assert row is not None
    return row.activations


def test_activations_divide_by_cp_and_allgather_counts_keys_values_and_mask():
    one, ulysses = _acts(8192, None), _acts(8192, 2, "ulysses")
    assert ulysses == pytest.approx(one / 2, rel=1e-6)
    # allgather: each layer's gathered keys and values (T tokens, bf16) and one (T/2, T) mask of the step.
    extra = 32 * 2 * 4096 * 2 * 8192 + 4096 * 8192 * 2
    assert _acts(8192, 2) - ulysses == pytest.approx(extra, rel=1e-6)


def test_cp_fixed_by_the_caller_is_in_the_line_and_must_divide_the_shard_group():
    result = plan(**LLAMA, seq_len=131072, context_parallel_size=4, context_parallel_method="ulysses")
    assert 'context_parallel_size=4, context_parallel_method="ulysses"' in str(result.strategy)
    with pytest.raises(PlanInputError, match=r"context_parallel_size=3\) does not divide the 8 ranks"):
        plan(**LLAMA, seq_len=131072, context_parallel_size=3)
    with pytest.raises(PlanInputError, match=r"context_parallel_method='zigzag'\) is not one of"):
        plan(**LLAMA, seq_len=131072, context_parallel_method="zigzag")


def test_stage_auto_plans_the_cut_sequence():
    from lightning_shard.demos import GPT
    from lightning_shard.planner.search import choose_stage

    gpt = GPT(seq_len=16384, d_model=64, n_layers=2)
    args = (gpt, 2, 6 * 2**30, "32-true", 1, 16384)
    whole = choose_stage(*args, activation_checkpointing="none")
    cut = choose_stage(
        *args, activation_checkpointing="none", context_parallel_size=2, context_parallel_method="ulysses"
    )
    assert cut.recommended.activations == pytest.approx(whole.recommended.activations / 2, rel=1e-6)
    assert cut.strategy_kwargs()["context_parallel_size"] == 2


def test_cli_recommends_context_parallel_when_one_sequence_does_not_fit(capsys):
    argv = ["plan", "--params", "8e9", "--layers", "32", "--hidden", "4096", "--vocab", "128256"]
    assert main([*argv, "--devices", "8", "--gpu-mem", "80GB", "--seq-len", "131072"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("recommended:"))
    assert "context_parallel_size=4" in line and ": fits)" in line
    assert "Context parallelism: one sequence's activations do not fit" in out
    # Short sequences fit without it: no cut is recommended.
    assert main([*argv, "--devices", "8", "--gpu-mem", "80GB", "--seq-len", "4096"]) == 0
    assert "context_parallel_size" not in capsys.readouterr().out
    # With the tiled MLP and loss planned, each rank holds more of the sequence: a smaller cut fits.
    assert (
        main(
            [
                *argv,
                "--devices",
                "8",
                "--gpu-mem",
                "80GB",
                "--seq-len",
                "131072",
                "--tiled-mlp",
                "--tiled-loss",
            ]
        )
        == 0
    )
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("recommended:"))
    assert "tiled_mlp=True, tiled_loss=True" in line and "context_parallel_size=4" not in line, line


def test_the_vocabulary_is_the_heads_width_even_when_positions_outnumber_it():
    from lightning_shard.demos import GPT
    from lightning_shard.planner.model import shape_from_module

    # 4096 positions, 64 tokens: the largest embedding is the position table, not the vocabulary.
    assert shape_from_module(GPT(vocab_size=64, seq_len=4096, d_model=32, n_layers=1, n_heads=2)).vocab == 64


def test_tiling_drops_the_mlp_hidden_units_and_the_whole_logits():
    from lightning_shard.planner import plan

    common = dict(
        world_size=1, device_memory="1TB", seq_len=8192, precision="32-true", stage=0, layers=2, hidden=256
    )
    common |= dict(heads=4, vocab=32000, ffn=1024, activation_checkpointing="none")
    common |= dict(offload_optimizer="none", offload_params="none")
    untiled = plan("50M", **common).recommended
    mlp = plan("50M", **common, tiled_mlp=True).recommended
    loss = plan("50M", **common, tiled_loss=True).recommended
    tokens = 8192
    # Per token: each layer's 2f fp32 hidden units; the logits V fp32 (kept) and the loss's 8V (one tile's).
    assert untiled.activations - mlp.activations == pytest.approx(tokens * 2 * 2 * 1024 * 4, rel=1e-6)
    assert untiled.activations - loss.activations == pytest.approx(tokens * 32000 * 4, rel=1e-6)
    assert loss.buffers_detail["loss"] == 8 * 1024 * 32000  # one tile of 1024 tokens (the floor)
    assert "tiled_mlp=True" in mlp.strategy_line and "tiled_loss=True" in loss.strategy_line
