"""Full pretrained weights into a (sharded) model: formats, key prefixes, ties, dtypes, errors, 2 ranks."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from lightning_shard.checkpoint.init_weights import (
    InitWeightsError,
    load_full_weights,
    local_index,
    match_keys,
    open_weights,
)
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import tiny_llama_config

LOGGER = "lightning_shard.checkpoint.init_weights"


class _Net(nn.Module):
    """Odd first dimensions (7, 5, 1): uneven shards on 2 ranks, one rank holding no row of ``scale``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(8, 7)
        self.b = nn.Linear(7, 5)
        self.scale = nn.Parameter(torch.randn(1, 3))
        self.register_buffer("step", torch.randn(2))
        self.register_buffer("cache", torch.ones(3), persistent=False)  # not in the state dict


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _Net(seed).state_dict().items()}


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _assert_loaded(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert_close(state[key], value.to(state[key].dtype), rtol=0, atol=0, msg=key)


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_torch_file_round_trip(tmp_path):
    expected = _weights()
    torch.save(expected, tmp_path / "model.pt")
    model = _Net(seed=1)
    assert not torch.equal(model.a.weight, expected["a.weight"])
    report = load_full_weights(model, tmp_path / "model.pt")
    _assert_loaded(model, expected)
    assert report == {"prefix": "", "prefix_on": "", "loaded": 6, "bytes_read": _nbytes(expected.values())}


def test_lightning_checkpoint_with_a_prefix_the_module_lacks(tmp_path, caplog):
    expected = _weights()
    checkpoint = {"state_dict": {f"model.{k}": v for k, v in expected.items()}, "epoch": 3}
    torch.save(checkpoint, tmp_path / "last.ckpt")
    model = _Net(seed=1)
    caplog.set_level(logging.INFO, logger=LOGGER)
    report = load_full_weights(model, tmp_path / "last.ckpt")
    _assert_loaded(model, expected)
    assert (report["prefix"], report["prefix_on"]) == ("model.", "file")
    assert "the file's keys without their leading 'model.'" in caplog.text


def test_safetensors_file_round_trip(tmp_path):
    expected = _weights()
    model = _Net(seed=1)
    report = load_full_weights(model, _save_safetensors(expected, tmp_path / "w.safetensors"))
    _assert_loaded(model, expected)
    assert report["bytes_read"] == _nbytes(expected.values())


def test_directory_with_a_single_model_safetensors(tmp_path):
    expected = _weights()
    _save_safetensors(expected, tmp_path / "model.safetensors")
    model = _Net(seed=1)
    load_full_weights(model, tmp_path)
    _assert_loaded(model, expected)


class _LitLike(nn.Module):
    """An HF model held as ``self.model``, as in a LightningModule: its keys are ``model.`` + the file's."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(config)


def test_hugging_face_sharded_directory_into_a_wrapper(tmp_path, caplog):
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config(vocab_size=128)
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(config)
    saved.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    with open_weights(tmp_path) as source:
        assert "lm_head.weight" not in source.keys()  # tied: saved once, as the embedding

    torch.manual_seed(1)
    wrapper = _LitLike(config)
    caplog.set_level(logging.INFO, logger=LOGGER)
    report = load_full_weights(wrapper, tmp_path)
    assert (report["prefix"], report["prefix_on"]) == ("model.", "model")
    assert "the model's keys without their leading 'model.'" in caplog.text
    assert wrapper.model.lm_head.weight is wrapper.model.model.embed_tokens.weight
    _assert_loaded(wrapper.model, saved.state_dict())
    assert report["loaded"] == len(wrapper.state_dict()) - 1  # lm_head.weight and embed_tokens.weight: once


def test_bf16_file_into_fp32_model(tmp_path):
    expected = {k: v.to(torch.bfloat16) for k, v in _weights().items()}
    model = _Net(seed=1)
    report = load_full_weights(model, _save_safetensors(expected, tmp_path / "bf16.safetensors"))
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())
    _assert_loaded(model, expected)
    assert report["bytes_read"] == _nbytes(expected.values())  # 2 bytes per element: read as stored


def test_read_returns_only_the_slice(tmp_path):
    weight = torch.arange(35.0).reshape(7, 5)
    torch.save({"w": weight}, tmp_path / "w.pt")
    _save_safetensors({"w": weight}, tmp_path / "w.safetensors")
    for file in ("w.pt", "w.safetensors"):
        with open_weights(tmp_path / file) as source:
            assert (source.shape("w"), source.dtype("w")) == (torch.Size([7, 5]), torch.float32)
            part = source.read("w", (slice(4, 7), slice(1, 3)))
            assert_close(part, weight[4:7, 1:3])
            assert part.is_contiguous() and source.bytes_read == 6 * 4
    assert local_index(weight) is None


def test_tied_parameter_is_loaded_once_from_either_key(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(4, 3)
            self.head = nn.Linear(3, 4, bias=False)
            self.head.weight = self.embed.weight

    weight = torch.randn(4, 3)
    torch.save({"head.weight": weight}, tmp_path / "w.pt")
    model = Tied()
    report = load_full_weights(model, tmp_path / "w.pt")
    assert model.head.weight is model.embed.weight
    assert_close(model.embed.weight, weight)
    assert (report["loaded"], report["bytes_read"]) == (1, weight.numel() * 4)


def _error(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """The error loading ``tensors`` into a ``_Net``: raised before any read, leaving the model untouched."""
    path = _save_safetensors(tensors, tmp_path / "bad.safetensors")
    model = _Net(seed=1)
    before = _weights(seed=1)
    targets = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    with (
        open_weights(path) as source,
        pytest.raises(InitWeightsError, match="does not fit the model") as info,
    ):
        match_keys(source, targets, [])
    assert source.bytes_read == 0
    with pytest.raises(InitWeightsError, match=re.escape(str(path))):
        load_full_weights(model, path)
    _assert_loaded(model, before)
    message = str(info.value)
    assert str(path) in message and "model's config" in message
    return message


def test_missing_keys_are_named(tmp_path):
    weights = _weights()
    del weights["b.weight"], weights["scale"]
    message = _error(tmp_path, weights)
    assert "2 model keys missing from the file, e.g. scale, b.weight" in message
    assert "keys as they are (no prefix)" in message


def test_unexpected_keys_are_named(tmp_path):
    message = _error(tmp_path, {**_weights(), "c.weight": torch.zeros(2)})
    assert "1 file keys not in the model, e.g. c.weight" in message


def test_shape_mismatch_is_named(tmp_path):
    message = _error(tmp_path, {**_weights(), "a.weight": torch.zeros(6, 8)})
    assert "a.weight: file shape (6, 8), model shape (7, 8)" in message


def test_missing_keys_under_a_prefix(tmp_path):
    weights = {f"module.{k}": v for k, v in _weights().items() if k != "a.bias"}
    message = _error(tmp_path, weights)
    assert "the file's keys without their leading 'module.'" in message
    assert "1 model keys missing from the file, e.g. a.bias" in message


def test_unsupported_paths(tmp_path):
    with pytest.raises(InitWeightsError, match="does not exist. Check the path"):
        open_weights(tmp_path / "nowhere.pt")
    (tmp_path / "notes.txt").write_text("hello")
    found = re.escape("(found: notes.txt). Accepted: a torch.save state-dict file")
    with pytest.raises(InitWeightsError, match=f"is a directory with neither.*{found}"):
        open_weights(tmp_path)
    with pytest.raises(InitWeightsError, match=re.escape(f"{str(tmp_path / 'notes.txt')!r} cannot be read")):
        open_weights(tmp_path / "notes.txt")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(InitWeightsError, match="holds a list, not a state dict"):
        open_weights(tmp_path / "list.pt")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "model-00001-of-00002.safetensors"}}'
    )
    with pytest.raises(InitWeightsError, match="shard files that are not in the directory: model-00001"):
        open_weights(hf)


def test_parameters_on_the_meta_device_are_refused(tmp_path):
    torch.save(_weights(), tmp_path / "model.pt")
    with torch.device("meta"):
        model = _Net(seed=1)
    with pytest.raises(InitWeightsError, match="scale is on the meta device"):
        load_full_weights(model, tmp_path / "model.pt")


def _sharded_load(path: str, w_path: str) -> dict[str, Any]:
    """On each of 2 ranks: FSDP2-shard a ``_Net`` (seeded by rank), load ``path``, gather what it holds;
    then load ``w_path`` (``w`` of shape (8, 2)) into DTensors whose local part is not the slice it should be."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    model = _Net(seed=10 + dist.get_rank())
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = load_full_weights(model, path)
    state = model.state_dict()
    local = [t.to_local() if isinstance(t, DTensor) else t for t in state.values()]
    errors = []
    for placements, local_rows in (([Partial()], 8), ([Shard(0)], 3)):  # not a slice; 3 rows, not 4
        tensor = DTensor.from_local(torch.zeros(local_rows, 2), mesh, placements, shape=(8, 2), stride=(2, 1))
        with pytest.raises(InitWeightsError) as info:
            load_full_weights(nn.ParameterDict({"w": nn.Parameter(tensor)}), w_path)
        errors.append(str(info.value))
    return {
        "report": report,
        "full": {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()},
        "local_bytes": _nbytes(local),
        "local_rows": {k: t.shape[0] for k, t in zip(state, local, strict=True)},
        "errors": errors,
    }


@pytest.mark.multirank
def test_two_ranks_read_only_their_shards(tmp_path):
    expected = _weights()
    path = _save_safetensors(expected, tmp_path / "net.safetensors")
    w_path = _save_safetensors({"w": torch.zeros(8, 2)}, tmp_path / "w8.safetensors")
    results = run_ranks(_sharded_load, str(path), str(w_path), world_size=2)
    for rank, result in enumerate(results):
        assert result["report"]["bytes_read"] == result["local_bytes"], f"rank {rank}"
        for key, value in expected.items():
            assert_close(result["full"][key], value, rtol=0, atol=0, msg=key)
        assert "Partial" in result["errors"][0]
        assert (
            "should hold the slice" in result["errors"][1]
            and "local tensor has shape (3, 2)" in result["errors"][1]
        )
    assert [r["local_rows"]["a.weight"] for r in results] == [4, 3]  # 7 rows: an uneven shard
    assert [r["local_rows"]["scale"] for r in results] == [1, 0]
    replicated = _nbytes([expected["step"]])
    assert sum(r["report"]["bytes_read"] for r in results) == _nbytes(expected.values()) + replicated


def test_the_init_weights_flag_is_checked_at_construction(tmp_path):
    from lightning_shard import ShardStrategy

    with pytest.raises(ValueError, match=r"init_weights='.*absent.safetensors'.*does not exist"):
        ShardStrategy(init_weights=str(tmp_path / "absent.safetensors"))
    (tmp_path / "notes.txt").write_text("not weights")
    with pytest.raises(ValueError, match="notes.txt"):
        ShardStrategy(init_weights=str(tmp_path / "notes.txt"))
