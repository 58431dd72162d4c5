"""Activation checkpointing: gradients unchanged, memory reduced, errors clear, any strategy."""

from __future__ import annotations

import copy
import io
import math
import os
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_shard import ActivationCheckpointing
from lightning_shard._modules import detect_block_classes, find_blocks
from lightning_shard.activation_checkpointing import (
    DEFAULT_SAVE_OPS,
    RecomputeMismatchError,
    apply_activation_checkpointing,
    checkpointed_blocks,
    is_activation_checkpointed,
    measure,
    remove_activation_checkpointing,
)
from lightning_shard.demos import GPT, Block, GPTModule, TextDataModule

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _hygiene():
    # Two intra-op threads on a 2-core machine shared with other jobs spin against each other: 100x slower.
    threads, env = torch.get_num_threads(), dict(os.environ)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    # L.seed_everything sets PL_GLOBAL_SEED; no test may leave the environment changed.
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)
    assert not torch.distributed.is_initialized()


def tiny_gpt(dropout: float = 0.1, seq_len: int = 16, d_model: int = 32, n_layers: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(seq_len=seq_len, d_model=d_model, n_layers=n_layers, n_heads=4, dropout=dropout)


def tokens(batch: int = 2, seq_len: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(1))


def loss_and_grads(model: nn.Module, *args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    torch.manual_seed(2)  # same dropout masks for the reference and the checkpointed run
    out = model(*args, **kwargs)
    loss = out.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_same_grads(reference: dict, grads: dict) -> None:
    assert reference.keys() == grads.keys()
    for name, ref in reference.items():
        if ref is None:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], ref, atol=1e-6, rtol=0, msg=name)


def checkpointed_copy(model: nn.Module, config: ActivationCheckpointing | str) -> nn.Module:
    model = copy.deepcopy(model)
    apply_activation_checkpointing(model, config)
    return model


# ---------------------------------------------------------------------------------------------- #
# Tier 0: every policy leaves the gradients unchanged (fp32, dropout on)
# ---------------------------------------------------------------------------------------------- #

POLICIES = {
    "full": lambda: ActivationCheckpointing(policy="full"),
    "selective": lambda: ActivationCheckpointing(policy="selective"),
    "selective_every_other_matmul": lambda: ActivationCheckpointing(save_matmuls="every_other"),
    "selective_all_matmuls": lambda: ActivationCheckpointing(save_matmuls="all"),
    "selective_custom_ops": lambda: ActivationCheckpointing(
        save_ops=["aten.addmm.default", torch.ops.aten.bmm.default]
    ),
    "full_every_2nd": lambda: ActivationCheckpointing(policy="full", every_n=2),
    "selective_every_3rd": lambda: ActivationCheckpointing(every_n=3),
    "memory_budget": lambda: ActivationCheckpointing(memory_budget=0.5),
    "full_memory_budget": lambda: ActivationCheckpointing(policy="full", memory_budget=0.5),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_gradients_equal_no_checkpoint_run(policy: str) -> None:
    model, idx = tiny_gpt(dropout=0.1), tokens()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), idx)
    checkpointed = checkpointed_copy(model, POLICIES[policy]())
    loss, grads = loss_and_grads(checkpointed, idx)
    assert torch.equal(loss, ref_loss)
    assert_same_grads(ref_grads, grads)
    # Equal gradients mean nothing if no block was checkpointed: the forward must leave fewer bytes.
    assert measure(checkpointed, idx).activation_bytes < measure(model, idx).activation_bytes


def test_every_n_and_blocks_choose_which_blocks() -> None:
    model = tiny_gpt()
    patched = apply_activation_checkpointing(model, ActivationCheckpointing(policy="full", every_n=3))
    assert patched == [model.blocks[0], model.blocks[3]]
    assert checkpointed_blocks(model) == patched
    other = tiny_gpt()
    assert apply_activation_checkpointing(other, ActivationCheckpointing(blocks="torch.nn.LayerNorm")) == [
        m for m in other.modules() if isinstance(m, nn.LayerNorm)
    ]


def test_parameter_names_classes_and_pickling_unchanged() -> None:
    model, idx = tiny_gpt(), tokens()
    keys = list(model.state_dict())
    apply_activation_checkpointing(
        model, ActivationCheckpointing(memory_budget=0.5, save_ops=["aten.mm.default"])
    )
    assert is_activation_checkpointed(model)
    assert list(model.state_dict()) == keys
    assert [type(b) for b in model.blocks] == [Block] * 4
    # ShardStrategy finds its sharding units the same way, so they are still the blocks.
    assert detect_block_classes(model) == (Block,)
    assert find_blocks(model, (Block,)) == list(model.blocks)
    tiny_gpt().load_state_dict(model.state_dict(), strict=True)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    for clone in (copy.deepcopy(model), torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)):
        assert clone.blocks[0].forward.block is clone.blocks[0]
        assert is_activation_checkpointed(clone)
        clone(idx).sum().backward()
    assert remove_activation_checkpointing(model) == list(model.blocks)
    assert not is_activation_checkpointed(model)
    assert "forward" not in model.blocks[0].__dict__


# ---------------------------------------------------------------------------------------------- #
# Blocks of other shapes: keyword arguments, tuple / dict outputs, torch and HF-style layers
# ---------------------------------------------------------------------------------------------- #


class HFStyleLayer(nn.Module):
    """Shaped like a transformers decoder layer: keyword masks and position ids, a tuple out, a KV cache."""

    def __init__(self, d: int = 16, seq_len: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.pos = nn.Embedding(seq_len, d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_value=None,
        use_cache=False,
        output_attentions=False,
    ):
        h = self.norm(hidden_states) + self.pos(position_ids)  # (b, t, d)
        q, k, v = self.q(h), self.k(h), self.v(h)
        if use_cache and past_key_value is not None:
            past_key_value.append((k.detach(), v.detach()))  # state outside the block: grows on every call
            k = torch.cat([kv[0] for kv in past_key_value], dim=1)  # (b, t_cache, d)
            v = torch.cat([kv[1] for kv in past_key_value], dim=1)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.size(-1))  # (b, t, t_cache)
        if attention_mask is not None and attention_mask.size(-1) == scores.size(-1):
            scores = scores + attention_mask
        attn = self.drop(scores.softmax(-1))
        out = hidden_states + self.o(attn @ v)
        out = out + self.mlp(out)
        return (out, attn if output_attentions else None)


class HFStyleModel(nn.Module):
    def __init__(self, n_layers: int = 3, d: int = 16, seq_len: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(HFStyleLayer(d, seq_len) for _ in range(n_layers))

    def forward(self, x, attention_mask, position_ids, use_cache=False, cache=None):
        for layer in self.layers:
            x, _ = layer(
                x,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_value=cache,
                use_cache=use_cache,
                output_attentions=True,
            )
        return x


def hf_inputs(d: int = 16, seq_len: int = 8) -> dict:
    g = torch.Generator().manual_seed(3)
    causal = torch.full((seq_len, seq_len), float("-inf")).triu(1)
    return {
        "x": torch.randn(2, seq_len, d, generator=g, requires_grad=True),
        "attention_mask": causal.expand(2, seq_len, seq_len),
        "position_ids": torch.arange(seq_len).expand(2, seq_len),
    }


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_hf_style_layer_with_keyword_arguments_and_tuple_output(policy: str) -> None:
    torch.manual_seed(0)
    model, inputs = HFStyleModel(), hf_inputs()
    _, ref = loss_and_grads(copy.deepcopy(model), **inputs)
    _, grads = loss_and_grads(checkpointed_copy(model, policy), **inputs)
    assert_same_grads(ref, grads)


class DictBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin, self.gate, self.drop = nn.Linear(d, d), nn.Linear(d, d), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
        h = self.drop(torch.tanh(self.lin(x)) * torch.sigmoid(self.gate(x)))
        return {"hidden": x + scale * h, "aux": h.pow(2).mean()}


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(DictBlock() for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = 0.0
        for block in self.blocks:
            out = block(x, scale=0.5)
            x, aux = out["hidden"], aux + out["aux"]
        return x + aux


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_dict_output_block(policy: str) -> None:
    torch.manual_seed(0)
    model, x = DictModel(), torch.randn(4, 16, requires_grad=True)
    _, ref = loss_and_grads(copy.deepcopy(model), x)
    _, grads = loss_and_grads(checkpointed_copy(model, policy), x)
    assert_same_grads(ref, grads)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_torch_transformer_encoder_layer(policy: str) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    x = torch.randn(2, 6, 16)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    _, ref = loss_and_grads(copy.deepcopy(model), x, src_key_padding_mask=padding)
    checkpointed = checkpointed_copy(model, policy)
    assert checkpointed_blocks(checkpointed) == list(checkpointed.layers)
    _, grads = loss_and_grads(checkpointed, x, src_key_padding_mask=padding)
    assert_same_grads(ref, grads)


def test_frozen_parameters_inside_checkpointed_blocks() -> None:
    model, idx = tiny_gpt(), tokens()
    for p in [*model.pos_emb.parameters(), *model.blocks[0].parameters(), *model.blocks[1].mlp.parameters()]:
        p.requires_grad_(False)
    _, ref = loss_and_grads(copy.deepcopy(model), idx)
    _, grads = loss_and_grads(checkpointed_copy(model, "selective"), idx)
    assert grads["blocks.0.attn.qkv.weight"] is None and grads["blocks.1.attn.qkv.weight"] is not None
    assert_same_grads(ref, grads)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_bf16_autocast(policy: str) -> None:
    model, idx = tiny_gpt(), tokens()

    def run(m: nn.Module) -> dict:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_and_grads(m, idx)[1]

    assert_same_grads(run(copy.deepcopy(model)), run(checkpointed_copy(model, policy)))


# ---------------------------------------------------------------------------------------------- #
# A recompute that diverges from its forward gets a clear error
# ---------------------------------------------------------------------------------------------- #


class CacheAppendingBlock(nn.Module):
    """Appends to a list it does not own, and reads it back: the recompute sees a longer list."""

    def __init__(self, cache: list) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.cache = cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.append(x.detach())
        context = torch.cat(self.cache, dim=1)  # (b, 3 * calls, 8): its shape changes on recompute
        return x + self.lin(context).relu().mean(dim=1, keepdim=True)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_that_diverges_names_block_and_fix(policy: str) -> None:
    cache: list = []
    model = nn.Sequential(CacheAppendingBlock(cache), CacheAppendingBlock(cache))
    apply_activation_checkpointing(model, policy)
    out = model(torch.randn(2, 3, 8, requires_grad=True))
    with pytest.raises(RecomputeMismatchError, match=r"block '1' \(CacheAppendingBlock\).*use_cache=False"):
        out.sum().backward()


def test_hf_style_kv_cache_names_use_cache() -> None:
    torch.manual_seed(0)
    model = checkpointed_copy(HFStyleModel(), "selective")
    out = model(**hf_inputs(), use_cache=True, cache=[])
    with pytest.raises(RecomputeMismatchError, match=r"block 'layers\.\d' \(HFStyleLayer\).*use_cache=False"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------- #
# No model change needed: Hugging Face caches, BatchNorm statistics, random ops in the save list
# ---------------------------------------------------------------------------------------------- #


def hf_model(kind: str) -> nn.Module:
    """A Hugging Face causal LM at its default config: use_cache=True (and GPT-2's dropout on)."""
    import transformers

    from tests.helpers import tiny_llama_config

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
        return transformers.GPT2LMHeadModel(config)
    return transformers.LlamaForCausalLM(tiny_llama_config())


def cache_of(output: Any) -> Any:
    return output.get("cache", output.get("past_key_values"))  # the key's name differs across versions


def hf_loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict, Any]:
    torch.manual_seed(2)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, cache_of(out)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_hugging_face_default_config_trains_checkpointed_without_cache(kind: str, policy: str) -> None:
    from lightning_shard.activation_checkpointing import cache as cache_module

    model, ids = hf_model(kind).train(), tokens(seq_len=16) % 64
    assert model.config.use_cache
    loss, ref, ref_cache = hf_loss_and_grads(copy.deepcopy(model), ids)
    assert ref_cache is not None  # the default: a cache built in training too
    apply_activation_checkpointing(model, policy)
    cache_module._warned.clear()
    with pytest.warns(UserWarning, match=r"runs its training forwards with use_cache=False") as caught:
        got_loss, grads, got_cache = hf_loss_and_grads(model, ids)
        model.zero_grad()
        hf_loss_and_grads(model, ids)
    assert len([w for w in caught if "use_cache=False" in str(w.message)]) == 1  # logged once
    assert got_cache is None
    assert torch.equal(got_loss, loss)
    assert_same_grads(ref, grads)
    assert model.config.use_cache  # the config, saved with the model, is not changed
    # Evaluation, and a training-mode forward without grad (generate() during training), keep the cache.
    with torch.no_grad():
        assert cache_of(model(input_ids=ids)) is not None
        assert cache_of(model.eval()(input_ids=ids)) is not None
    model.train()
    # Asked for explicitly, in training with grad: refused as Hugging Face's gradient checkpointing refuses it.
    assert cache_of(model(input_ids=ids, use_cache=True)) is None
    remove_activation_checkpointing(model)
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert cache_of(model(input_ids=ids)) is not None


def test_cache_hook_only_on_modules_whose_forward_takes_use_cache() -> None:
    """A LightningModule keeping a Hugging Face config as self.config takes no use_cache: only the model does."""
    from lightning_shard.activation_checkpointing.cache import NoCacheInTraining

    class Holder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_model("llama")
            self.config = self.model.config

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).logits

    holder = Holder()
    apply_activation_checkpointing(holder, "full")
    hooked = {
        n
        for n, m in holder.named_modules()
        if any(isinstance(h, NoCacheInTraining) for h in m._forward_pre_hooks.values())
    }
    assert hooked == {"model", "model.model"}
    holder(tokens(seq_len=8) % 64).sum().backward()
    # Pickles and deep-copies with the hook (a class, not a closure).
    torch.save(copy.deepcopy(holder.model), io.BytesIO())


class BNBlock(nn.Module):
    def __init__(self, d: int = 16, frozen_bn: bool = False) -> None:
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(d, d), nn.BatchNorm1d(d), nn.Dropout(0.2)
        self.frozen_bn = frozen_bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen_bn:
            self.bn.eval()  # fine-tuning habit: running statistics used and saved for backward, not updated
        return self.drop(torch.relu(self.bn(self.lin(x))))  # (b, d)


@pytest.mark.parametrize("policy", ["full", "selective", "memory_budget"])
@pytest.mark.parametrize("frozen_bn", [False, True])
def test_batchnorm_statistics_move_once_per_step(policy: str, frozen_bn: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(BNBlock(frozen_bn=frozen_bn) for _ in range(3)))
    x = torch.randn(8, 16)
    config = ActivationCheckpointing(memory_budget=1.0) if policy == "memory_budget" else policy

    def steps(m: nn.Module) -> tuple[dict, dict]:
        for _ in range(2):
            m.zero_grad()
            _, grads = loss_and_grads(m, x)
        return grads, {k: v.clone() for k, v in m.state_dict().items()}

    ref_grads, ref_state = steps(copy.deepcopy(model))
    grads, state = steps(checkpointed_copy(model, config))
    assert_same_grads(ref_grads, grads)
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key
    if not frozen_bn:
        assert int(state["0.bn.num_batches_tracked"]) == 2


def test_measure_leaves_batchnorm_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(BNBlock(), BNBlock())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measure(model, torch.randn(8, 16))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class RandomOpsBlock(nn.Module):
    """A listed random op (native_dropout) before an unlisted one (nn.Dropout): both draw from one stream."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(d, d), nn.Linear(d, d), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = torch.ops.aten.native_dropout.default(self.a(x), 0.5, True)
        return x + self.drop(self.b(h))


def test_random_ops_are_recomputed_even_when_listed() -> None:
    """A stored random op would be skipped in the recompute, shifting every later dropout mask."""
    torch.manual_seed(0)
    model, x = nn.Sequential(RandomOpsBlock(), RandomOpsBlock()), torch.randn(2, 8, 16)
    _, ref = loss_and_grads(copy.deepcopy(model), x)
    config = ActivationCheckpointing(save_ops=["aten.native_dropout.default", "aten.addmm.default"])
    _, grads = loss_and_grads(checkpointed_copy(model, config), x)
    assert_same_grads(ref, grads)


def test_fused_attention_is_stored_without_dropout_and_recomputed_with_it() -> None:
    from lightning_shard.activation_checkpointing.policy import draws_random_numbers

    attention = torch.ops.aten._scaled_dot_product_efficient_attention.default
    q = torch.empty(1, 1, 4, 8)
    assert not draws_random_numbers(attention, (q, q, q, None, True), {})
    assert not draws_random_numbers(attention, (q, q, q, None, True, 0.0), {})
    assert draws_random_numbers(attention, (q, q, q, None, True, 0.1), {})
    assert draws_random_numbers(attention, (q, q, q, None, True), {"dropout_p": 0.1})
    assert draws_random_numbers(torch.ops.aten.native_dropout.default, (q, 0.5, True), {})
    assert not draws_random_numbers(torch.ops.aten.mm.default, (q, q), {})


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_attention_dropout_gradients_equal(dtype: torch.dtype) -> None:
    """GPT-2's default attention dropout runs inside the fused CUDA kernel: selective must not store it."""
    ids = (tokens(batch=8, seq_len=16) % 64).cuda()

    def grads(model: nn.Module) -> dict:
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = grads(hf_model("gpt2").cuda().train())
    for policy in ("full", "selective"):
        model = hf_model("gpt2").cuda().train()
        apply_activation_checkpointing(model, policy)
        got = grads(model)
        for name, value in reference.items():
            assert torch.equal(got[name], value), f"{policy}: {name}"


# ---------------------------------------------------------------------------------------------- #
# Measuring: bytes at the allocator, FLOPs by FlopCounterMode
# ---------------------------------------------------------------------------------------------- #


def test_measure_flops_of_two_mlp_blocks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 32)) for _ in range(2))
    )
    x = torch.randn(64, 32)
    none = measure(model, x)
    matmul = 2 * 64 * 32 * 256  # one (64, 32) @ (32, 256) or (64, 256) @ (256, 32) matmul
    # Backward: a weight-grad matmul per layer, and an input-grad matmul for all but the very first layer.
    assert (none.forward_flops, none.backward_flops, none.recompute_flops) == (4 * matmul, 7 * matmul, 0)
    apply_activation_checkpointing(model, "full")
    full = measure(model, x)
    assert (full.forward_flops, full.backward_flops) == (none.forward_flops, none.backward_flops)
    # Recompute stops once backward has what it needs: each block re-runs its first matmul (to get the
    # tanh input) but not its last, whose output no backward formula uses.
    assert full.recompute_flops == 2 * matmul
    # Each block keeps its input and the RNG state (5 kB on CPU) instead of two (64, 256) activations.
    assert full.activation_bytes < none.activation_bytes / 2


def test_measured_bytes_full_below_selective_below_none() -> None:
    model, idx = tiny_gpt(dropout=0.0, seq_len=64, d_model=64), tokens(4, 64)
    none = measure(model, idx)
    selective = measure(checkpointed_copy(model, ActivationCheckpointing(save_matmuls="all")), idx)
    every_other = measure(checkpointed_copy(model, ActivationCheckpointing(save_matmuls="every_other")), idx)
    default = measure(checkpointed_copy(model, "selective"), idx)
    assert (default.activation_bytes, default.recompute_flops) == (
        every_other.activation_bytes,
        every_other.recompute_flops,
    )
    full = measure(checkpointed_copy(model, "full"), idx)
    assert (
        full.activation_bytes
        < every_other.activation_bytes
        < selective.activation_bytes
        < none.activation_bytes
    )
    assert full.activation_bytes < 0.25 * none.activation_bytes
    assert none.recompute_flops == selective.recompute_flops == 0  # selective keeps every FLOP-counted op
    assert 0 < every_other.recompute_flops < full.recompute_flops < none.forward_flops
    assert len({m.forward_flops for m in (none, selective, every_other, full)}) == 1


@pytest.mark.parametrize("budget", [0.3, 0.6, 0.9])
def test_memory_budget_plan_fits_when_measured(budget: float) -> None:
    model, idx = tiny_gpt(dropout=0.0, seq_len=64, d_model=64), tokens(4, 64)
    none = measure(model, idx)
    config = ActivationCheckpointing(memory_budget=budget)
    planned = measure(checkpointed_copy(model, config), idx)
    (plan,) = config.plans
    assert plan.fits and len(plan.modes) == 4 and plan.planned_bytes <= plan.budget_bytes
    blocks_none = 4 * plan.costs["none"].bytes
    outside_blocks = none.activation_bytes - blocks_none
    assert planned.activation_bytes - outside_blocks <= budget * blocks_none * 1.02
    if budget == 0.9:
        assert "none" in plan.modes  # a loose budget leaves some blocks alone
    if budget == 0.3:
        assert "full" in plan.modes


def test_memory_budget_below_full_recompute_warns_and_uses_full() -> None:
    model, idx = tiny_gpt(), tokens()
    config = ActivationCheckpointing(memory_budget=0.001)
    apply_activation_checkpointing(model, config)
    with pytest.warns(UserWarning, match=r"memory_budget=0.001\) cannot be met.*Using policy='full'"):
        model(idx)
    assert config.plans[0].modes == ("full",) * 4 and not config.plans[0].fits


# ---------------------------------------------------------------------------------------------- #
# Bad input: every raise, with the flag, the value and the fix
# ---------------------------------------------------------------------------------------------- #

BAD_ARGS = [
    ({"policy": "fast"}, r"policy='fast'\) is not a policy\. Use 'selective'"),
    ({"every_n": 0}, r"every_n=0\) must be a whole number >= 1"),
    ({"every_n": -2}, r"every_n=-2\) must be a whole number >= 1"),
    ({"every_n": 1.5}, r"every_n=1.5\) must be a whole number >= 1"),
    ({"memory_budget": 0}, r"memory_budget=0\) must be a fraction in \(0, 1\]"),
    ({"memory_budget": 1.5}, r"memory_budget=1.5\) must be a fraction in \(0, 1\]"),
    ({"memory_budget": -0.1}, r"memory_budget=-0.1\) must be a fraction in \(0, 1\]"),
    ({"every_n": 2, "memory_budget": 0.5}, r"every_n=2, memory_budget=0.5\) both choose which blocks"),
    ({"save_matmuls": "odd"}, r"save_matmuls='odd'\) must be 'all'"),
    (
        {"policy": "full", "save_ops": ["aten.mm.default"]},
        r"policy='full', save_ops=\['aten.mm.default'\]\).*saves no op",
    ),
    ({"policy": "full", "save_matmuls": "every_other"}, r"policy='full', save_matmuls='every_other'\)"),
    ({"save_ops": ["aten.mm"]}, r"save_ops=\.\.\.\) entry 'aten.mm' is not an op name.*'aten.mm.default'"),
    (
        {"save_ops": ["aten.no_such_op.default"]},
        r"entry 'aten.no_such_op.default' is not a registered torch op",
    ),
    ({"save_ops": [torch.ops.aten.mm]}, r"is an op packet, not an overload.*aten\.mm\.default"),
    ({"save_ops": [3]}, r"entry 3 is neither a torch op overload nor an op name"),
    ({"save_ops": []}, r"save_ops=\.\.\.\)=\[\] saves nothing.*policy='full'"),
    ({"blocks": "NoDots"}, r"blocks=\.\.\.\) entry 'NoDots' is not an import path"),
    (
        {"blocks": "lightning_shard.demos.NoSuchBlock"},
        r"entry 'lightning_shard.demos.NoSuchBlock' could not be imported",
    ),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_ARGS, ids=[str(k) for k, _ in BAD_ARGS])
def test_bad_arguments_raise_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ActivationCheckpointing(**kwargs)


def test_blocks_matching_nothing() -> None:
    with pytest.raises(
        ValueError, match=r"blocks=<class 'torch.nn.modules.conv.Conv2d'>\) matches no submodule of GPT"
    ):
        apply_activation_checkpointing(tiny_gpt(), ActivationCheckpointing(blocks=nn.Conv2d))
    with pytest.raises(ValueError, match=r"blocks=None\) found no repeated block in Linear.*blocks=\["):
        apply_activation_checkpointing(nn.Linear(2, 2), "full")


def test_applying_twice_raises() -> None:
    model = tiny_gpt()
    apply_activation_checkpointing(model, "full")
    with pytest.raises(
        ValueError, match=r"already applied to 4 blocks of GPT.*not both.*remove_activation_checkpointing"
    ):
        apply_activation_checkpointing(model, "selective")


def test_blocks_wrapped_by_torch_checkpoint_wrapper_raise() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_gpt()
    model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    with pytest.raises(ValueError, match=r"already has blocks wrapped by torch's checkpoint_wrapper"):
        apply_activation_checkpointing(model, "full")


def test_hf_gradient_checkpointing_already_on_raises() -> None:
    model = tiny_gpt()
    for block in model.blocks:
        block.gradient_checkpointing = True  # what transformers' gradient_checkpointing_enable() sets
    with pytest.raises(
        ValueError, match=r"already has Hugging Face gradient checkpointing.*gradient_checkpointing_disable"
    ):
        apply_activation_checkpointing(model, "full")


def test_strategy_flag_normalisation() -> None:
    assert ActivationCheckpointing.from_flag(None) is None
    config = ActivationCheckpointing(every_n=2)
    assert ActivationCheckpointing.from_flag(config) is config
    full = ActivationCheckpointing.from_flag("full")
    assert (full.policy, full.every_n, full.memory_budget) == ("full", None, None)
    with pytest.raises(
        ValueError, match=r"ShardStrategy\(activation_checkpointing=\.\.\.\)='everything' is not"
    ):
        ActivationCheckpointing.from_flag("everything", "ShardStrategy(activation_checkpointing=...)")
    with pytest.raises(ValueError, match=r"apply_activation_checkpointing\(config=\.\.\.\)='some'"):
        apply_activation_checkpointing(tiny_gpt(), "some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"config=None\) has nothing to apply"):
        apply_activation_checkpointing(tiny_gpt(), None)  # type: ignore[arg-type]


def test_default_save_list_is_documented() -> None:
    text = (ROOT / "docs" / "activation_checkpointing.md").read_text()
    for name in DEFAULT_SAVE_OPS:
        assert name in text, name


# ---------------------------------------------------------------------------------------------- #
# Lightning: the callback in a Trainer, YAML through LightningCLI
# ---------------------------------------------------------------------------------------------- #


class RecordingGPT(GPTModule):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


class LateGPT(RecordingGPT):
    """Builds its layers in configure_model, after callbacks' setup has run."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            h = self.hparams
            self.model = GPT(h.vocab_size, h.seq_len, h.d_model, h.n_layers, h.n_heads, h.dropout)


class FSDP2GPT(RecordingGPT):
    """Lightning's ModelParallelStrategy: the user shards in configure_model."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class FSDP2GPTCheckpointedFirst(FSDP2GPT):
    """What ShardStrategy does: patch the blocks first, then fully_shard them (found by class as before)."""

    def configure_model(self) -> None:
        apply_activation_checkpointing(self, ActivationCheckpointing(policy="full"))
        super().configure_model()


GPT_ARGS = {"seq_len": 16, "d_model": 32, "n_layers": 3, "n_heads": 2, "dropout": 0.1, "max_steps": 3}


def fit(module_cls: type[RecordingGPT], callbacks: list, **trainer_kwargs) -> RecordingGPT:
    L.seed_everything(0, verbose=False)
    module = module_cls(**GPT_ARGS)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    trainer.fit(module, TextDataModule(seq_len=16, batch_size=4, n_sentences=60))
    return module


@pytest.mark.parametrize("module_cls", [RecordingGPT, LateGPT])
def test_callback_in_trainer_trains_like_no_checkpointing(module_cls: type[RecordingGPT]) -> None:
    reference = fit(module_cls, [], devices=1)
    callback = ActivationCheckpointing(policy="selective", every_n=1)
    module = fit(module_cls, [callback], devices=1)
    assert len(checkpointed_blocks(module)) == 3
    assert "configure_model" not in module.__dict__  # the deferred hook is gone after the fit
    assert module.losses == pytest.approx(reference.losses, abs=1e-6)
    for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)


def test_callback_twice_in_one_trainer_raises() -> None:
    with pytest.raises(ValueError, match=r"already applied to 3 blocks of RecordingGPT"):
        fit(RecordingGPT, [ActivationCheckpointing(), ActivationCheckpointing(policy="full")], devices=1)


def test_callback_applies_at_fit_start_when_configure_model_was_skipped() -> None:
    module, callback = RecordingGPT(**GPT_ARGS), ActivationCheckpointing(policy="full")
    callback.setup(None, module, "validate")  # type: ignore[arg-type]
    assert "configure_model" not in module.__dict__
    callback.setup(None, module, "fit")  # type: ignore[arg-type]
    assert "configure_model" in module.__dict__
    callback.on_fit_start(None, module)  # type: ignore[arg-type]
    assert len(checkpointed_blocks(module)) == 3 and "configure_model" not in module.__dict__
    callback.setup(None, module, "fit")  # type: ignore[arg-type]  # a second fit: already applied, nothing to do
    assert "configure_model" not in module.__dict__


def test_lightning_cli_yaml_round_trip(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  logger: false
  callbacks:
    - class_path: lightning_shard.ActivationCheckpointing
      init_args:
        policy: selective
        blocks: [lightning_shard.demos.Block]
        every_n: 2
        save_ops: [aten.mm.default, aten.addmm.default]
        save_matmuls: every_other
    - class_path: lightning_shard.ActivationCheckpointing
      init_args:
        policy: full
        blocks: lightning_shard.demos.Block
        memory_budget: 0.25
"""
    )
    cli = LightningCLI(
        GPTModule, TextDataModule, run=False, args=["--config", str(config)], save_config_callback=None
    )
    first, second = (c for c in cli.trainer.callbacks if isinstance(c, ActivationCheckpointing))
    assert (first.policy, first.blocks, first.every_n, first.save_matmuls) == (
        "selective",
        [Block],
        2,
        "every_other",
    )
    assert first.save_ops == ["aten.mm.default", "aten.addmm.default"]
    assert (second.policy, second.blocks, second.memory_budget) == ("full", Block, 0.25)
    dumped = cli.parser.dump(cli.config, skip_none=False)
    assert "lightning_shard.demos.Block" in dumped and "every_other" in dumped and "0.25" in dumped


# ---------------------------------------------------------------------------------------------- #
# Two ranks over gloo: DDP and Lightning's ModelParallelStrategy (FSDP2)
# ---------------------------------------------------------------------------------------------- #


def _two_rank_parity() -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    out: dict = {}
    for name, module_cls, strategy in (
        ("ddp", RecordingGPT, lambda: "ddp"),
        ("fsdp2", FSDP2GPT, lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)),
    ):
        for label, callbacks in (
            ("none", []),
            ("ac", [ActivationCheckpointing(policy="selective", every_n=1)]),
        ):
            module = fit(module_cls, callbacks, devices=2, strategy=strategy())
            out[f"{name}_{label}"] = module.losses
            out[f"{name}_{label}_patched"] = len(checkpointed_blocks(module))
            out[f"{name}_{label}_sharded"] = all(isinstance(b, FSDPModule) for b in module.model.blocks)
    module = fit(
        FSDP2GPTCheckpointedFirst,
        [],
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    )
    out["fsdp2_first"], out["fsdp2_first_patched"] = module.losses, len(checkpointed_blocks(module))
    out["fsdp2_first_sharded"] = all(isinstance(b, FSDPModule) for b in module.model.blocks)
    return out


@pytest.mark.multirank
def test_two_ranks_ddp_and_model_parallel_match_no_checkpointing() -> None:
    from lightning_shard.demos.ranks import run_ranks

    for rank_out in run_ranks(_two_rank_parity):
        for name in ("ddp", "fsdp2"):
            assert rank_out[f"{name}_ac_patched"] == 3 and rank_out[f"{name}_none_patched"] == 0
            assert len(rank_out[f"{name}_ac"]) == 3
            assert rank_out[f"{name}_ac"] == pytest.approx(rank_out[f"{name}_none"], abs=1e-6)
        assert rank_out["fsdp2_ac_sharded"] and not rank_out["ddp_ac_sharded"]
        assert rank_out["fsdp2_first_sharded"] and rank_out["fsdp2_first_patched"] == 3
        assert rank_out["fsdp2_first"] == pytest.approx(rank_out["fsdp2_none"], abs=1e-6)


# ---------------------------------------------------------------------------------------------- #
# The docs' examples run
# ---------------------------------------------------------------------------------------------- #


def test_docs_python_examples_run() -> None:
    text = (ROOT / "docs" / "activation_checkpointing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for source in blocks:
        exec(compile(source, "docs/activation_checkpointing.md", "exec"), {"__name__": "__docs__"})
