"""Lightning's own readers on every checkpoint the pack writes, trained on 2 ranks, read in one process.

One 2-rank job per engine trains the demo GPT (``save_hyperparameters``) at stages 1 and 3 with every
checkpoint kind the engine writes (FSDP: sharded directory and ``checkpoint="full"`` file; DeepSpeed:
its directory), and runs ``trainer.test(ckpt_path="best")`` where the best checkpoint is not the last.
The parent, with no process group, then calls ``Model.load_from_checkpoint`` on each checkpoint and on
``lightning-shard consolidate``'s outputs, and compares weights (exactly) and hyperparameters with
what the ranks trained.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import ShardStrategy
from lightning_shard.checkpoint.init_weights import open_weights
from lightning_shard.cli import main as cli_main
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import ENGINES, loader, token_dataset, trainer_kwargs

pytestmark = pytest.mark.multirank

HPARAMS = dict(
    vocab_size=64,
    seq_len=16,
    d_model=32,
    n_layers=2,
    n_heads=2,
    dropout=0.0,
    lr=1e-2,
    weight_decay=0.05,
    max_steps=50,
    tie_embeddings=True,
    n_experts=0,
    top_k=2,
    aux_loss_coef=0.01,
)
BEST_STEP = 2  # the checkpoint ModelCheckpoint(monitor="pick", mode="max") keeps: not the last one


class Model(GPTModule):
    """The demo GPT with a monitored value that peaks at one step, and a test loss."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("pick", float(self.global_step == BEST_STEP - 1))
        return super().training_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", _loss(self, batch), sync_dist=True)


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


class _FinalWeights(L.Callback):
    """The full trained weights, gathered at the end of fit (while the run's process groups exist)."""

    weights: dict[str, torch.Tensor]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy: Any = trainer.strategy
        if strategy.engine_name == "deepspeed":
            import deepspeed

            partitioned = [p for p in pl_module.parameters() if hasattr(p, "ds_tensor")]
            with deepspeed.zero.GatheredParameters(partitioned):
                self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        state = get_model_state_dict(strategy.model, options=options)
        self.weights = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.items()
        }


def _train(engine: str, stage: int, mode: str, root: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Model(**HPARAMS)
    final = _FinalWeights()
    checkpoints = ModelCheckpoint(
        dirpath=root, monitor="pick", mode="max", save_top_k=1, every_n_train_steps=1, save_last=True
    )
    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(stage=stage, engine=engine, checkpoint=mode),
        callbacks=[checkpoints, final],
        **trainer_kwargs(max_steps=4, enable_checkpointing=True),
    )
    trainer.fit(model, loader(4, n=32))
    (tested,) = trainer.test(model, loader(4, n=32), ckpt_path="best")
    return {
        "weights": final.weights,
        "hparams": dict(model.hparams),
        "best": checkpoints.best_model_path,
        "last": checkpoints.last_model_path,
        "test_loss_best": tested["test_loss"],
    }


def _train_all(engine: str, root: str) -> dict[str, dict[str, Any]]:
    modes = ("sharded", "full") if engine == "fsdp" else ("sharded",)
    runs = {}
    for stage in (1, 3):
        for mode in modes:
            runs[f"stage{stage}-{mode}"] = _train(engine, stage, mode, Path(root) / f"stage{stage}-{mode}")
    return runs if os.environ["RANK"] == "0" else {}


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=0, atol=0, msg=f"{what}: {key}")


def _test_loss(model: torch.nn.Module) -> float:
    data = token_dataset(32)  # what the 2 ranks tested on, in one batch: the mean of equal-sized batch means
    with torch.no_grad():
        return _loss(model.eval(), (data.tensors[0], data.tensors[1])).item()


@pytest.mark.parametrize("engine", ENGINES)
def test_load_from_checkpoint_and_test_best(tmp_path, engine):
    runs = run_ranks(_train_all, engine, str(tmp_path))[0]
    assert len(runs) == (4 if engine == "fsdp" else 2)
    for name, run in runs.items():
        last, best = Path(run["last"]), Path(run["best"])
        assert run["hparams"] == HPARAMS, name
        assert best.name == f"epoch=0-step={BEST_STEP}.ckpt" and last.name == "last.ckpt", name
        assert last.is_file() if name.endswith("full") else last.is_dir(), name

        # The checkpoint itself, then consolidate's Lightning file of it.
        for path in (last, _consolidate(last, tmp_path / f"{engine}-{name}.ckpt")):
            loaded = Model.load_from_checkpoint(path)
            assert dict(loaded.hparams) == HPARAMS, f"{name} {path}"
            _assert_equal(loaded.state_dict(), run["weights"], f"{name}: load_from_checkpoint({path.name})")

        # trainer.test(ckpt_path="best") tested the best checkpoint's weights, not the trained ones.
        best_model = Model.load_from_checkpoint(best)
        assert any(not torch.equal(best_model.state_dict()[k], v) for k, v in run["weights"].items()), name
        trained = Model(**HPARAMS)
        trained.load_state_dict(run["weights"])
        assert abs(_test_loss(trained) - _test_loss(best_model)) > 1e-4, name  # the comparison below can tell
        assert run["test_loss_best"] == pytest.approx(_test_loss(best_model), rel=1e-5), name

    # --weights-only: the plain state dict; a Lightning file from consolidate is accepted by init_weights.
    run = next(iter(runs.values()))
    plain = tmp_path / "plain.pt"
    assert cli_main(["consolidate", run["last"], str(plain), "--weights-only"]) == 0
    _assert_equal(torch.load(plain, weights_only=True), run["weights"], "--weights-only")
    with open_weights(tmp_path / f"{engine}-{next(iter(runs))}.ckpt") as source:
        _assert_equal({k: source.read(k) for k in source.keys()}, run["weights"], "init_weights source")


def _consolidate(checkpoint: Path, out: Path) -> Path:
    assert cli_main(["consolidate", str(checkpoint), str(out)]) == 0
    content = torch.load(out, weights_only=True)
    assert {"pytorch-lightning_version", "state_dict", "hyper_parameters"} <= content.keys()
    assert not {"optimizer_states", "lr_schedulers", "callbacks"} & content.keys()  # weights, not a resume
    return out
