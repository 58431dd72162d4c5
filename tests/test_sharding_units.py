"""How the FSDP engine groups blocks into FSDP2 units (one collective per unit per direction)."""

from __future__ import annotations

from torch import nn

from lightning_shard.engines.fsdp.units import sharding_units


def blocks(*widths: int) -> list[nn.Module]:
    return [nn.Linear(w, w, bias=False) for w in widths]  # w * w * 4 bytes each


def test_stage_3_keeps_one_unit_per_block():
    layers = blocks(8, 8, 8)
    assert sharding_units(layers, group=False) == [[layer] for layer in layers]


def test_stage_2_packs_consecutive_blocks_up_to_the_cap():
    layers = blocks(8, 8, 8, 16, 8)  # 256, 256, 256, 1024, 256 bytes
    units = sharding_units(layers, group=True, cap=1024)
    assert units == [layers[0:3], [layers[3]], [layers[4]]]
    # A block at or above the cap is alone, as at stage 3 (billion-parameter models are unchanged).
    big = blocks(32, 32)
    assert sharding_units(big, group=True, cap=1024) == [[big[0]], [big[1]]]


def test_stage_2_packs_a_small_gpt_into_one_unit_at_the_default_cap():
    from lightning_shard.demos import GPT

    model = GPT(vocab_size=64, seq_len=16, d_model=32, n_layers=3, n_heads=2)
    units = sharding_units(list(model.blocks), group=True)
    assert units == [list(model.blocks)]
