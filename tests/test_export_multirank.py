"""A Hugging Face GPT-2 trained under ``ShardStrategy(stage=3)`` on 2 ranks (and under Lightning's
``DDPStrategy``, ``ModelParallelStrategy``, and the DeepSpeed engine at ZeRO stages 1, 2 and 3) exports to a
directory that ``AutoModelForCausalLM.from_pretrained`` reads with logits identical to the trained model's; 2
ranks of a process group export the same bytes as one process. A DeepSpeed checkpoint's export streams as the
others do: the tensors equal DeepSpeed's ``zero_to_fp32``, bit for bit, and no worker holds more than one output
file's tensors at once."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import full_weights, trainer_kwargs

transformers = pytest.importorskip("transformers", reason="export needs pip install 'lightning-shard[hf]'")

pytestmark = pytest.mark.multirank

VOCAB = 96


def gpt2_config(**overrides: Any) -> dict[str, Any]:
    # HF defaults stay on (dropout, use_cache): the export must not depend on them.
    kwargs = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32)
    config = transformers.GPT2Config(**(kwargs | overrides))
    config.bos_token_id = config.eos_token_id = 0
    return config.to_dict()


class HFCausalLM(L.LightningModule):
    """A Hugging Face model held as ``self.model``, its config saved as a hyper-parameter dict."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.save_hyperparameters()
        kwargs = dict(config)
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
        )

    def configure_model(self) -> None:
        """FSDP2 by hand under Lightning's ModelParallelStrategy, as that strategy asks of its users."""
        from lightning.pytorch.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import FSDPModule, fully_shard

        trainer = self._trainer
        if trainer is None or not isinstance(trainer.strategy, ModelParallelStrategy):
            return
        if not isinstance(self.model, FSDPModule):
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class TwoGroupLM(HFCausalLM):
    """Two param groups (vectors without weight decay): each rank's ZeRO partitions are two flat vectors."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        vectors = [p for p in self.parameters() if p.ndim < 2]
        matrices = [p for p in self.parameters() if p.ndim >= 2]
        return torch.optim.AdamW([{"params": vectors, "weight_decay": 0.0}, {"params": matrices}], lr=1e-2)


#: Odd sizes (33 = 3 heads of 11): most parameters' numel is odd, so ZeRO-3 pads their last piece.
ODD = {"n_embd": 33, "n_head": 3}


def _loader() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (16, 16), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens), batch_size=2)


def _fit(
    root: str, name: str, strategy: Any, model: L.LightningModule | None = None
) -> dict[str, torch.Tensor] | None:
    trainer = L.Trainer(
        devices=2,
        strategy=strategy,
        callbacks=[ModelCheckpoint(dirpath=Path(root) / name, save_last=True)],
        **trainer_kwargs(max_steps=3, enable_checkpointing=True),
    )
    trainer.fit(model or HFCausalLM(gpt2_config()), _loader())
    if isinstance(strategy, ShardStrategy) and strategy.engine_name == "deepspeed":
        return None  # ZeRO-3 partitions are DeepSpeed's: its own zero_to_fp32 gives the reference
    return full_weights(trainer)  # the trained weights, gathered at the end of fit


def _job(root: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_shard.checkpoint import export_hf

    out: dict[str, Any] = {
        "stage3": _fit(root, "stage3", ShardStrategy(stage=3)),
        "ddp": _fit(root, "ddp", DDPStrategy()),
        "model_parallel": _fit(root, "model_parallel", ModelParallelStrategy(2, 1)),
    }
    # The export run by the 2 ranks of this process group, each writing its share of the files.
    report = export_hf(Path(root) / "stage3" / "last.ckpt", Path(root) / "grouped", max_shard_size="20KB")
    out["grouped"] = report
    return out


@contextlib.contextmanager
def counting_reads() -> Iterator[dict[str, int]]:
    """Through the DeepSpeed reader's two seams: the bytes it copies out of the checkpoint's files, and the most
    bytes of the tensors it handed out that are alive at once (whoever holds them)."""
    from lightning_shard.checkpoint import _zero_reader

    counted = {"copied": 0, "peak": 0}
    alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
    allocate, copy = _zero_reader._allocate, _zero_reader._copy

    def counting_allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = allocate(shape, dtype)
        alive.add(tensor)
        counted["peak"] = max(counted["peak"], sum(t.nbytes for t in alive))
        return tensor

    def counting_copy(out: torch.Tensor, source: torch.Tensor, start: int) -> None:
        counted["copied"] += out.nbytes
        copy(out, source, start)

    _zero_reader._allocate, _zero_reader._copy = counting_allocate, counting_copy
    try:
        yield counted
    finally:
        _zero_reader._allocate, _zero_reader._copy = allocate, copy


def _deepspeed_job(root: str) -> dict[str, Any]:
    from lightning_shard.checkpoint import export_hf

    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        name = f"deepspeed{stage}"
        _fit(root, name, ShardStrategy(stage=stage, engine="deepspeed"), TwoGroupLM(gpt2_config(**ODD)))
        # The 2 ranks of this process group are the export's workers, each writing its share of the files.
        with counting_reads() as counted:
            report = export_hf(
                Path(root) / name / "last.ckpt", Path(root) / f"{name}-grouped", max_shard_size="20KB"
            )
        out[name] = (report, counted)
    return out


def _reference(weights: dict[str, torch.Tensor], config: dict[str, Any] | None = None) -> Any:
    model = HFCausalLM(config or gpt2_config())
    model.load_state_dict(weights)
    return model.model.eval()


def _logits(model: Any) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits


def test_trained_checkpoints_export_to_identical_logits(tmp_path):

    out = run_ranks(_job, str(tmp_path))[0]
    grouped = out["grouped"]
    assert len(grouped.workers) == 2 and all(w.files for w in grouped.workers)
    for worker in grouped.workers:  # streaming: each rank read the tensors of its own files, no others
        own = {grouped.prefix + n for f in worker.files for n in grouped.files[f]}
        assert set(worker.keys_read) == own and worker.bytes_read == worker.bytes_assigned

    assert (tmp_path / "stage3" / "last.ckpt").is_dir() and (tmp_path / "ddp" / "last.ckpt").is_file()
    initial = HFCausalLM(gpt2_config()).state_dict()
    assert not torch.equal(
        out["stage3"]["model.transformer.wte.weight"], initial["model.transformer.wte.weight"]
    )
    for name in ("stage3", "ddp", "model_parallel"):
        _check_export(tmp_path, name, out[name])

    # The same bytes from 2 ranks of a process group as from this one process.
    one = sorted(p.name for p in (tmp_path / "stage3-hf").iterdir())
    assert one == sorted(p.name for p in (tmp_path / "grouped").iterdir())
    for file in one:
        assert (tmp_path / "stage3-hf" / file).read_bytes() == (tmp_path / "grouped" / file).read_bytes(), (
            file
        )


def _check_export(root: Path, name: str, trained_weights: dict[str, torch.Tensor] | None) -> None:
    from lightning_shard.checkpoint import export_hf, load_model_weights

    ckpt = root / name / "last.ckpt"
    saved = _reference(load_model_weights(ckpt))
    trained = saved if trained_weights is None else _reference(trained_weights)
    assert torch.equal(_logits(saved), _logits(trained))  # the save is exact
    report = export_hf(ckpt, root / f"{name}-hf", max_shard_size="20KB")
    assert len(report.files) > 2 and report.prefix == "model."
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / f"{name}-hf")
    assert torch.equal(_logits(exported), _logits(trained)), name


@pytest.mark.deepspeed
def test_deepspeed_checkpoints_export_streamed_equal_to_zero_to_fp32(tmp_path):
    from safetensors.torch import load_file

    from lightning_shard.checkpoint import export_hf, load_model_weights

    ranks = run_ranks(_deepspeed_job, str(tmp_path))
    config = gpt2_config(**ODD)
    for stage in (1, 2, 3):
        name = f"deepspeed{stage}"
        ckpt = tmp_path / name / "last.ckpt"
        assert (ckpt / "checkpoint").is_dir()
        reference = load_model_weights(ckpt)  # DeepSpeed's zero_to_fp32: the whole model at once
        with counting_reads() as counted:  # one process: every file
            report = export_hf(ckpt, tmp_path / f"{name}-hf", max_shard_size="20KB")
        largest = max(
            sum(t.nbytes for t in load_file(tmp_path / f"{name}-hf" / f).values()) for f in report.files
        )
        total = sum(t.nbytes for k, t in reference.items() if k != "model.lm_head.weight")
        assert (
            len(report.files) > 2 and report.prefix == "model." and report.dropped_tied == ["lm_head.weight"]
        )
        # Streaming: every byte copied once, and never more than one file's tensors alive at once.
        assert counted["copied"] == report.workers[0].bytes_read == total
        assert counted["peak"] == report.workers[0].max_bytes_held == largest < total / 2
        exported: dict[str, torch.Tensor] = {}
        for file in report.files:
            exported |= load_file(tmp_path / f"{name}-hf" / file)
        assert exported.keys() == {k.removeprefix("model.") for k in reference} - {"lm_head.weight"}
        for key, value in exported.items():  # bit for bit DeepSpeed's own reconstruction
            assert value.dtype == reference["model." + key].dtype and torch.equal(
                value, reference["model." + key]
            ), key
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-hf")
        assert torch.equal(_logits(loaded), _logits(_reference(reference, config))), name

        # 2 ranks of a process group: the files split between them, each streamed, the same bytes as one process.
        grouped = ranks[0][name][0]
        assert len(grouped.workers) == 2 and all(w.files for w in grouped.workers)
        for rank, worker in enumerate(grouped.workers):
            own = {grouped.prefix + n for f in worker.files for n in grouped.files[f]}
            assert set(worker.keys_read) == own and worker.bytes_read == worker.bytes_assigned
            held = ranks[rank][name][1]
            assert held["copied"] == worker.bytes_read and held["peak"] == worker.max_bytes_held <= largest
        for file in [*report.files, "config.json"]:
            assert (tmp_path / f"{name}-grouped" / file).read_bytes() == (
                tmp_path / f"{name}-hf" / file
            ).read_bytes()
    _check_damaged_partitions(tmp_path)


def _check_damaged_partitions(root: Path) -> None:
    """Partitions that do not add up (a rank file missing, a flat vector cut short) stop the export, named."""
    import shutil

    from lightning_shard.checkpoint import export_hf

    damages = {  # checkpoint -> its rank-1 optimizer file removed, or its rank-0 one cut short; the message
        "deepspeed2": ("missing", r"partitioned over 2 ranks but 1 \*_optim_states.pt files are there"),
        "deepspeed1": ("short", r"param group 1's parameters need \d+ elements but its ZeRO partitions hold"),
        "deepspeed3": ("short", r"its parameters need \d+ elements per rank but rank 0's partitions hold"),
    }
    for name, (damage, message) in damages.items():
        copy = root / f"{name}-damaged"
        shutil.copytree(root / name / "last.ckpt", copy)
        (file,) = (copy / "checkpoint").glob("zero_pp_rank_0_*optim_states.pt")
        if damage == "missing":
            next((copy / "checkpoint").glob("zero_pp_rank_1_*optim_states.pt")).unlink()
        else:
            saved = torch.load(file, weights_only=False)
            flat = saved["optimizer_state_dict"]
            key = "fp32_flat_groups" if name == "deepspeed3" else "single_partition_of_fp32_groups"
            flat[key][1] = flat[key][1][:-64].clone()
            torch.save(saved, file)
        with pytest.raises(
            ValueError, match=rf"{name}-damaged.*\(export\(checkpoint\) / CLI CHECKPOINT\).*{message}"
        ):
            export_hf(copy, root / f"{name}-damaged-hf")


def _grouped_failure_job(checkpoint: str, out: str) -> str:
    import torch.distributed as dist

    from lightning_shard.checkpoint import export_hf

    dist.init_process_group("gloo")
    try:
        export_hf(checkpoint, out)
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_failure_on_rank0_stops_every_rank_with_its_message(tmp_path):
    from lightning_shard.checkpoint import export_hf

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    )
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, tmp_path / "x.ckpt")
    rank0, rank1 = run_ranks(_grouped_failure_job, str(tmp_path / "x.ckpt"), str(tmp_path / "hf"))
    assert rank0.startswith("ValueError: No Hugging Face config found") and "--config" in rank0
    assert rank1.startswith(
        "RuntimeError: export_hf failed on rank 0, so every rank stops: ValueError: No Hugging"
    )
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match=r"workers=0 must be at least 1 \(CLI --ranks N\)"):
        export_hf(tmp_path / "x.ckpt", tmp_path / "hf", workers=0)
