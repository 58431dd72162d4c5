"""Every command the README shows runs: the main job (few steps), consolidate, and CI's test command."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import job_env

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _quickstart_commands() -> list[str]:
    section = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line for line in blocks[0].splitlines() if line and not line.startswith("#")]


def _python_part(command: str) -> list[str]:
    return shlex.split(command.split("&&")[-1].strip())


def test_quickstart_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    commands = _quickstart_commands()
    assert len(commands) == 2
    # torch first and pinned (an unpinned torch may pull a multi-GB CUDA build), then the package.
    assert all(c.startswith("pip install torch==2.13.0") for c in commands)
    *installs, build_ops, test_command = (part.strip() for part in commands[1].split("&&"))
    # DeepSpeed's tests run too: DeepSpeed builds against the installed torch, so without build isolation,
    # and its C++ ops are compiled once before the tests load them.
    assert installs[-1] == 'pip install --no-build-isolation -e ".[dev,deepspeed,s3,hf,ray,fp8]"'
    assert build_ops == "lightning-shard build-ops"
    assert test_command == "python -m pytest -q"
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    # CI installs with exactly the README's commands, in order, and ends with its test command.
    assert [
        line for line in ci_lines if line.startswith(("pip install", "python -m pip install"))
    ] == installs
    assert build_ops in ci_lines[:-1] and ci_lines[-1] == test_command


def test_quickstart_and_ci_name_what_nvme_offload_needs_and_what_tests_skip_on():
    section = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    setup = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    assert "apt-get install libaio-dev" in setup  # tests marked needs_libaio skip without it
    assert "apt-get install -y -qq libaio-dev" in (ROOT / ".ci/run").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    from tests.conftest import _NEEDS  # the conftest's skip markers, so a new one must reach the README

    assert {"deepspeed", "needs_libaio", "cuda", "needs_fp16_cpu", "torchao"} <= set(_NEEDS)
    for marker in _NEEDS:
        assert f"`{marker}`" in section and f'"{marker}: ' in pyproject, marker


def test_extras_named_in_the_readme_exist():
    # pyproject's extras, one `name = [...]` line each (tomllib is not in Python 3.10).
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]\n", 1)[1]
    extras = dict(re.findall(r"^([a-z]+) = \[(.*)\]$", section.split("\n[", 1)[0], re.M))
    named = set(re.findall(r'-e "\.\[([a-z,]+)\]"', README))
    assert named and all(name in extras for group in named for name in group.split(","))
    assert "deepspeed" not in extras["dev"]  # it needs torch installed before it builds


def _train_gpt(tmp_path: Path, argv: list[str], max_steps: int) -> str:
    """Run a README ``python examples/train_gpt.py ...`` command from ``tmp_path``, shortened, as a user would:
    no PYTHONPATH, so the demo model comes from the installed package."""
    for name in ("examples", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    overrides = [
        f"--trainer.max_steps={max_steps}",
        "--trainer.enable_progress_bar=false",
        "--model.n_layers=2",
        "--trainer.log_every_n_steps=1",
    ]
    run = subprocess.run(
        [sys.executable, *argv[1:], *overrides, "--data.n_sentences=400"],
        cwd=tmp_path,
        env=job_env(pythonpath=False),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.mark.multirank
def test_main_job_and_consolidate(tmp_path, monkeypatch, capsys):
    from lightning_shard.cli import main

    argv = _python_part(_quickstart_commands()[0])
    assert argv[:2] == ["python", "examples/train_gpt.py"]
    out = _train_gpt(tmp_path, argv, max_steps=4)
    # The README's `lightning-shard ...` lines run in this process (the console script's own entry point,
    # `lightning_shard.cli:main`), from the directory the job ran in.
    monkeypatch.chdir(tmp_path)
    last = tmp_path / "outputs/zero3/checkpoints/last.ckpt"
    assert (last / ".metadata").is_file()
    # The run ends with its summary on rank 0 (once). Its checkpoint line names a checkpoint saved before
    # the end (the 200-step job's step-100 one); `last` of this 4-step run is written after the summary.
    assert out.count("Run summary: 4 steps on 2 rank(s)") == 1, out[-3000:]
    assert "final train_loss:" in out and "peak memory per rank:" in out, out[-3000:]
    # The README's picture of a run, from the run's CSV logs.
    plot = [line for line in README.splitlines() if line.startswith("lightning-shard plot")]
    assert plot == ["lightning-shard plot outputs/zero3"], plot
    assert main(shlex.split(plot[0])[1:]) == 0, capsys.readouterr()
    assert (tmp_path / "outputs/zero3/run.png").stat().st_size > 10_000

    consolidate = [line for line in README.splitlines() if line.startswith("lightning-shard consolidate")]
    assert len(consolidate) == 1
    assert main(shlex.split(consolidate[0])[1:]) == 0, capsys.readouterr()
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    from lightning_shard.demos import GPTModule

    GPTModule(n_layers=2).load_state_dict(weights)
    # The sharded checkpoint itself, as the README loads it: weights and hyper-parameters.
    assert 'GPTModule.load_from_checkpoint("outputs/zero3/checkpoints/last.ckpt")' in README
    model = GPTModule.load_from_checkpoint(last)
    assert model.hparams["n_layers"] == 2
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, weights[name], rtol=0, atol=0)


def test_every_stage_config_parses():
    from lightning.pytorch.cli import LightningCLI

    from lightning_shard import ShardStrategy
    from lightning_shard.demos import GPTModule, TextDataModule

    for stage in range(4):
        cli = LightningCLI(
            GPTModule,
            TextDataModule,
            run=False,
            args=["--config", str(ROOT / f"configs/zero{stage}.yaml"), "--trainer.logger=false"],
        )
        assert isinstance(cli.trainer.strategy, ShardStrategy) and cli.trainer.strategy.stage == stage


def _parsed(config: str) -> Any:
    """The LightningCLI of the demo for ``configs/<config>``, not run."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_shard.demos import GPTModule, TextDataModule

    return LightningCLI(
        GPTModule,
        TextDataModule,
        run=False,
        args=["--config", str(ROOT / "configs" / config), "--trainer.logger=false"],
    )


def test_tensor_parallel_config_parses():
    from lightning_shard import ShardStrategy

    strategy = _parsed("tp2_zero3.yaml").trainer.strategy
    assert isinstance(strategy, ShardStrategy)
    assert strategy.config.tensor_parallel_size == 2 and strategy.layout.shard == 2


@pytest.mark.multirank
def test_more_than_one_dimension_command_runs(tmp_path):
    section = README.split("## More than one dimension", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in section.splitlines() if line.startswith("python examples/")]
    assert commands == ["python examples/train_gpt.py fit --config configs/tp2_zero3.yaml"]
    _train_gpt(tmp_path, shlex.split(commands[0]), max_steps=2)
    assert (tmp_path / "outputs/tp2_zero3/checkpoints/last.ckpt/.metadata").is_file()


@pytest.mark.multirank
def test_expert_parallel_command_runs(tmp_path):
    section = README.split("## Mixture-of-experts models", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in section.splitlines() if line.startswith("python examples/")]
    assert commands == ["python examples/train_gpt.py fit --config configs/moe_ep.yaml"]
    out = _train_gpt(tmp_path, shlex.split(commands[0]), max_steps=2)
    assert (tmp_path / "outputs/moe_ep/checkpoints/last.ckpt/.metadata").is_file()
    assert "MFU:" in out


def test_expert_parallel_config_parses():
    from lightning_shard import ShardStrategy

    cli = _parsed("moe_ep.yaml")
    assert isinstance(cli.trainer.strategy, ShardStrategy)
    assert cli.trainer.strategy.config.expert_parallel_size == 2 and cli.model.hparams["n_experts"] == 8


def test_plan_commands_in_readme_run(capsys):
    from lightning_shard.cli import main

    lines = [line for line in README.splitlines() if line.startswith("lightning-shard plan")]
    assert lines
    for line in lines:
        assert main(shlex.split(line)[1:]) == 0
        assert "ShardStrategy(" in capsys.readouterr().out


@pytest.mark.multirank
def test_finetune_a_model_bigger_than_one_device_commands_run(tmp_path):
    pytest.importorskip("transformers")
    section = README.split("## Fine-tune a model bigger than one device", 1)[1].split("\n## ", 1)[0]
    commands = [
        line
        for line in re.findall(r"```bash\n(.*?)```", section, re.S)[0].splitlines()
        if line and not line.startswith("#")
    ]
    assert [shlex.split(c)[:2] for c in commands] == [["python", "examples/finetune_hf.py"]] * 2
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = job_env(pythonpath=False)
    for command in commands:
        argv = shlex.split(command)
        if "--max-steps" in argv:
            argv[argv.index("--max-steps") + 1] = "3"
        run = subprocess.run(
            [sys.executable, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "fine-tuned outputs/tiny-llama for 3 steps" in run.stdout
