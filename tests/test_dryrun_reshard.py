"""The reshard plan in one process: a checkpoint of the demo GPT saved by 1024 ZeRO-3 ranks and loaded by 512,
planned from metadata and meta tensors, against figures computed here from the parameters' shapes; and the
inputs it refuses.

The expected figures never read the plan's shards: FSDP2 gives rank ``r`` of ``s`` the rows
``[r * ceil(n / s), (r + 1) * ceil(n / s))`` of a parameter of ``n`` rows (cut at ``n``), the optimizer's
``exp_avg`` and ``exp_avg_sq`` the same rows, and each saving rank writes its own rows to ``__<r>_0.distcp``
(no replica to share them with). A loading rank reads from each saving rank's file the overlap of their rows.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_shard import cli
from lightning_shard.dryrun import reshard
from lightning_shard.dryrun import resharding as reshard_module

GPT = "lightning_shard.demos.gpt.GPT"
# Uneven on purpose: 3001 tokens and 1500 positions divide by neither 1024 nor 512.
ARGS = dict(vocab_size=3001, seq_len=1500, d_model=32, n_heads=2, n_layers=1)
STATES = (".exp_avg", ".exp_avg_sq")  # AdamW's two states, of the parameter's rows


def _rows(n: int, ranks: int, rank: int) -> range:
    per = math.ceil(n / ranks)
    return range(min(rank * per, n), min((rank + 1) * per, n))


def _shapes(tied: bool = False) -> dict[str, tuple[int, ...]]:
    """The parameters' shapes: each once (the optimizer's keys), or under every name (the model's keys: the
    head is tied to the token embedding)."""
    from lightning_shard.demos.gpt import GPT as Model

    with torch.device("meta"):
        model = Model(**ARGS)
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=not tied)}


def _expected_reads(rank: int) -> dict[str, int]:
    """Saving file -> bytes the loading rank ``rank`` of 512 keeps of the sharded entries (fp32)."""
    files: dict[str, int] = {}
    tensors = [
        *_shapes(tied=True).values(),
        *2 * list(_shapes().values()),
    ]  # the model's, exp_avg, exp_avg_sq
    for shape in tensors:
        row = 4 * math.prod(shape[1:])
        want = _rows(shape[0], 512, rank)
        for saver in range(1024):
            have = _rows(shape[0], 1024, saver)
            overlap = len(range(max(want.start, have.start), min(want.stop, have.stop)))
            if overlap:
                name = f"__{saver}_0.distcp"
                files[name] = files.get(name, 0) + overlap * row
    return files


def _unsharded(metadata) -> list:
    """The saved entries held whole by every rank: objects and one-chunk tensors."""
    single = {k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)}
    single |= {
        k
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and len(v.chunks) == 1
    }
    return [i for i in metadata.storage_data if i.fqn in single]


@pytest.fixture(scope="module")
def plan() -> reshard_module.ReshardPlan:
    return reshard(
        GPT, dict(stage=3), 1024, dict(stage=3), 512, ranks=[0, 7, 511], precision="32-true", init_args=ARGS
    )


def test_the_saved_metadata_puts_each_rank_s_rows_in_its_own_file(plan):
    metadata, shapes = plan.metadata, _shapes()
    keys = [(f"state_dict.{name}", shape) for name, shape in _shapes(tied=True).items()]
    keys += [
        (f"optimizer_0.state.{name}{state}", shape) for name, shape in shapes.items() for state in STATES
    ]
    for key, shape in keys:
        saved = metadata.state_dict_metadata[key]
        assert isinstance(saved, TensorStorageMetadata) and tuple(saved.size) == shape
        rows = {(c.offsets[0], c.sizes[0]) for c in saved.chunks if c.sizes[0]}
        assert rows == {(r.start, len(r)) for s in range(1024) if len(r := _rows(shape[0], 1024, s))}, key
    for index, info in metadata.storage_data.items():
        saved = metadata.state_dict_metadata[index.fqn]
        if (
            isinstance(saved, TensorStorageMetadata)
            and len(saved.chunks) > 1
            and index.offset[0] < saved.size[0]
        ):
            rows = _rows(saved.size[0], 1024, 0).stop  # each saving rank's rows (the last ones' fewer)
            assert info.relative_path == f"__{index.offset[0] // rows}_0.distcp", index
    # entries every rank holds (each parameter's `step`, the param groups) are written once, spread over the files
    whole = _unsharded(metadata)
    assert len(whole) == len({i.fqn for i in whole})
    assert {f"optimizer_0.state.{name}.step" for name in shapes} < {i.fqn for i in whole}
    assert len({metadata.storage_data[i].relative_path for i in whole}) > 10


@pytest.mark.parametrize("position", [0, 1, 2])
def test_a_loading_rank_reads_the_overlap_of_its_rows_with_each_saving_rank_s(plan, position):
    read = plan.ranks[position]
    expected = _expected_reads(read.rank)
    metadata = plan.metadata
    # what every rank reads besides its rows: each unsharded entry (the `step`s, the param groups), whole
    extra: dict[str, int] = {}
    for info in (metadata.storage_data[i] for i in _unsharded(metadata)):
        extra[info.relative_path] = extra.get(info.relative_path, 0) + info.length
    assert set(read.files) == set(expected) | set(extra), read.rank
    for name, got in read.files.items():
        assert got.bytes == expected.get(name, 0) + extra.get(name, 0), (read.rank, name)
        assert got.chunk_bytes >= got.bytes
    assert read.bytes == sum(expected.values()) + sum(extra.values()) == read.needed_bytes + read.object_bytes


def test_a_pipelined_tensor_parallel_save_read_by_a_tensor_parallel_layout_reads_each_element_once():
    """PP2 x TP2 x ZeRO-3 over 16 ranks, read by TP4 x ZeRO-3 over 8: every loading rank keeps exactly what its
    own shards hold (each element found once among the saved chunks, none twice), from files of both stages."""
    args = dict(vocab_size=251, seq_len=101, d_model=64, n_heads=4, n_layers=4)
    saved = dict(stage=3, tensor_parallel_size=2, pipeline_parallel_size=2)
    plan = reshard(GPT, saved, 16, dict(stage=3, tensor_parallel_size=4), 8, ranks=[0, 5], init_args=args)
    for read in plan.ranks:
        assert read.bytes == read.needed_bytes + read.object_bytes and read.needed_bytes > 0, read.rank
        stages = {int(name[2:].split("_")[0]) >= 8 for name in read.files}  # pipeline stage 1 is ranks 8-15
        assert stages == {False, True}, read.rank


def test_the_plan_s_json_and_figures(plan):
    document = plan.to_dict()
    assert document["save_world_size"] == 1024 and document["load_world_size"] == 512
    assert [r["rank"] for r in document["ranks"]] == [0, 7, 511]
    assert document["ranks"][0]["files"]["__0_0.distcp"]["reads"] > 0
    assert json.loads(json.dumps(document)) == document
    table = reshard_module.reshard_table(plan)
    assert "checkpoint of 1024 ranks" in table and "bytes kept" in table


def test_cli_reshard_json_and_table(capsys):
    argv = ["dryrun", "--model", GPT, "--model.n_layers", "1", "--world-size", "8", "--gpu-mem", "80GB"]
    argv += [
        "--stage",
        "3",
        "--replicate-size",
        "2",
        "--load-world-size",
        "4",
        "--load-flags",
        "replicate_size=1",
    ]
    assert cli.main([*argv, "--ranks", "0,3", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["load_strategy_kwargs"]["replicate_size"] == 1
    assert [r["rank"] for r in document["ranks"]] == [0, 3]
    assert cli.main(argv) == 0
    assert "read by 2 of 4 ranks" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--load-world-size", "0"], r"--load-world-size must be 1 or more ranks \(got 0\)"),
        (["--load-world-size", "4", "--load-flags", "replicate_size=3"], r"replicate_size=3"),
        (["--load-world-size", "4", "--load-flags", "bogus=1"], r"--load-flags \{'bogus': 1\}: .*bogus"),
        (["--load-flags", "replicate_size=1"], r"--load-flags .* give --load-world-size too"),
    ],
)
def test_cli_reshard_refusals_name_the_flag(capsys, extra, message):
    argv = [
        "dryrun",
        "--model",
        GPT,
        "--model.n_layers",
        "1",
        "--world-size",
        "8",
        "--gpu-mem",
        "80GB",
        "--stage",
        "3",
    ]
    assert cli.main([*argv, *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_load_flags_must_be_pairs(capsys):
    argv = ["dryrun", "--model", GPT, "--world-size", "8", "--gpu-mem", "80GB", "--load-world-size", "4"]
    with pytest.raises(SystemExit):
        cli.main([*argv, "--load-flags", "replicate_size"])
    assert "must be NAME=VALUE pairs" in capsys.readouterr().err


def test_reshard_refusals():
    with pytest.raises(ValueError, match=r"reshard\(load_world_size=0\) must be a whole number of ranks"):
        reshard(GPT, dict(stage=3), 8, None, 0, init_args=ARGS)
    with pytest.raises(
        ValueError, match=r"reshard\(ranks=\[9\]\) names ranks outside the loading world of 4"
    ):
        reshard(GPT, dict(stage=3), 8, None, 4, ranks=[9], init_args=ARGS)
    with pytest.raises(ValueError, match=r"reshard\(load_strategy=...stage=1\): ZeRO-1"):
        reshard(GPT, dict(stage=3), 8, dict(stage=1), 4, init_args=ARGS)
    with pytest.raises(ValueError, match=r"replicate_size=3"):
        reshard(GPT, dict(stage=3, replicate_size=3), 8, init_args=ARGS)


def test_reshard_refuses_a_load_the_checkpoint_cannot_serve(monkeypatch):
    saved = reshard_module.saved_metadata

    def without_step(layout):
        metadata = saved(layout)
        key = next(k for k in metadata.state_dict_metadata if k.endswith(".step"))
        del metadata.state_dict_metadata[key]
        return metadata

    monkeypatch.setattr(reshard_module, "saved_metadata", without_step)
    with pytest.raises(
        ValueError, match=r"needs 1 entries the checkpoint of 8 ranks lacks \(optimizer_0\.state\."
    ):
        reshard(GPT, dict(stage=3), 8, None, 4, ranks=[0], init_args=ARGS)


def test_a_torch_without_the_private_planning_apis_fails_the_plan_only(monkeypatch):
    from lightning_shard.dryrun import checkpoint_plan

    monkeypatch.setattr(checkpoint_plan, "_MISSING", ImportError("no dedup_save_plans"))
    with pytest.raises(
        RuntimeError, match=r"the reshard plan needs torch's .*dedup_save_plans.*no dedup_save_plans"
    ):
        reshard(GPT, dict(stage=3), 8, None, 4, ranks=[0], init_args=ARGS)
