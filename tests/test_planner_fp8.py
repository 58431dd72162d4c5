"""The planner's data-parallel traffic with ``fp8``: the converted Linears' weights gathered at 1 byte each."""

from __future__ import annotations

import pytest

from lightning_shard.planner import plan
from lightning_shard.planner.float8 import float8_gathered_params
from tests.helpers import tiny_gpt

pytestmark = pytest.mark.torchao

#: The tiny GPT's converted weights with fp8={"filter": "all"}: 2 blocks x (qkv, proj, mlp.0, mlp.2), the
#: tied head kept; tests/test_fp8_multirank.py measures these gathered in float8 (its ``elements`` / 2).
FLOAT8 = 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32)


def _step_bytes(precision: str, stage: int, **flags: object) -> int:
    result = plan(
        module=tiny_gpt(), world_size=2, device_memory="80GB", precision=precision, stage=stage, **flags
    )
    assert result.communication is not None and result.recommended is not None
    assert result.recommended.config.stage == stage
    return result.communication.step_bytes


@pytest.mark.parametrize(("precision", "compute"), [("32-true", 4), ("bf16-mixed", 2)])
def test_stage3_gathers_converted_weights_at_one_byte(precision, compute):
    params = sum(p.numel() for p in tiny_gpt().parameters())
    # (N-1)/N x (G + 2 P_c) at N = 2, G in fp32; P_c with the converted weights at 1 byte
    gather = (params - FLOAT8) * compute + FLOAT8
    assert _step_bytes(precision, 3, fp8={"filter": "all"}) == int((4 * params + 2 * gather) / 2)
    # per step, the bytes the float8 gathers save: (compute - 1) x FLOAT8 in each of the 2 gathers, as
    # measured on 2 ranks (tests/test_fp8_multirank.py: 3 x elements in 32-true, elements in bf16-mixed)
    saved = _step_bytes(precision, 3) - _step_bytes(precision, 3, fp8={"filter": "all"})
    assert saved == 2 * (compute - 1) * FLOAT8 // 2  # x (N-1)/N


def test_no_float8_gathers_at_stages_0_1_or_when_turned_off():
    assert _step_bytes("bf16-mixed", 1, fp8={"filter": "all"}) == _step_bytes("bf16-mixed", 1)
    off = {"filter": "all", "enable_fsdp_float8_all_gather": False}
    assert _step_bytes("bf16-mixed", 3, fp8=off) == _step_bytes("bf16-mixed", 3)
    assert _step_bytes("bf16-mixed", 3, fp8="rowwise") == _step_bytes("bf16-mixed", 3)  # no float8 gather


def test_the_size_rule_without_a_module():
    plain = plan("1B", layers=16, hidden=2048, heads=16, ffn=8192, world_size=8, device_memory="80GB")
    shape = plain.model
    # a 1B GPT converts every block Linear (docs/fp8.md): qkv, proj and the MLP's two
    every = 16 * (2048 * 6144 + 2048 * 2048 + 2 * 2048 * 8192)
    assert float8_gathered_params(True, 3, None, shape) == every
    assert float8_gathered_params(True, 1, None, shape) == 0
    small = plan("10M", layers=2, hidden=256, heads=4, world_size=8, device_memory="80GB").model
    assert float8_gathered_params(True, 3, None, small) == 0  # below the break-even: nothing converted
    assert float8_gathered_params({"filter": "all"}, 3, None, small) > 0
