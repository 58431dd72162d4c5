"""Shared pieces for tests: a tiny GPT, fixed data, a loss recorder, and a fit runner."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard.demos import GPTModule

VOCAB, SEQ = 64, 16
#: Both engines, for ``pytest.mark.parametrize("engine", ENGINES)``; the conftest skips the DeepSpeed one
#: (marked ``deepspeed``) where DeepSpeed is not installed.
ENGINES = ["fsdp", pytest.param("deepspeed", marks=pytest.mark.deepspeed)]


def tiny_gpt(**overrides: Any) -> GPTModule:
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layers=2, n_heads=2, lr=1e-2, max_steps=50
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    return GPTModule(**kwargs)


def token_dataset(n: int = 64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def loader(batch_size: int, n: int = 64, tensor_parallel_size: int = 1) -> DataLoader:
    """In order, split across ranks like a DistributedSampler without shuffling (pair with
    ``use_distributed_sampler=False``), so 2 ranks x batch b see what one process sees with 2b. The
    ranks of one tensor-parallel group read the same batches."""
    dataset = token_dataset(n)
    world = _world()
    if world is not None:
        from torch.utils.data import DistributedSampler

        rank, size = world[0] // tensor_parallel_size, world[1] // tensor_parallel_size
        sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=False)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def _world() -> tuple[int, int] | None:
    """(rank, world size) of a run on several processes, before or after its process group exists."""
    import os

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    # Before the first Trainer call there is no process group yet, and after one Lightning's environment
    # has removed WORLD_SIZE; the launcher's LOCAL_WORLD_SIZE stays (one node).
    world = os.environ.get("WORLD_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
    if world is not None:
        return int(os.environ["RANK"]), int(world)
    return None


class MemoryLogger(L.pytorch.loggers.Logger):
    """Every row Lightning logs, on every rank: ``rows`` as ``(step, metrics)``, ``metrics`` the dicts alone."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def metrics(self) -> list[dict[str, float]]:
        return [row for _, row in self.rows]

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


class LossRecorder(L.Callback):
    """Records the step loss averaged over ranks (the quantity a single-process run sees)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"].detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(loss.item())


def full_weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The unsharded model weights (on every rank), whatever the strategy."""
    return full_model_weights(trainer.strategy.model, trainer.lightning_module)


def full_model_weights(
    model: torch.nn.Module, module: torch.nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The unsharded weights of a set-up ``model`` (sharded or wrapped; ``module``: the user's, one process)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if dist.is_initialized():
        sd = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        )
        return {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
            for k, v in sd.items()
        }
    return {k: v.detach().float().clone() for k, v in (module or model).state_dict().items()}


def shard_stages_then_ddp(engine: str, stages: tuple[int, ...]) -> dict[str, Any]:
    """Strategy factories for a side-by-side job: ``ShardStrategy`` at each stage, then Lightning's
    ``DDPStrategy`` last. ShardStrategy first: it makes the default group, as in a script that uses only it."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_shard import ShardStrategy

    strategies: dict[str, Any] = {
        f"stage{stage}": lambda stage=stage: ShardStrategy(stage=stage, engine=engine) for stage in stages
    }
    strategies["ddp"] = lambda: DDPStrategy()
    return strategies


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=5,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    kwargs.update(overrides)
    return kwargs


def make_engine(name: str, stage: int, precision: Any = None, **flags: Any) -> Any:
    """An engine of one process on the CPU, built as ShardStrategy builds it (no process group)."""
    from lightning_shard import ShardPrecision
    from lightning_shard.config import ShardConfig
    from lightning_shard.engines import RunContext, engine_class

    cls = engine_class(name)
    precision = cls.precision_class.from_plugin(precision or ShardPrecision())
    run = RunContext(torch.device("cpu"), None, 0, 1, "gloo", lambda: None)
    return cls(ShardConfig(stage=stage, engine=name, **flags), precision, run)


def tiny_llama_config(vocab_size: int = VOCAB, **overrides: Any) -> Any:
    """A Hugging Face Llama small enough for CPU tests (tied input / output embedding)."""
    import transformers

    return tiny_config(transformers.LlamaConfig, vocab_size, **overrides)


def tiny_qwen2_config(vocab_size: int = VOCAB, **overrides: Any) -> Any:
    """A Hugging Face Qwen2 of the tiny Llama's sizes: its own defaults otherwise (q/k/v biases, dropout, cache)."""
    import transformers

    return tiny_config(transformers.Qwen2Config, vocab_size, **overrides)


def tiny_config(config_class: Any, vocab_size: int = VOCAB, **overrides: Any) -> Any:
    """``config_class`` (a Hugging Face decoder's config) at sizes small enough for CPU tests, tied embeddings."""
    kwargs: dict[str, Any] = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
    )
    return config_class(**(kwargs | overrides))


#: The Hugging Face mixture-of-experts families expert parallelism splits through their own plan.
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen3_moe_norm_topk", "olmoe", "gpt_oss", "deepseek_v3")


def tiny_moe(family: str, experts: int = 4, top_k: int = 2, vocab_size: int = VOCAB) -> Any:
    """A tiny Hugging Face mixture-of-experts causal LM of ``family`` (``MOE_FAMILIES``), built from its config
    class with tiny sizes and its defaults otherwise (no download), fp32, the router's aux loss on."""
    import transformers as t

    common: dict[str, Any] = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        num_experts_per_tok=top_k,
    )
    aux: dict[str, Any] = dict(output_router_logits=True, router_aux_loss_coef=0.05)
    qwen3: dict[str, Any] = dict(
        intermediate_size=64, moe_intermediate_size=64, num_experts=experts, **aux, **common
    )
    built: dict[str, Any] = {
        "mixtral": lambda: t.MixtralForCausalLM(
            t.MixtralConfig(intermediate_size=64, num_local_experts=experts, **aux, **common)
        ),
        "qwen3_moe": lambda: t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**qwen3)),  # norm_topk_prob=False
        "qwen3_moe_norm_topk": lambda: t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(norm_topk_prob=True, **qwen3)),
        "olmoe": lambda: t.OlmoeForCausalLM(
            t.OlmoeConfig(intermediate_size=64, num_experts=experts, **aux, **common)
        ),
        "gpt_oss": lambda: t.GptOssForCausalLM(
            t.GptOssConfig(
                intermediate_size=32,
                num_local_experts=experts,
                head_dim=8,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                **aux,
                **common,
            )
        ),
        # Group routing (2 groups of 2 experts, 1 group per token), a shared expert, a dense first layer.
        "deepseek_v3": lambda: t.DeepseekV3ForCausalLM(
            t.DeepseekV3Config(
                intermediate_size=64,
                moe_intermediate_size=32,
                n_routed_experts=experts,
                n_group=2,
                topk_group=1,
                first_k_dense_replace=1,
                n_shared_experts=1,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                **{**common, "num_key_value_heads": 4},
            )
        ),
    }
    torch.manual_seed(0)
    return built[family]().float()


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM of ``config``'s family (``LlamaForCausalLM`` for a ``LlamaConfig``) held as
    ``self.model`` (its file keys lack the ``model.`` prefix), trained with plain SGD (lr 0.5, gradient-scale
    sensitive) or AdamW; built in ``configure_model`` on request."""

    def __init__(self, config: Any, optimizer: str = "sgd", build_in_configure_model: bool = False) -> None:
        super().__init__()
        self.config, self.optimizer_name = config, optimizer
        self.model: Any = None if build_in_configure_model else _causal_lm(config)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = _causal_lm(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _causal_lm(config: Any) -> Any:
    import transformers

    return transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)


def job_env(pythonpath: bool = True) -> dict[str, str]:
    """The environment for a job a test starts as a user would: one thread per rank, no inherited rank
    variables, and (``pythonpath=False``) the package from its installation rather than the checkout."""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not pythonpath:
        env.pop("PYTHONPATH", None)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


class _BenchServer:
    """``tests/jobs/bench_server.py``, started on first use: the benchmarks run in one interpreter, which imports
    torch and Lightning once and forks every benchmark's ranks from one preloaded server."""

    def __init__(self) -> None:
        root = Path(__file__).resolve().parents[1]
        self.log = tempfile.NamedTemporaryFile(prefix="bench_server_", suffix=".log", delete=False)  # noqa: SIM115
        read, write = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, str(root / "tests" / "jobs" / "bench_server.py"), str(write)],
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            env=job_env(),
            cwd=root,
            pass_fds=(write,),
            start_new_session=True,  # a timeout stops the server with every rank it started
        )
        os.close(write)
        self.answers = os.fdopen(read)
        atexit.register(self.stop)

    def run(self, script: str, args: tuple[str, ...], timeout: float) -> Any:
        assert self.proc.stdin is not None
        logged = os.path.getsize(self.log.name)
        self.proc.stdin.write(json.dumps({"script": script, "args": list(args)}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], timeout)
        line = self.answers.readline() if ready else ""
        with open(self.log.name) as log:
            log.seek(logged)
            ranks_output = log.read()
        cmd = ["benchmarks/" + script, *args]
        if not line:  # timed out, or the server died with the benchmark
            self.stop(wait=0 if not ready else 30)
            if not ready:
                raise subprocess.TimeoutExpired(cmd, timeout, output=ranks_output)
            return subprocess.CompletedProcess(cmd, self.proc.returncode or 1, "", ranks_output)
        answer = json.loads(line)
        stderr = answer["stderr"] + ranks_output
        return subprocess.CompletedProcess(cmd, answer["returncode"], answer["stdout"], stderr)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, wait: float = 30) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        Path(self.log.name).unlink(missing_ok=True)


_bench_server: _BenchServer | None = None


def run_benchmark(script: str, *args: str, timeout: float = 400) -> Any:
    """Run ``benchmarks/<script>`` with ``args`` as ``python benchmarks/<script> ...`` from the repository root
    would (in one interpreter kept for every benchmark of the session); a completed process: the exit code, what
    the script printed as stdout, and as stderr what it printed there followed by its ranks' output."""
    global _bench_server
    if _bench_server is None or not _bench_server.alive():
        _bench_server = _BenchServer()
    return _bench_server.run(script, args, timeout)
