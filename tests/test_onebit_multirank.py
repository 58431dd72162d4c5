"""1-bit Adam (``lightning_shard.onebit``) on real gloo ranks against the algorithm written out here in one
process that plays every rank: the same rows per rank, exact Adam / AdamW on the mean gradient through
``freeze_step``, then per rank its own momentum, signs and scales per chunk with worker and server error
feedback, and the frozen variance. Weights equal through and after the freeze, on 2 and 3 ranks (3: chunks
of unequal real length, the padding), with Adam's L2 and AdamW's decoupled weight decay; the error feedback
resumes exactly; bytes on the wire about 1/32 of an fp32 all-reduce's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_shard.demos.ranks import run_ranks
from lightning_shard.onebit import OneBitAdam, check_optimizer, pack_signs, unpack_signs

pytestmark = pytest.mark.multirank

STEPS, FREEZE = 7, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)
    )  # 227 parameters: not a multiple of 8


def _rows(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 10, generator=g), torch.randn(6, 3, generator=g)


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    return torch.optim.Adam(params, lr=0.05, weight_decay=0.1)


def _grads(model: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    model.zero_grad()
    x, y = _rows(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _train_rank(kind: str, steps: int, resume_at: int | None) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    optimizer = _optimizer(kind, model.parameters())
    onebit = OneBitAdam(optimizer, FREEZE)
    frozen_at = []
    for step in range(steps):
        if resume_at is not None and step == resume_at:  # a new optimizer from the saved states
            saved = (optimizer.state_dict(), onebit.state_dict())
            optimizer = _optimizer(kind, model.parameters())
            optimizer.load_state_dict(saved[0])
            onebit = OneBitAdam(optimizer, FREEZE)
            onebit.load_state_dict(saved[1])
        _grads(model, rank, step)
        if onebit.frozen():
            frozen_at.append(step)
            onebit.step()
        else:  # the warm-up: the gradients all-reduced, the user's optimizer as it is
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "frozen_at": frozen_at,
        "bytes": onebit.allreduce.bytes_sent,
    }


def _compress_reference(rows: torch.Tensor, real: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row as sign x (norm / sqrt(real entries)), and what that lost; padding stays zero."""
    out, lost = torch.zeros_like(rows), torch.zeros_like(rows)
    for j, n in enumerate(real):
        x = rows[j, :n]
        scale = x.norm() / math.sqrt(max(n, 1))
        c = torch.where(x >= 0, scale, -scale)
        out[j, :n], lost[j, :n] = c, x - c
    return out, lost


def _reference(kind: str, world: int, steps: int) -> dict[str, torch.Tensor]:
    """The algorithm in one process: one model, each rank's gradients computed on its rows."""
    model = _model()
    optimizer = _optimizer(kind, model.parameters())
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    chunk = 8 * math.ceil(numel / (8 * world))
    real = [max(0, min(chunk, numel - j * chunk)) for j in range(world)]
    worker_error = [torch.zeros(world, chunk) for _ in range(world)]
    server_error = [torch.zeros(chunk) for _ in range(world)]
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    for step in range(steps):
        grads = [_grads(model, rank, step) for rank in range(world)]
        if step < FREEZE:
            for i, p in enumerate(params):
                p.grad = torch.stack([g[i] for g in grads]).mean(0)
            optimizer.step()
            continue
        state = [optimizer.state[p] for p in params]
        compressed = []
        for rank in range(world):
            momentum = []
            for i, p in enumerate(params):
                g = grads[rank][i] if kind == "adamw" else grads[rank][i] + wd * p.detach()
                momentum.append((beta1 * state[i]["exp_avg"] + (1 - beta1) * g).reshape(-1))
            flat = torch.zeros(world * chunk)
            flat[:numel] = torch.cat(momentum)
            sent, worker_error[rank] = _compress_reference(
                flat.reshape(world, chunk) + worker_error[rank], real
            )
            compressed.append(sent)
        served = []
        for j in range(world):
            mean = torch.stack([compressed[rank][j] for rank in range(world)]).mean(0) + server_error[j]
            c, lost = _compress_reference(mean[None], [real[j]])
            server_error[j] = lost[0]
            served.append(c[0])
        averaged = torch.cat(served)[:numel]
        offset = 0
        with torch.no_grad():
            for i, p in enumerate(params):
                m = averaged[offset : offset + p.numel()].reshape(p.shape)
                offset += p.numel()
                state[i]["exp_avg"].copy_(m)
                state[i]["step"] += 1
                if kind == "adamw":
                    p.mul_(1 - lr * wd)
                v_hat = state[i]["exp_avg_sq"] / (1 - beta2**FREEZE)
                p.sub_(lr / (1 - beta1 ** float(state[i]["step"])) * m / (v_hat.sqrt() + eps))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("kind", "world"), [("adamw", 2), ("adam", 3)])
def test_onebit_adam_follows_the_algorithm_through_and_after_the_freeze(kind, world):
    results = run_ranks(_train_rank, kind, STEPS, None, world_size=world)
    expected = _reference(kind, world, STEPS)
    warmup = _reference(
        kind, world, FREEZE
    )  # the weights at the freeze: the test must see them move after it
    for rank, result in enumerate(results):
        assert result["frozen_at"] == list(range(FREEZE, STEPS)), result["frozen_at"]
        for key, weight in expected.items():
            torch.testing.assert_close(
                result["weights"][key], weight, rtol=1e-5, atol=1e-6, msg=f"{rank} {key}"
            )
            assert not torch.allclose(weight, warmup[key])
    # every rank holds the same weights (the averaged momentum is the same everywhere)
    for key in expected:
        assert all(torch.equal(r["weights"][key], results[0]["weights"][key]) for r in results)


def test_onebit_adam_resumes_its_error_feedback_exactly():
    uninterrupted = run_ranks(_train_rank, "adamw", STEPS, None, world_size=2)
    resumed = run_ranks(_train_rank, "adamw", STEPS, FREEZE + 2, world_size=2)
    for a, b in zip(uninterrupted, resumed, strict=True):
        for key, weight in a["weights"].items():
            assert torch.equal(b["weights"][key], weight), key


def _bytes(numel: int) -> tuple[int, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    param = nn.Parameter(torch.zeros(numel))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    onebit = OneBitAdam(optimizer, 1)
    param.grad = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    optimizer.step()  # the warm-up step
    param.grad = torch.randn(numel)
    onebit.step()
    return onebit.allreduce.bytes_sent, dist.get_world_size()


def test_the_momentum_crosses_the_wire_in_about_a_32nd_of_an_fp32_allreduces_bytes():
    numel = 1_000_003
    for sent, world in run_ranks(_bytes, numel, world_size=2):
        fp32_allreduce = 2 * (world - 1) / world * 4 * numel  # a ring all-reduce's bytes sent per rank
        assert 1 / 33 < sent / fp32_allreduce < 1 / 31, sent / fp32_allreduce


def test_signs_pack_eight_to_a_byte_and_back():
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1e-9, 5.0, -5.0] * 3)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 3
    assert packed[0].item() == 0b10111010  # x >= 0 sets the bit, first entry the most significant
    torch.testing.assert_close(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))


def test_what_onebit_adam_cannot_take_over_is_refused_with_the_fix():
    params = [nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match=r"returned SGD\. Return torch\.optim\.Adam or torch\.optim\.AdamW"):
        check_optimizer(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match=r"amsgrad=True .* Set amsgrad=False"):
        check_optimizer(torch.optim.Adam(params, amsgrad=True))


# --- through the strategy: ShardStrategy(stage=0, gradient_compression="onebit_adam") ---------------------


def _dataset(world: int, steps: int) -> torch.utils.data.TensorDataset:
    """Rows laid out so that the sampler the Trainer injects (torch's ``DistributedSampler``, shuffled, seed 0)
    hands rank r at step k the rows :func:`_rows` gives it."""
    n = world * 6 * steps
    xs, ys = torch.zeros(n, 10), torch.zeros(n, 3)
    for rank in range(world):
        order = list(torch.utils.data.DistributedSampler(range(n), world, rank, shuffle=True, seed=0))
        for step in range(steps):
            x, y = _rows(rank, step)
            xs[order[6 * step : 6 * step + 6]], ys[order[6 * step : 6 * step + 6]] = x, y
    return torch.utils.data.TensorDataset(xs, ys)


def _fit_onebit(kind: str, root: str, resume: str | None) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_shard import ShardStrategy
    from tests.helpers import trainer_kwargs

    class Rows(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return _optimizer(kind, self.parameters())

    strategy = ShardStrategy(stage=0, gradient_compression={"method": "onebit_adam", "freeze_step": FREEZE})
    checkpoint = ModelCheckpoint(dirpath=root, every_n_train_steps=FREEZE + 2, save_top_k=-1)
    trainer = L.Trainer(
        devices=2,
        strategy=strategy,
        callbacks=[checkpoint],
        **trainer_kwargs(max_steps=STEPS, enable_checkpointing=True, use_distributed_sampler=True),
    )
    loader = torch.utils.data.DataLoader(_dataset(2, STEPS), batch_size=6, shuffle=False)
    module = Rows()
    trainer.fit(module, loader, ckpt_path=resume)
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def test_the_strategy_flag_trains_as_the_algorithm_and_resumes_its_error_feedback(tmp_path):
    root = str(tmp_path)
    full = run_ranks(_fit_onebit, "adamw", root, None, world_size=2)
    expected = _reference("adamw", 2, STEPS)
    for rank, weights in enumerate(full):
        for key, weight in expected.items():
            torch.testing.assert_close(weights[key], weight, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}")
    resumed = run_ranks(
        _fit_onebit, "adamw", str(tmp_path / "again"), f"{root}/epoch=0-step={FREEZE + 2}.ckpt", world_size=2
    )
    for weights, again in zip(full, resumed, strict=True):
        for key, weight in weights.items():
            assert torch.equal(again[key], weight), key
