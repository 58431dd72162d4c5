"""A Hugging Face GPT-2 trained under ``ShardStrategy(stage=3)`` on 2 ranks (and under Lightning's
``DDPStrategy``, ``ModelParallelStrategy``, and the DeepSpeed engine) exports to a directory that ``AutoModelForCausalLM.from_pretrained`` reads with logits
identical to the trained model's; 2 ranks of a process group export the same bytes as one process."""

from __future__ import annotations

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


def gpt2_config() -> dict[str, Any]:
    # HF defaults stay on (dropout, use_cache): the export must not depend on them.
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32)
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


def _loader() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (16, 16), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens), batch_size=2)


def _fit(root: str, name: str, strategy: Any) -> dict[str, torch.Tensor] | None:
    trainer = L.Trainer(
        devices=2,
        strategy=strategy,
        callbacks=[ModelCheckpoint(dirpath=Path(root) / name, save_last=True)],
        **trainer_kwargs(max_steps=3, enable_checkpointing=True),
    )
    trainer.fit(HFCausalLM(gpt2_config()), _loader())
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


def _deepspeed_job(root: str) -> None:
    _fit(root, "deepspeed", ShardStrategy(stage=3, engine="deepspeed"))


def _reference(weights: dict[str, torch.Tensor]) -> Any:
    model = HFCausalLM(gpt2_config())
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
def test_deepspeed_checkpoint_exports_to_identical_logits(tmp_path):
    run_ranks(_deepspeed_job, str(tmp_path))
    assert (tmp_path / "deepspeed" / "last.ckpt" / "checkpoint").is_dir()
    _check_export(tmp_path, "deepspeed", None)


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
