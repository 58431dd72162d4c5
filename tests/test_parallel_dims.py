"""The one owner of the parallel dimensions, in one process: each rank's coordinates from arithmetic agree
with the rank grid and with the meshes the layout builds (torch's fake process group plays rank ``r`` of
``W``), the sampler's rank and size, and the views sharing one root mesh."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_shard.parallel import ParallelDims


def _layouts(max_world: int) -> list[tuple[int, dict[str, int]]]:
    """Every layout of 1..``max_world`` ranks the flags can ask for."""
    found = []
    for world in range(1, max_world + 1):
        for pp, replicate, tp, cp, ep in itertools.product((1, 2, 4), (1, 2), (1, 2, 4), (1, 2), (1, 2, 4)):
            sizes = dict(
                pipeline_parallel_size=pp,
                replicate_size=replicate,
                tensor_parallel_size=tp,
                context_parallel_size=cp,
                expert_parallel_size=ep,
            )
            try:
                ParallelDims.for_world(world, **sizes)
            except ValueError:
                continue
            found.append((world, sizes))
    return found


LAYOUTS = _layouts(16)


def test_coordinates_are_the_row_major_rank_grid_of_every_layout():
    assert len(LAYOUTS) > 100
    for world, sizes in LAYOUTS:
        dims = ParallelDims.for_world(world, **sizes)
        grid = torch.arange(world).reshape(dims.pp, dims.replicate, dims.shard, dims.cp, dims.tp)
        expert = grid.reshape(dims.pp, dims.replicate, dims.edp, dims.ep, dims.tp)
        for rank in range(world):
            place = dims.coordinates(rank)
            where = (world, sizes, rank, place)
            assert grid[place["pp"], place["replicate"], place["shard"], place["cp"], place["tp"]] == rank, (
                where
            )
            assert expert[place["pp"], place["replicate"], place["edp"], place["ep"], place["tp"]] == rank, (
                where
            )
            # The sampler: the ranks of one tensor-parallel or context-parallel group, and the stages of one
            # pipeline, read the same slice; replicate x shard slices in all.
            sampler = dims.sampler(rank)
            assert sampler == {
                "num_replicas": dims.replicate * dims.shard,
                "rank": place["replicate"] * dims.shard + place["shard"],
            }, where


def test_the_sampler_counts_the_replica_groups_of_fault_tolerance():
    dims = ParallelDims.for_world(4, tensor_parallel_size=2, replica_groups=3, replica_id=2)
    assert [dims.sampler(r) for r in range(4)] == [{"num_replicas": 6, "rank": 4 + r // 2} for r in range(4)]
    assert dims.ft_enabled and dims.tp_enabled and not dims.ep_enabled


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(pipeline_parallel_size=3), "pipeline_parallel_size=3) does not divide the world size 8"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3) does not divide the world size 8"),
        (dict(tensor_parallel_size=2, replicate_size=3), "replicate_size=3) does not divide the 4"),
        (dict(replicate_size=2, context_parallel_size=3), "context_parallel_size=3) does not divide the 4"),
        (
            dict(tensor_parallel_size=2, expert_parallel_size=8),
            "expert_parallel_size=8) does not divide the 4",
        ),
    ],
)
def test_a_size_that_does_not_divide_names_its_flag(sizes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelDims.for_world(8, **sizes)


def _meshes_of(rank: int, world: int, sizes: dict[str, int], one_root: bool):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = ParallelDims.for_world(world, **sizes)
        meshes = dims.build("cpu")
        place = dims.coordinates(rank)
        seen = {"shard": None}
        if meshes.pipeline is not None:
            seen["pp"] = meshes.pipeline.get_local_rank()
        if meshes.tensor_parallel is not None:
            seen["tp"] = meshes.tensor_parallel.get_local_rank()
        if meshes.expert is not None:
            seen["ep"] = meshes.expert_parallel.get_local_rank()
            seen["edp"] = meshes.expert["edp"].get_local_rank()
            # One root for the dense and the expert views (FSDP2 and DTensor compose meshes of one root).
            assert (meshes.expert._get_root_mesh() is meshes.dense._get_root_mesh()) == one_root
        if meshes.context is not None:
            seen["cp"] = meshes.context.get_local_rank()
            assert meshes.context.size() == dims.cp
        data = meshes.data_parallel
        seen["shard"] = (
            data["shard"].get_local_rank()
            if "shard" in (data.mesh_dim_names or ())
            else (data.get_local_rank())
        )
        expected = {name: place[name] for name in seen}
        expected["shard"] = place["shard"] * dims.cp + place["cp"]  # the mesh's shard dim spans shard x cp
        if data.mesh_dim_names == ("dp",):
            expected["shard"] = rank
        assert data.size() == dims.replicate * dims.shard * dims.cp
        return seen, expected
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("unflatten", [True, False], ids=["one root", "a mesh per view (torch < 2.9)"])
@pytest.mark.parametrize(
    "world, sizes",
    [
        (8, dict(pipeline_parallel_size=2, replicate_size=2, tensor_parallel_size=2)),
        (16, dict(replicate_size=2, context_parallel_size=2, expert_parallel_size=4, tensor_parallel_size=2)),
        (8, dict(pipeline_parallel_size=2, expert_parallel_size=2)),
        (4, dict(expert_parallel_size=4)),  # ep = the world
        (4, dict(context_parallel_size=4)),  # cp = the world
        (2, {}),
    ],
)
def test_every_rank_finds_itself_where_the_arithmetic_puts_it(monkeypatch, unflatten, world, sizes):
    if not unflatten:
        if not hasattr(DeviceMesh, "_unflatten"):
            pytest.skip("this torch builds a mesh per view already")
        monkeypatch.delattr(DeviceMesh, "_unflatten")
    elif not hasattr(DeviceMesh, "_unflatten"):
        pytest.skip("this torch has no DeviceMesh._unflatten")
    for rank in {0, 1, world // 2, world - 1}:
        seen, expected = _meshes_of(rank, world, sizes, unflatten)
        assert seen == expected, (rank, sizes)


def test_one_check_names_the_sizes_that_divide_in_the_callers_spelling():
    from lightning_shard.units import PlanInputError

    with pytest.raises(
        ValueError, match=r"Use a pipeline_parallel_size that divides 12 \(1, 2, 3, 4, 6 or 12:"
    ):
        ParallelDims.for_world(12, pipeline_parallel_size=5)
    with pytest.raises(
        PlanInputError, match=r"^--expert-parallel-size 3 does not divide the 4 .*\(1, 2 or 4\)"
    ):
        ParallelDims.for_world(
            8,
            tensor_parallel_size=2,
            expert_parallel_size=3,
            flag=lambda name, value: f"--{name.replace('_', '-')} {value}",
            error=PlanInputError,
        )


@pytest.mark.parametrize("world", [0, -2, 1.5, True])
def test_a_world_without_a_rank_is_refused_before_any_coordinate(world):
    with pytest.raises(ValueError, match=r"the world size is .*: a layout needs at least one rank"):
        ParallelDims.for_world(world)
