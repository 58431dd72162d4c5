"""Expert parallelism's torch-level foundation (``lightning_shard.expert_parallel``) against one process.

One 2-rank gloo job (ep = 2 = the world) runs every multi-rank case once and the tests read its results:

- tiny Hugging Face Mixtral, Qwen3-MoE, OLMoE, gpt-oss and DeepSeek-V3 (their defaults on, the router aux loss
  in the loss): each rank feeds its own tokens; logits, loss and aux loss equal the unsplit model's on that
  rank's tokens, every non-expert gradient equals the unsplit model's on that rank's tokens, and every expert
  gradient equals the unsplit model's summed over both ranks' tokens (fp32, rtol 1e-5);
- each rank holds E/ep experts (local shapes, numel, which block), and its experts computed rows sent by the
  other rank;
- routing forced by a hook on the router (both models alike): every token to rank 0's experts (rank 1 receives
  nothing: its experts' gradients are zero tensors, not None), mostly to rank 0, and one expert never chosen;
  under the grouped GEMM and under the loop;
- :func:`dispatch_combine` on its own: ranks with different token counts, one with none;
- the refusals that need a mesh.

The rest runs in this process: the grouped GEMM against the loop, and the refusals that need no process group.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_shard.demos.ranks import run_ranks
from lightning_shard.expert_parallel import (
    ExpertLayout,
    apply_expert_parallel,
    grouped_linear,
    grouped_mm_runs,
)
from tests.helpers import MOE_FAMILIES, tiny_moe

needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers: pip install -e '.[hf]'"
)

WORLD, EXPERTS, TOP_K, VOCAB = 2, 4, 2, 64
FAMILIES = MOE_FAMILIES
# Families whose config computes a router aux loss that the loss includes.
WITH_AUX = ("mixtral", "qwen3_moe", "qwen3_moe_norm_topk", "olmoe", "gpt_oss")
TOL: dict[str, Any] = dict(rtol=1e-5, atol=1e-6)


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + rank))


# Routing forced on the router's output, identically in the split and the unsplit model.
def _to_rank0(index: torch.Tensor) -> torch.Tensor:
    return index % (EXPERTS // WORLD)  # every pair to experts 0..E/ep-1, held by rank 0


def _mostly_rank0(index: torch.Tensor) -> torch.Tensor:
    keep = (torch.arange(index.shape[0]) % 4 == 0).unsqueeze(-1)  # one token in four keeps its routing
    return torch.where(keep, index, index % (EXPERTS // WORLD))


def _no_last_expert(index: torch.Tensor) -> torch.Tensor:
    return torch.where(index == EXPERTS - 1, EXPERTS - 2, index)


ROUTES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "to_rank0": _to_rank0,
    "mostly_rank0": _mostly_rank0,
    "no_last_expert": _no_last_expert,
}


def _force_routing(model: nn.Module, route: Callable[[torch.Tensor], torch.Tensor]) -> None:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        logits, weights, index = output
        return logits, weights, route(index)

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(hook)


def _detached(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.detach().clone()


def _run_family(mesh: Any, family: str, route: str | None = None, compute: str = "auto") -> dict[str, Any]:
    """The split model on this rank's tokens, and the unsplit one on every rank's tokens."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    reference = tiny_moe(family)
    if route is not None:
        _force_routing(reference, ROUTES[route])
    split = copy.deepcopy(reference)  # hooks included
    shards = apply_expert_parallel(split, mesh, compute=compute)  # type: ignore[arg-type]
    out = split(input_ids=_tokens(rank), labels=_tokens(rank))
    out.loss.backward()
    ref_grads, ref_out = [], None
    for r in range(WORLD):
        reference.zero_grad(set_to_none=True)
        o = reference(input_ids=_tokens(r), labels=_tokens(r))
        o.loss.backward()
        ref_grads.append({n: _detached(p.grad) for n, p in reference.named_parameters()})
        ref_out = o if r == rank else ref_out
    assert ref_out is not None
    ref_params = dict(reference.named_parameters())
    result: dict[str, Any] = {
        "logits": (out.logits.detach(), ref_out.logits.detach()),
        "loss": (out.loss.detach(), ref_out.loss.detach()),
        "aux": (getattr(out, "aux_loss", None), getattr(ref_out, "aux_loss", None)),
        "grads": {},
        "experts": {},
        "received": {name: shard.received.clone() for name, shard in shards.items()},  # type: ignore[union-attr]
    }
    for name, p in split.named_parameters():
        if isinstance(p, DTensor):
            shard = shards[name.rpartition(".")[0]]
            block = slice(shard.first, shard.first + shard.num_local)
            summed = sum(g[name] for g in ref_grads)  # the unsplit gradient over every rank's tokens
            result["grads"][name] = (None if p.grad is None else p.grad.to_local().clone(), summed[block])
            local = p.to_local()
            result["experts"][name] = {
                "local": tuple(local.shape),
                "global": tuple(p.shape),
                "numel": (local.numel(), p.numel()),
                "placements": str(p.placements),
                "own_block": torch.equal(local, ref_params[name][block]),
            }
        else:
            result["grads"][name] = (_detached(p.grad), ref_grads[rank][name])
    return result


class _ToyExperts(nn.Module):
    """E experts of one linear map each, ``[E, H_out, H]``; the same call contract as transformers' experts."""

    def __init__(self, num_experts: int, width: int) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.randn(num_experts, width, width))
        self.down_proj = nn.Parameter(torch.randn(num_experts, width, width))
        self.act_fn = nn.Tanh()

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for slot in range(index.shape[1]):
            up = torch.einsum("th,toh->to", hidden, self.up_proj[index[:, slot]])
            down = torch.einsum("th,toh->to", self.act_fn(up), self.down_proj[index[:, slot]])
            out = out + weights[:, slot, None] * down
        return out


def _toy_dispatch(mesh: Any) -> dict[str, Any]:
    """Rank 0 holds 7 tokens, rank 1 none: the split module against the unsplit one on all 7."""
    rank = mesh.get_local_rank()
    torch.manual_seed(1)
    reference = _ToyExperts(EXPERTS, 8)
    split = copy.deepcopy(reference)
    apply_expert_parallel(split, mesh, plan={"": "experts"})  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 8, generator=g, requires_grad=True)
    index = torch.randint(0, EXPERTS, (7, TOP_K), generator=g)
    weights = torch.rand(7, TOP_K, generator=g, requires_grad=True)
    mine = slice(0, 7) if rank == 0 else slice(0, 0)
    x, w = hidden[mine].detach().requires_grad_(), weights[mine].detach().requires_grad_()
    y = split(x, index[mine], w)
    (y * torch.arange(1.0, 9.0)).sum().backward()
    expected = reference(hidden, index, weights)
    (expected * torch.arange(1.0, 9.0)).sum().backward()
    shard = split.expert_shard
    block = slice(shard.first, shard.first + shard.num_local)
    return {
        "y": (y.detach(), expected[mine].detach()),
        "x_grad": (x.grad, hidden.grad[mine]),
        "w_grad": (w.grad, weights.grad[mine]),
        "up_grad": (split.up_proj.grad.to_local(), reference.up_proj.grad[block]),
        "received": shard.received.clone(),
    }


def _refusals(mesh: Any) -> list[str]:
    """What each refusal that needs a mesh says (each checked with pytest.raises on the rank)."""
    said = []
    three = _ToyExperts(3, 8)
    with pytest.raises(ValueError, match=r"3 experts are not divisible by 2") as info:
        apply_expert_parallel(three, mesh, plan={"": "experts"})
    said.append(str(info.value))
    toy = _ToyExperts(EXPERTS, 8)
    apply_expert_parallel(toy, mesh, plan={"": "experts"})
    with pytest.raises(ValueError, match=r"already a DTensor") as info:
        apply_expert_parallel(toy, mesh, plan={"": "experts"})
    said.append(str(info.value))
    with pytest.raises(ValueError, match=r"the router chose expert 9") as info:
        toy(torch.randn(3, 8), torch.tensor([[0, 9], [1, 2], [3, 0]]), torch.ones(3, 2))
    said.append(str(info.value))
    return said


def _job() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    out: dict[str, Any] = {"toy": _toy_dispatch(mesh), "refusals": _refusals(mesh)}
    if importlib.util.find_spec("transformers") is not None:
        out["families"] = {family: _run_family(mesh, family) for family in FAMILIES}
        out["routes"] = {
            (route, compute): _run_family(mesh, "mixtral", route, compute)
            for route in ROUTES
            for compute in ("auto", "loop")
        }
        # A process group rather than a mesh (a group of its own, as an expert-parallel group inside data
        # parallelism would be).
        out["group"] = _run_family(dist.new_group(list(range(WORLD))), "qwen3_moe")
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_job, world_size=WORLD)


def _assert_matches(result: dict[str, Any], what: str) -> None:
    for key in ("logits", "loss"):
        torch.testing.assert_close(*result[key], **TOL, msg=lambda m, k=key: f"{what}, {k}: {m}")
    for name, (got, expected) in result["grads"].items():
        assert got is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(got, expected, **TOL, msg=lambda m, n=name: f"{what}, grad of {n}: {m}")


@needs_hf
@pytest.mark.multirank
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_moe_split_over_two_ranks_follows_one_process(ranks, family):
    for rank, out in enumerate(ranks):
        result = out["families"][family]
        _assert_matches(result, f"{family}, rank {rank}")
        aux, ref_aux = result["aux"]
        if family in WITH_AUX:
            assert aux is not None and aux > 0
            torch.testing.assert_close(aux, ref_aux, **TOL)
        experts = result["experts"]
        assert experts and all(".experts." in name for name in experts)
        for name, held in experts.items():
            assert held["local"][0] == EXPERTS // WORLD and held["global"][0] == EXPERTS, (name, held)
            assert held["numel"][0] * WORLD == held["numel"][1], (name, held)
            assert held["placements"] == "(Shard(dim=0),)" and held["own_block"], (name, held)
        # Every expert weight of the model is split (gpt-oss: biases too); the rest is whole.
        split = {name for name in result["grads"] if name in experts}
        assert split == {n for n in result["grads"] if ".experts." in n}


@needs_hf
@pytest.mark.multirank
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_cross_ranks(ranks, family):
    layers = ranks[0]["families"][family]["received"].keys()
    for layer in layers:
        received = [out["families"][family]["received"][layer] for out in ranks]  # [from rank, local expert]
        for rank, counts in enumerate(received):
            assert counts.shape == (WORLD, EXPERTS // WORLD)
            assert counts[1 - rank].sum() > 0, f"{layer}: rank {rank} computed no token of the other rank"
        # dropless: every (token, expert) pair of both ranks was computed once
        assert sum(int(c.sum()) for c in received) == WORLD * _tokens(0).numel() * TOP_K


@needs_hf
@pytest.mark.multirank
def test_a_process_group_works_as_the_mesh(ranks):
    for rank, out in enumerate(ranks):
        _assert_matches(out["group"], f"process group, rank {rank}")


@needs_hf
@pytest.mark.multirank
@pytest.mark.parametrize("compute", ["auto", "loop"])
def test_all_tokens_to_one_rank(ranks, compute):
    pairs = WORLD * _tokens(0).numel() * TOP_K
    for rank, out in enumerate(ranks):
        result = out["routes"][("to_rank0", compute)]
        _assert_matches(result, f"to_rank0 ({compute}), rank {rank}")
        for counts in result["received"].values():
            assert int(counts.sum()) == (pairs if rank == 0 else 0)
        if rank == 1:  # its experts saw no token: zero gradients, not None
            for name, (got, _) in result["grads"].items():
                if name in result["experts"]:
                    assert got is not None and torch.count_nonzero(got) == 0, name


@needs_hf
@pytest.mark.multirank
@pytest.mark.parametrize("compute", ["auto", "loop"])
def test_uneven_splits(ranks, compute):
    for rank, out in enumerate(ranks):
        result = out["routes"][("mostly_rank0", compute)]
        _assert_matches(result, f"mostly_rank0 ({compute}), rank {rank}")
    for layer in ranks[0]["routes"][("mostly_rank0", compute)]["received"]:
        rank0, rank1 = (
            int(out["routes"][("mostly_rank0", compute)]["received"][layer].sum()) for out in ranks
        )
        assert rank0 > 2 * rank1 > 0, (layer, rank0, rank1)


@needs_hf
@pytest.mark.multirank
@pytest.mark.parametrize("compute", ["auto", "loop"])
def test_an_expert_routed_no_tokens_gets_a_zero_gradient(ranks, compute):
    for rank, out in enumerate(ranks):
        result = out["routes"][("no_last_expert", compute)]
        _assert_matches(result, f"no_last_expert ({compute}), rank {rank}")
        if rank == 1:  # holds experts 2 and 3; 3 is never chosen, 2 is
            for name in result["experts"]:
                got = result["grads"][name][0]
                assert got is not None and torch.count_nonzero(got[1]) == 0, name
                assert torch.count_nonzero(got[0]) > 0, name
            for counts in result["received"].values():
                assert counts[:, 1].sum() == 0 and counts[:, 0].sum() > 0


@pytest.mark.multirank
def test_dispatch_with_a_rank_holding_no_tokens(ranks):
    for rank, out in enumerate(ranks):
        for key in ("y", "x_grad", "w_grad", "up_grad"):
            got, expected = out["toy"][key]
            torch.testing.assert_close(
                got, expected, **TOL, msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}"
            )
        assert out["toy"]["received"][0].sum() > 0 and out["toy"]["received"][1].sum() == 0


@pytest.mark.multirank
def test_refusals_on_ranks(ranks):
    for out in ranks:
        not_divisible, twice, out_of_range = out["refusals"]
        assert "_ToyExperts" in not_divisible and "expert-parallel size that divides 3" in not_divisible
        assert "apply expert parallelism once" in twice
        assert "holds 4 experts" in out_of_range


# -- one process --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_equals_the_loop(transposed, bias):
    torch.manual_seed(0)
    counts = [3, 0, 5, 0]  # empty groups in the middle and at the end
    rows = torch.randn(8, 16, requires_grad=True)
    weight = torch.randn(4, 16, 32) if transposed else torch.randn(4, 32, 16)
    weight.requires_grad_()
    b = torch.randn(4, 32, requires_grad=True) if bias else None
    assert grouped_mm_runs(rows, weight.transpose(-2, -1) if not transposed else weight)
    results = []
    for mode in ("grouped_mm", "loop"):
        out = grouped_linear(rows, weight, counts, b, transposed, mode)  # type: ignore[arg-type]
        grads = torch.autograd.grad(out.sum(), [t for t in (rows, weight, b) if t is not None])
        results.append((out, *grads))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # A per-expert reference, and zero (not missing) gradients for the experts with no rows.
    w = weight if transposed else weight.transpose(-2, -1)
    expected = torch.cat([rows[:3] @ w[0], rows[3:] @ w[2]]) + (b[[0] * 3 + [2] * 5] if b is not None else 0)
    torch.testing.assert_close(results[0][0], expected, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(results[0][2][1]) == 0 and torch.count_nonzero(results[0][2][3]) == 0


def test_grouped_gemm_is_chosen_only_where_it_runs():
    assert grouped_mm_runs(torch.randn(4, 16), torch.randn(2, 16, 8))
    assert not grouped_mm_runs(
        torch.randn(4, 16, dtype=torch.float64), torch.randn(2, 16, 8, dtype=torch.float64)
    )
    assert not grouped_mm_runs(torch.randn(4, 6), torch.randn(2, 6, 10))  # rows of 24 bytes: unaligned
    # and the loop serves those
    out = grouped_linear(torch.randn(4, 6), torch.randn(2, 10, 6), [1, 3])
    assert out.shape == (4, 10)


class _ListExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(EXPERTS))


class _Carrying(nn.Module):
    """A stand-in for a Hugging Face model: a base-model prefix and a config carrying an expert-parallel plan."""

    base_model_prefix = "model"

    def __init__(self, plan: dict[str, str]) -> None:
        super().__init__()
        self.config = type("Config", (), {"base_model_ep_plan": plan})()
        self.model = nn.Module()
        self.model.moe = _ToyExperts(EXPERTS, 8)


def _layout_of(module: nn.Module) -> ExpertLayout:
    return ExpertLayout.of(module, "blocks.0.moe")


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: _ListExperts(), r"blocks\.0\.moe \(_ListExperts\) holds its experts as an nn\.ModuleList"),
        (lambda: nn.ModuleList([nn.Linear(2, 2)]), r"nn\.ModuleList of per-expert modules"),
        (lambda: nn.Linear(4, 4), r"no 3-D expert weights to split: .*it has \['bias', 'weight'\]"),
    ],
)
def test_layouts_refused_by_name(build, match):
    with pytest.raises(ValueError, match=match):
        _layout_of(build())


def test_layout_refusals_name_what_is_missing():
    toy = _ToyExperts(EXPERTS, 8)
    del toy.act_fn
    with pytest.raises(ValueError, match=r"holds up_proj but no 'act_fn'"):
        _layout_of(toy)
    gated = nn.Module()
    gated.gate_up_proj, gated.down_proj = nn.Parameter(torch.ones(2, 8, 4)), nn.Parameter(torch.ones(2, 4, 4))
    with pytest.raises(ValueError, match=r"neither '_apply_gate' nor 'act_fn'"):
        _layout_of(gated)
    flat = _ToyExperts(EXPERTS, 8)
    flat.up_proj = nn.Parameter(torch.ones(4, 8))
    with pytest.raises(
        ValueError, match=r"blocks\.0\.moe\.up_proj has shape \(4, 8\); expert weights are 3-D"
    ):
        _layout_of(flat)
    odd = _ToyExperts(EXPERTS, 8)
    odd.num_experts = 5
    with pytest.raises(ValueError, match=r"disagrees on its expert count: .*'num_experts': 5"):
        _layout_of(odd).num_experts(odd, "blocks.0.moe")


@pytest.mark.parametrize(
    ("model", "plan", "match"),
    [
        (lambda: _ToyExperts(4, 8), {"": "gate"}, r"unknown role 'gate'"),
        (lambda: _ToyExperts(4, 8), {}, r"must be a non-empty mapping"),
        (
            lambda: _Carrying({}),
            {"layers.*.experts": "experts"},
            r"'layers\.\*\.experts' \('experts'\) matches no",
        ),
        (lambda: _Carrying({}), {"moe": "router"}, r"names no experts module of _Carrying"),
        (lambda: _Carrying({}), None, r"_Carrying carries no expert-parallel plan"),
        (lambda: nn.Linear(2, 2), None, r"Linear carries no expert-parallel plan"),
        (
            lambda: _Carrying({"moe": "ep_dispatch_experts", "moe.gate": "grouped_gemm"}),
            None,
            r"the plan splits \['gate'\] of model\.moe .*not among its expert weights",
        ),
        # everything checks out: the last refusal is the missing process group
        (lambda: _Carrying({"moe": "ep_dispatch_experts"}), None, r"needs an initialised process group"),
    ],
)
def test_plan_refusals_before_any_process_group(model, plan, match):
    with pytest.raises(ValueError, match=match):
        apply_expert_parallel(model(), None, plan)


def test_compute_mode_is_checked():
    with pytest.raises(ValueError, match=re.escape("apply_expert_parallel(compute='fast')")):
        apply_expert_parallel(_ToyExperts(4, 8), None, {"": "experts"}, compute="fast")  # type: ignore[arg-type]
