"""Context parallelism in one process: the flags, the mesh layout, how a batch is cut, and every refusal."""

from __future__ import annotations

import pytest
import torch

from lightning_shard import ShardFabricStrategy, ShardStrategy
from lightning_shard.context_parallel import (
    ContextParallel,
    apply_context_parallel,
    chunk_positions,
    split_batch,
)
from lightning_shard.context_parallel.attention import _ulysses
from lightning_shard.context_parallel.batch import scale_loss
from lightning_shard.core.session import Session
from lightning_shard.core.transform import _install_context_parallel
from lightning_shard.demos.gpt import GPT
from lightning_shard.parallel.dims import MeshLayout


def test_each_rank_holds_a_head_and_a_tail_chunk():
    # 16 tokens over 2 ranks: 4 chunks of 4; rank 0 chunks 0 and 3, rank 1 chunks 1 and 2.
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    work = [int((chunk_positions(32, 4, r) + 1).sum()) for r in range(4)]  # keys each rank's queries see
    assert len(set(work)) == 1


def test_labels_are_shifted_before_the_cut_and_targets_counted():
    ids = torch.arange(8)[None].repeat(2, 1)
    labels = ids.clone()
    labels[1, :3] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones(2, 8), "n": torch.ones(2)}
    parts = [split_batch(batch, 2, r) for r in range(2)]
    assert parts[0].batch["input_ids"][0].tolist() == [0, 1, 6, 7]
    # rank 0 keeps the targets of positions 0, 1, 6 and the -100 past the end; rank 1 those of 2..5
    assert parts[0].batch["shift_labels"][0].tolist() == [1, 2, 7, -100]
    assert parts[1].batch["shift_labels"][0].tolist() == [3, 4, 5, 6]
    assert parts[1].batch["shift_labels"][1].tolist() == [3, 4, 5, 6]  # -100 at 1, 2 shifted out of rank 1
    assert parts[0].batch["n"].shape == (2,)  # not a sequence tensor: kept whole
    assert [p.local_targets for p in parts] == [4, 8] and parts[0].group_targets == 12
    weights = [p.loss_weight(2) for p in parts]
    assert weights == pytest.approx([2 * 4 / 12, 2 * 8 / 12])
    assert scale_loss(torch.tensor(3.0), 0.5).item() == 1.5
    assert scale_loss({"loss": torch.tensor(2.0), "x": 1}, 0.5)["loss"].item() == 1.0


def test_a_tuple_batch_is_cut_as_it_is():
    x, y = torch.arange(8)[None], torch.arange(1, 9)[None]
    part = split_batch((x, y), 2, 1)
    assert part.batch[0].tolist() == [[2, 3, 4, 5]] and part.batch[1].tolist() == [[3, 4, 5, 6]]
    assert part.loss_weight(2) == 1.0


@pytest.mark.parametrize(
    "batch, match",
    [
        ((torch.zeros(2, 6, dtype=torch.long),), r"sequence length 6 is not divisible by 4"),
        ({"input_ids": torch.zeros(1, 8), "attention_mask": torch.tensor([[1] * 7 + [0]])}, "padding mask"),
        (
            {"input_ids": torch.zeros(1, 8), "attention_mask": torch.ones(1, 1, 8, 8)},
            "cannot split this mask",
        ),
        (
            {"input_ids": torch.zeros(1, 8), "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])},
            "packed",
        ),
        ((torch.zeros(4),), "no tensor with a sequence dimension"),
    ],
)
def test_a_batch_cp_cannot_cut_is_refused_with_the_fix(batch, match):
    with pytest.raises(ValueError, match=match):
        split_batch(batch, 2, 0)


def test_the_mesh_grows_a_cp_dimension_inside_data_parallel():
    layout = MeshLayout.for_world(8, replicate_size=2, context_parallel_size=2)
    assert (layout.replicate, layout.shard, layout.cp, layout.tp) == (2, 2, 2, 1)
    assert layout.data_parallel_size == 4 and layout.world_size == 8
    # ranks 2k and 2k+1 cut the same sequences
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match=r"context_parallel_size=4\) does not divide the 2"):
        MeshLayout.for_world(4, replicate_size=2, context_parallel_size=4)
    with pytest.raises(ValueError, match="must be an integer"):
        MeshLayout.for_world(4, context_parallel_size=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(context_parallel_size=0), "must be an integer >= 1"),
        (dict(context_parallel_size=2, context_parallel_method="zigzag"), "is unknown"),
        (dict(context_parallel_method="ulysses"), "only used with context_parallel_size > 1"),
    ],
)
def test_flags_cp_cannot_serve_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        ShardStrategy(**flags)


def test_fabric_cuts_the_batch_it_is_handed_and_weights_the_loss_until_the_cut_ends():
    ids = torch.arange(8)[None].repeat(2, 1)
    labels = ids.clone()
    labels[:, :2] = -100  # rank 1 holds 8 of the 12 targets
    batch = {"input_ids": ids, "labels": labels}
    strategy = ShardFabricStrategy(context_parallel_size=2)
    with pytest.raises(
        RuntimeError, match=r"needs the context-parallel group: call it after fabric.launch\(\)"
    ):
        strategy.cut_batch(batch)
    cp = strategy._context_parallel = ContextParallel(None, 2, 1, "allgather")  # as fabric.launch builds it
    with pytest.raises(RuntimeError, match="which fabric.setup installs: set the model up first"):
        strategy.cut_batch(batch)
    strategy._module = torch.nn.Identity()  # as fabric.setup leaves it, with its session
    strategy._session = Session(strategy._module, None, strategy.config, None, None, cp, torch.device("cpu"))
    part = strategy.cut_batch(batch)
    assert part["input_ids"][0].tolist() == [2, 3, 4, 5] and part["shift_labels"][0].tolist() == [3, 4, 5, 6]
    assert cp.active and cp.seq_len == 8
    assert strategy.loss_weight == pytest.approx(2 * 8 / 12)
    assert strategy._session.weigh(torch.tensor(3.0)).item() == pytest.approx(3 * 2 * 8 / 12)
    with pytest.raises(
        ValueError,
        match=r"ShardFabricStrategy\(context_parallel_size=2\) cuts each sequence.*length 6 is not divisible by 4",
    ):
        strategy.cut_batch((torch.zeros(2, 6, dtype=torch.long),))
    assert not cp.active and strategy.loss_weight == 1.0  # no earlier sequence left behind
    strategy.cut_batch(batch)
    strategy.end_cut()  # the model runs whole sequences again
    assert not cp.active and strategy.loss_weight == 1.0
    assert ShardFabricStrategy().cut_batch(batch) is batch  # without context parallelism: as it is
    strategy.cut_batch(batch)
    with pytest.raises(ValueError, match=r"pipeline_step\(model, inputs, target\) cuts the sequences"):
        strategy.pipeline_step(None, ids, ids)  # type: ignore[arg-type]


def test_models_are_installed_or_refused_naming_what_to_add():
    transformers = pytest.importorskip("transformers")
    from tests.helpers import tiny_llama_config

    cp = ContextParallel(None, 2, 0, "allgather")
    gpt = GPT(vocab_size=16, seq_len=8, d_model=8, n_layers=2, n_heads=2)
    assert apply_context_parallel(gpt, cp) == ["blocks.0.attn", "blocks.1.attn"]
    llama = transformers.LlamaForCausalLM(tiny_llama_config())
    assert apply_context_parallel(llama, cp) == ["LlamaForCausalLM"]
    assert llama.config._attn_implementation == "lightning_shard_context_parallel"
    # Outside a step the model runs its whole sequence as under SDPA.
    ids = torch.randint(0, 16, (1, 8))
    reference = transformers.LlamaForCausalLM(tiny_llama_config())
    reference.load_state_dict(llama.state_dict())
    torch.testing.assert_close(llama(ids).logits, reference(ids).logits)
    with pytest.raises(ValueError, match="found no attention it can run over the group in Linear"):
        apply_context_parallel(torch.nn.Linear(2, 2), cp)
    flash = transformers.LlamaForCausalLM(tiny_llama_config())
    flash.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
        apply_context_parallel(flash, cp)


def test_ring_is_refused_on_cpu_and_ulysses_needs_divisible_heads():
    with pytest.raises(ValueError, match="CUDA SDPA kernels only.*'allgather'"):
        _install_context_parallel(
            torch.nn.Linear(2, 2), ContextParallel(None, 2, 0, "ring"), "cpu", "ShardStrategy"
        )
    cp = ContextParallel(None, 2, 0, "ulysses")
    cp.begin(8)
    q = torch.zeros(1, 3, 4, 2)
    with pytest.raises(ValueError, match="3 query heads.*context_parallel_method='allgather'"):
        _ulysses(cp, q, q, q, 0.0, None)
    with pytest.raises(RuntimeError, match="attention got 3 tokens"):
        cp.attention(torch.zeros(1, 2, 3, 2), torch.zeros(1, 2, 3, 2), torch.zeros(1, 2, 3, 2))


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="ring attention needs 2 CUDA devices (one nccl rank per device)",
)
def test_ring_follows_one_process_on_two_gpus():
    from lightning_shard.demos.ranks import run_ranks
    from tests.test_context_parallel_multirank import _ring_on_cuda
    from tests.test_parity_multirank import CLIP, reference

    losses = run_ranks(_ring_on_cuda, world_size=2)[0]
    torch.testing.assert_close(losses, reference("sgd", 2, CLIP), rtol=1e-4, atol=0)
