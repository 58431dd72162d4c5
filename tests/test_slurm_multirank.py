"""SLURM, as ``srun`` runs a job step: each task its own process with ``SLURM_*`` variables, no launcher.

The engine under test is SLURM's contract with the tasks (the variables, SIGUSR1 before the time limit, the
requeued job starting again), which Lightning's ``SLURMEnvironment`` reads; ``tests/jobs/fake_srun.py`` starts
the tasks on this host as ``srun`` starts them on the allocation's nodes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import job_env

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[1]
JOBS = Path(__file__).parent / "jobs"
SHARD = ["fsdp1", "fsdp3", "deepspeed1", "deepspeed3"]


def _srun(root: Path, nodes: int, per_node: int, *command: str, path: str | None = None) -> str:
    """``command`` as one SLURM job step of ``nodes`` x ``per_node`` tasks (the variables ``sbatch`` exports,
    then ``srun``'s per task); its output."""
    assert nodes <= 2, "this host has two names to list as nodes"
    env = {
        key: value
        for key, value in job_env().items()
        if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
    }
    env.update(
        SLURM_JOB_ID=str(random.randint(10000, 99999)),  # Lightning derives the rendezvous port from it
        SLURM_JOB_NAME="train",
        SLURM_NNODES=str(nodes),
        SLURM_NTASKS_PER_NODE=str(per_node),
        # One host per node, as SLURM lists them (two names of this host); Lightning meets on the first.
        SLURM_JOB_NODELIST=",".join(["localhost", "127.0.0.1"][:nodes]),
        OMP_NUM_THREADS="1",
    )
    if path is not None:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    run = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    return out


def _job(tmp_path: Path, nodes: int, per_node: int, *args: str) -> dict[str, tuple[int, list[float]]]:
    _srun(
        tmp_path,
        nodes,
        per_node,
        sys.executable,
        str(JOBS / "fake_srun.py"),
        sys.executable,
        str(JOBS / "slurm_job.py"),
        "--root",
        str(tmp_path),
        *args,
    )
    runs = {}
    for name in ("ddp", *SHARD):
        ranks = [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in range(nodes * per_node)]
        assert all(rank == ranks[0] for rank in ranks), (name, ranks)  # every rank logged the same mean
        runs[name] = (ranks[0]["start"], ranks[0]["losses"])
    return runs


def test_both_engines_train_as_ddp_and_resume_from_the_hpc_checkpoint_of_sigusr1(tmp_path):
    # 1 node x 2 tasks; SIGUSR1 at step 2 on every task: Lightning saves hpc_ckpt_1.ckpt (sharded) and asks
    # scontrol to requeue (which fails harmlessly here).
    first = _job(tmp_path, 1, 2, "--signal-step", "2", "--max-steps", "5")
    for name in SHARD:
        assert (tmp_path / name / "hpc_ckpt_1.ckpt").is_dir(), name  # every rank wrote its shard
        torch.testing.assert_close(first[name][1], first["ddp"][1], rtol=1e-5, atol=0, msg=name)
    # The requeued job, on 2 nodes x 2 tasks: Lightning finds the HPC checkpoint and resumes at step 2 on 4 ranks,
    # each engine reading from the batch its loop is at, as the reference's sampler does (DDP itself would
    # start the epoch again, a run of other rows).
    second = _job(tmp_path, 2, 2, "--max-steps", "6")
    assert second["ddp"][0] == 2
    for name in SHARD:
        assert second[name][0] == 2, name
        torch.testing.assert_close(second[name][1], second["ddp"][1], rtol=1e-5, atol=0, msg=name)


def test_the_example_sbatch_script_runs_with_srun(tmp_path):
    # The script as a user submits it; `srun` is fake_srun.py (this host as every node).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\nexec {sys.executable} {JOBS / "fake_srun.py"} "$@"\n')
    srun.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("examples", "configs"):
        (work / name).symlink_to(ROOT / name)
    script = ROOT / "examples" / "slurm" / "train.sbatch"
    assert "#SBATCH --signal=USR1@90" in script.read_text() and "#SBATCH --requeue" in script.read_text()
    overrides = ["--trainer.max_steps=3", "--trainer.enable_progress_bar=false", "--model.n_layers=2"]
    _srun(
        work,
        2,
        1,
        shutil.which("bash") or "bash",
        str(script),
        *overrides,
        "--data.n_sentences=400",
        path=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}",
    )
    assert (work / "outputs/zero3/checkpoints/last.ckpt/.metadata").is_file()
