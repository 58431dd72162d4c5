"""``fp8=``: the flag's checks, the size rule and its overrides, the tensor-parallel styles (one process)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from lightning_shard import ShardStrategy, fp8
from lightning_shard.engines import configure
from lightning_shard.fp8 import Fp8Settings, check_fp8, choose, convert, large_enough
from tests.helpers import tiny_gpt

pytestmark = pytest.mark.torchao


def _linear(k: int, n: int) -> nn.Linear:
    return nn.Linear(k, n, device="meta")


class _Net(nn.Module):
    def __init__(self, d: int, vocab: int = 64, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, device="meta")
        self.up = nn.Linear(d, 4 * d, device="meta")
        self.down = nn.Linear(4 * d, d, device="meta")
        self.odd = nn.Linear(d, 3 * d + 8, device="meta")
        self.output = nn.Linear(d, vocab, bias=False, device="meta")
        if tied:
            self.output.weight = self.emb.weight


def test_flag_forms():
    config = configure(stage=3, fp8=True)
    assert config.fp8 == Fp8Settings(all_gather=True)
    assert configure(stage=3, fp8=False).fp8 is None
    rowwise = configure(stage=3, fp8="rowwise").fp8
    assert rowwise is not None and rowwise.recipe == "rowwise" and not rowwise.all_gather
    assert not configure(stage=0, fp8=True).fp8.all_gather  # type: ignore[union-attr]
    given = {"skip": "blocks.0.*", "pad_inner_dim": True, "enable_fsdp_float8_all_gather": False}
    settings = configure(stage=2, fp8=given).fp8
    assert settings == Fp8Settings(skip=("blocks.0.*",), options=(("pad_inner_dim", True),))
    assert settings.torchao_config().pad_inner_dim  # type: ignore[union-attr]
    assert ShardStrategy(stage=3, fp8="tensorwise").config.fp8 is not None
    assert configure(stage=3, fp8=True, tensor_parallel_size=2).fp8.all_gather  # type: ignore[union-attr]
    # DeepSpeed gathers the converted weights in their own dtype: the float8 gather's default is off there
    assert not configure(stage=3, fp8=True, engine="deepspeed").fp8.all_gather  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ({"fp8": 3}, "must be True, 'tensorwise', 'rowwise' or a dict"),
        ({"fp8": {"recipes": "rowwise"}}, r"has \['recipes'\], which are not fp8 options"),
        ({"fp8": "blockwise"}, "recipe 'blockwise' is unknown"),
        (
            {"fp8": {"enable_fsdp_float8_all_gather": True}, "engine": "deepspeed", "stage": 3},
            "asks for float8 all-gathers, which are FSDP2's.*Drop enable_fsdp_float8_all_gather, or use engine='fsdp'",
        ),
        (
            {"fp8": {"precompute_scales": False}, "tensor_parallel_size": 2},
            "tensor_parallel_size=2\\): the float8 all-gather without precompute_scales",
        ),
        ({"fp8": {"filter": 3}}, "filter must be 'auto', 'all' or the import path"),
        ({"fp8": {"filter": "no.such.module.fn"}}, "filter 'no.such.module.fn' is neither"),
        ({"fp8": {"modules": 7}}, "modules must be a list of module-name patterns"),
        ({"fp8": {"emulate": "yes"}}, "emulate must be True or False"),
        (
            {"fp8": {"recipe": "rowwise", "enable_fsdp_float8_all_gather": True}},
            "needs the 'tensorwise' recipe",
        ),
        (
            {"fp8": {"enable_fsdp_float8_all_gather": True}, "stage": 0},
            "applies where FSDP gathers parameters",
        ),
    ],
)
def test_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        configure(**{"stage": 3, **flags})


def test_refused_without_torchao(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    with pytest.raises(
        ValueError, match=r"needs torchao, which is not installed: pip install 'lightning-shard\[fp8\]'"
    ):
        check_fp8(True, 3, 1)


def test_size_rule():
    assert not large_enough(_linear(1024, 1024), "tensorwise")  # torchao: K <= 4096 and N <= 1024 loses
    assert large_enough(_linear(2048, 6144), "tensorwise")  # a 1B GPT's qkv
    assert large_enough(_linear(8192, 2048), "tensorwise")
    assert not large_enough(_linear(2048, 4096), "rowwise")
    assert large_enough(_linear(4096, 8192), "rowwise")
    big = _Net(2048, vocab=50304, tied=False)
    # output (the head, by name) and odd (3 x 2048 + 8 is no multiple of 16) stay in high precision.
    assert choose(big, Fp8Settings()) == ["up", "down"]
    assert choose(_Net(32), Fp8Settings()) == []  # too small
    assert choose(_Net(32), Fp8Settings(filter="all")) == ["up", "down"]  # the tied head stays
    assert choose(_Net(32), Fp8Settings(filter="all", skip=("d*",))) == ["up"]
    assert choose(_Net(32), Fp8Settings(modules=("output", "odd"))) == ["output"]  # odd: not a multiple of 16
    custom = Fp8Settings(filter="tests.test_fp8.only_down")
    assert choose(_Net(32), custom) == ["down"]


def only_down(module: nn.Module, name: str) -> bool:
    return name == "down"


def test_no_eligible_layer_warns():
    net = _Net(32)
    with pytest.warns(UserWarning, match="found no Linear layer to convert in _Net"):
        assert convert(net, Fp8Settings()) == []
    assert fp8.converted(net) == []


def test_plain_state_dict_keeps_plain_tensors():
    state = {"w": torch.ones(2)}
    assert fp8.plain_state_dict(state)["w"] is state["w"]


def test_tensor_parallel_styles_for_float8_layers():
    """torchao's float8 styles where they keep one process's result; torch's (the Float8Linear still casts
    the split operands itself) for a layer with a bias, a sequence-split input on gloo, or rowwise scaling."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from lightning_shard.parallel import resolve_plan
    from lightning_shard.parallel.plan import to_styles

    def styles(recipe: str, float8_wire: bool) -> dict[str, type]:
        model = tiny_gpt().model
        for linear in (model.blocks[0].attn.qkv, model.blocks[0].attn.proj):
            linear.bias = None
        convert(model, check_fp8({"recipe": recipe, "filter": "all"}, 0, 2))  # type: ignore[arg-type]
        chosen = to_styles(model, resolve_plan(model, None, 2), float8_wire)  # the GPT's plan: sequence split
        return {name: type(style) for name, style in chosen.items() if name.endswith(("qkv", "proj"))}

    assert styles("tensorwise", True) == {
        "blocks.0.attn.qkv": Float8ColwiseParallel,
        "blocks.0.attn.proj": Float8RowwiseParallel,
        "blocks.1.attn.qkv": ColwiseParallel,  # a bias
        "blocks.1.attn.proj": RowwiseParallel,
    }
    assert set(styles("tensorwise", False).values()) == {ColwiseParallel, RowwiseParallel}  # gloo
    assert set(styles("rowwise", True).values()) == {ColwiseParallel, RowwiseParallel}
