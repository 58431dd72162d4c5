"""``export_hf`` / ``lightning-shard export`` in one process: a one-file checkpoint to a Hugging Face directory
that ``from_pretrained`` reads with identical logits, streamed file by file, and the errors that name the fix."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="export needs pip install 'lightning-shard[hf]'")

from lightning_shard.checkpoint import export_hf  # noqa: E402
from lightning_shard.cli import main  # noqa: E402

SMALL = "20KB"  # the tiny GPT-2 below is ~120 KB: several files and an index


def gpt2_config(**overrides: Any) -> Any:
    kwargs = dict(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2Config(**(kwargs | overrides))


def logits(model: Any, seed: int = 3) -> torch.Tensor:
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits


def lightning_file(tmp_path: Path, config: Any, hparams: bool = True, wrapper: str = "") -> tuple[Path, Any]:
    """A Lightning-format one-file checkpoint of a GPT-2 held as ``self.model`` (keys ``model.<hf key>``)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    state = {f"model.{wrapper}{k}": v for k, v in model.state_dict().items()}
    checkpoint = {"state_dict": state, "pytorch-lightning_version": "2.6.0", "optimizer_states": []}
    if hparams:
        checkpoint["hyper_parameters"] = {"config": config.to_dict(), "lr": 0.1}
    path = tmp_path / "last.ckpt"
    torch.save(checkpoint, path)
    return path, model


def test_one_file_round_trip_sharded_output_gives_identical_logits(tmp_path):
    path, model = lightning_file(tmp_path, gpt2_config())
    report = export_hf(path, tmp_path / "hf", max_shard_size=SMALL)
    assert report.prefix == "model." and report.dropped_tied == ["lm_head.weight"]
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) == len(report.files) > 2 and "model.safetensors.index.json" in names
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards) and "lm_head.weight" not in index["weight_map"]
    assert index["metadata"]["total_size"] == report.total_bytes
    assert not (tmp_path / "hf.tmp").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again on load
    assert torch.equal(logits(loaded), logits(model))


def test_each_worker_reads_only_its_own_files_tensors(tmp_path):
    path, _ = lightning_file(tmp_path, gpt2_config())
    report = export_hf(path, tmp_path / "hf", max_shard_size=SMALL)
    (worker,) = report.workers
    saved = torch.load(path, weights_only=True)["state_dict"]
    file_bytes = [sum(saved["model." + n].nbytes for n in names) for names in report.files.values()]
    assert sorted(worker.keys_read) == sorted("model." + n for names in report.files.values() for n in names)
    assert worker.bytes_read == worker.bytes_assigned == sum(file_bytes)
    # Streaming: never more than one output file's tensors held at once, far less than the model.
    assert worker.max_bytes_held == max(file_bytes) < sum(file_bytes) / 2


def test_cli_two_workers_write_the_same_bytes_as_one(tmp_path, capsys):
    path, _ = lightning_file(tmp_path, gpt2_config())
    assert main(["export", str(path), str(tmp_path / "one"), "--max-shard-size", SMALL]) == 0
    assert main(["export", str(path), str(tmp_path / "two"), "--max-shard-size", SMALL, "--ranks", "2"]) == 0
    assert "wrote" in capsys.readouterr().out
    one = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert one == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in one:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_two_spawned_workers_split_the_files_and_read_only_theirs(tmp_path):
    path, _ = lightning_file(tmp_path, gpt2_config())
    report = export_hf(path, tmp_path / "hf", max_shard_size=SMALL, workers=2)
    assert len(report.workers) == 2 and all(w.files for w in report.workers)
    assert sorted(f for w in report.workers for f in w.files) == sorted(report.files)
    for worker in report.workers:
        own = {"model." + n for f in worker.files for n in report.files[f]}
        assert set(worker.keys_read) == own and worker.bytes_read == worker.bytes_assigned


def test_config_dtype_cast_and_wrapper_names(tmp_path):
    config = gpt2_config()
    path, model = lightning_file(tmp_path, config, hparams=False, wrapper="_orig_mod.")
    config.save_pretrained(tmp_path / "cfg")
    export_hf(path, tmp_path / "hf", config=tmp_path / "cfg" / "config.json", dtype="bf16")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert torch.equal(
        loaded.transformer.h[0].mlp.c_fc.weight, model.transformer.h[0].mlp.c_fc.weight.bfloat16()
    )


def test_missing_config_names_the_flag(tmp_path):
    path, _ = lightning_file(tmp_path, gpt2_config(), hparams=False)
    with pytest.raises(ValueError, match=r"No Hugging Face config found .* \(CLI --config PATH\)"):
        export_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_wrong_prefix_names_the_keys_and_the_fix(tmp_path):
    path, _ = lightning_file(tmp_path, gpt2_config())
    with pytest.raises(ValueError, match=r"prefix='net\.'.*missing keys transformer\.h\.0.*--prefix"):
        export_hf(path, tmp_path / "hf", prefix="net")
    with pytest.raises(ValueError, match=r"unexpected keys model\.lm_head\.weight.*--prefix"):
        export_hf(path, tmp_path / "hf", prefix="")


def test_other_model_config_is_refused_with_the_keys(tmp_path):
    path, _ = lightning_file(tmp_path, gpt2_config())
    llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=96)
    with pytest.raises(
        ValueError, match=r"do not fit LlamaForCausalLM: unexpected keys transformer\.h.*--config"
    ):
        export_hf(path, tmp_path / "hf", config=llama)
    bert = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    with pytest.raises(
        ValueError, match=r"No checkpoint key matches a key of BertModel under any prefix.*--prefix"
    ):
        export_hf(path, tmp_path / "hf", config=bert, architecture="AutoModel")


def test_bad_arguments_name_the_flag(tmp_path, capsys):
    path, _ = lightning_file(tmp_path, gpt2_config())
    with pytest.raises(ValueError, match=r"max_shard_size='5 parsecs' has an unknown unit 'parsecs'"):
        export_hf(path, tmp_path / "hf", max_shard_size="5 parsecs")
    with pytest.raises(ValueError, match=r"dtype='int4' is unknown.*--dtype"):
        export_hf(path, tmp_path / "hf", dtype="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"architecture='GPT9' is not a class"):
        export_hf(path, tmp_path / "hf", architecture="GPT9")
    with pytest.raises(FileNotFoundError, match=r"config='.*nowhere' does not exist.*--config"):
        export_hf(path, tmp_path / "hf", config=tmp_path / "nowhere")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match=r"--overwrite"):
        export_hf(path, tmp_path / "taken")
    assert main(["export", str(path), str(tmp_path / "hf"), "--max-shard-size", "5 parsecs"]) == 2
    assert "unknown unit" in capsys.readouterr().err


def sharded_dir(tmp_path: Path, file: Path) -> Path:
    """The same weights and entries as a DCP directory in our layout (shards + ``.metadata`` + ``meta.pt``)."""
    import torch.distributed.checkpoint as dcp

    checkpoint = torch.load(file, weights_only=False)
    path = tmp_path / "sharded.ckpt"
    dcp.save({"state_dict": checkpoint.pop("state_dict")}, checkpoint_id=str(path), no_dist=True)
    torch.save(checkpoint, path / "meta.pt")
    return path


def test_refused_hyper_parameters_name_config_and_trusted(tmp_path, capsys):
    config = gpt2_config()
    path, model = lightning_file(tmp_path, config)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["hyper_parameters"]["every"] = timedelta(hours=1)  # a class weights_only loading refuses
    torch.save(checkpoint, path)
    # One file is one pickle: the weights cannot be read without the opt-in either.
    assert main(["export", str(path), str(tmp_path / "hf")]) == 2
    assert "Add --trusted" in capsys.readouterr().err and not (tmp_path / "hf").exists()
    sharded = sharded_dir(tmp_path, path)
    with pytest.raises(
        ValueError, match=r"Could not read the hyper-parameters.*\(CLI --config\).*\(CLI --trusted\)"
    ):
        export_hf(sharded, tmp_path / "hf")
    for source, kwargs in ((sharded, {"config": config}), (path, {"weights_only": False})):
        out = tmp_path / f"hf-{source.name}"
        assert export_hf(source, out, max_shard_size=SMALL, **kwargs).prefix == "model."
        assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(out)), logits(model))


def test_the_commands_docs_export_shows_run(tmp_path, monkeypatch):
    import re
    import shlex

    doc = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", doc, re.S)[0].strip().splitlines()
    (python,) = re.findall(r"```python\n(.*?)```", doc, re.S)[:1]
    (tmp_path / "checkpoints").mkdir()
    _, model = lightning_file(tmp_path / "checkpoints", gpt2_config())
    monkeypatch.chdir(tmp_path)
    for command in commands:
        assert command.startswith("lightning-shard export ")
        assert main(shlex.split(command)[1:]) == 0, command
    namespace: dict[str, Any] = {}
    exec(python, namespace)
    assert torch.equal(logits(namespace["model"]), logits(model))
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained("hf-model")), logits(model))


def test_without_transformers_the_error_names_the_extra(tmp_path, monkeypatch):
    import sys

    path, _ = lightning_file(tmp_path, gpt2_config())
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when absent
    with pytest.raises(ImportError, match=r"pip install 'lightning-shard\[hf\]'"):
        export_hf(path, tmp_path / "hf")
