"""RayShardStrategy inside Ray Train ``TorchTrainer`` workers, on a real local Ray cluster.

``tests/jobs/ray_job.py`` runs, in one Ray session, the job as Ray's Lightning guide writes it: 2 workers under
RayDDPStrategy and RayShardStrategy (FSDP stages 1 and 3, DeepSpeed stage 3, tensor parallel), then a Trainer that
loses a worker in epoch 2 and that Ray restarts from the sharded checkpoint it reported (all in one run, whose
storage is the local S3 server), and checkpoints of 2 workers resumed on 1.
Ray runs in its own process: Ray and pytest's forked ranks do not mix.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.helpers import job_env, trainer_kwargs

pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install 'lightning-shard[ray]')")
pytest.importorskip(
    "moto", reason="the Ray job's s3:// storage needs the local S3 server: pip install 'lightning-shard[s3]'"
)

#: The job's limit. Its time is mostly Ray starting processes (a controller per run and a worker per rank of each
#: attempt, 5 workers each importing torch and Lightning), stretched by the CPU load beside it. Ray starts them at
#: nice 15 unless told otherwise (the job sets RAY_worker_niceness=0): beside the suite's other xdist workers on 2
#: cores the job then took 780 s, one worker group 295 s to start, and at 540 s it was still starting the restarted
#: run (its only output the lost worker's exit): slow, never waiting on anything.
JOB_TIMEOUT_S = 900
# The module's job runs in its first test's set-up: that test's limit (pyproject's timeout, 600 s) is raised past it.
pytestmark = [pytest.mark.multirank, pytest.mark.timeout(JOB_TIMEOUT_S + 120)]

JOB = Path(__file__).parent / "jobs" / "ray_job.py"
SHARD = ["fsdp1", "fsdp3", "deepspeed3"]  # data-parallel over both workers, as RayDDPStrategy
STEPS_PER_EPOCH = 4  # 32 samples, batch 4 per worker, 2 workers
DCP_RANK0 = ["checkpoint.ckpt/.metadata", "checkpoint.ckpt/__0_0.distcp", "checkpoint.ckpt/meta.pt"]
DCP_RANK1 = ["checkpoint.ckpt/__1_0.distcp"]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray")
    proc = subprocess.Popen(
        [sys.executable, str(JOB), "--root", str(root)],
        cwd=root,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a timeout stops the driver with Ray's GCS and raylet (its workers end with it)
    )
    try:
        stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"the Ray job did not finish within {JOB_TIMEOUT_S} s. Ray Train's controller logged:\n"
            f"{_controller_log(root)}\n--- the job's output ---\n{(stdout + stderr)[-4000:]}"
        )
    assert proc.returncode == 0, (stdout + stderr)[-4000:]
    return root


def _controller_log(root: Path) -> str:
    """Ray Train's controller log of the job's session: each worker group's start-up steps and failures, in order."""
    session = root / "ray_session"
    if not session.exists():
        return "(Ray had not started)"
    lines = []
    for log in sorted(Path(session.read_text(), "logs", "train").glob("ray-train-sys-controller-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            first = (str(entry.get("message", "")).splitlines() or [""])[0]
            lines.append(f"{entry.get('asctime')} {first[:200]}")
    return "\n".join(sorted(lines)[-60:]) or "(no controller log)"


def _part(root: Path, part: str) -> dict[str, Any]:
    summary = json.loads((root / f"{part}.json").read_text())
    log = root / "moto.log"  # the local S3 server's requests and errors, for a failure in s3:// storage
    server = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    assert summary["error"] is None, summary["error"][-4000:] + "\n--- S3 server log ---\n" + server
    return summary


def _ranks(root: Path, part: str, name: str, world: int) -> list[dict[str, Any]]:
    ranks = [json.loads((root / part / name / f"rank{r}.json").read_text()) for r in range(world)]
    for rank in ranks:
        assert rank["world"] == world
        assert rank["losses"] == ranks[0]["losses"], (name, ranks)  # every rank logged the same mean
    return ranks


def _two_workers() -> list[str]:
    """The Trainers of the job's 2-worker run, in order (a Trainer's index is the run_id it reports)."""
    from tests.jobs.ray_job import TWO_WORKERS

    return TWO_WORKERS


def _lost() -> int:
    """The run_id of the Trainer that loses a worker."""
    from tests.jobs.ray_job import LOST

    return _two_workers().index(LOST)


def test_every_engine_trains_as_ray_ddp_in_ray_workers(job):
    _part(job, "two_workers")
    ddp = _ranks(job, "two_workers", "ddp", 2)[0]["losses"]
    assert len(ddp) == 2 * STEPS_PER_EPOCH
    for name in SHARD:
        losses = _ranks(job, "two_workers", name, 2)[0]["losses"]
        torch.testing.assert_close(losses, ddp, rtol=1e-5, atol=0, msg=name)


def test_each_worker_reports_its_own_shards_and_ray_keeps_the_whole_checkpoint(job):
    checkpoints = _part(job, "two_workers")["checkpoints"]
    # 2 per Trainer (one per epoch); the lost worker's Trainer: epoch 1 before the loss, epoch 2 after the restart
    assert sorted(c["run_id"] for c in checkpoints) == sorted(2 * list(range(len(_two_workers())))), (
        checkpoints
    )
    for name in ("fsdp1", "fsdp3"):
        # Each worker's own directory (on its own host, all Ray can upload from it): its own shard only.
        rank0, rank1 = _ranks(job, "two_workers", name, 2)
        assert rank0["reported"] == [DCP_RANK0, DCP_RANK0], name
        assert rank1["reported"] == [DCP_RANK1, DCP_RANK1], name
    for saved in checkpoints:
        files, name = saved["files"], _two_workers()[int(saved["run_id"])]
        assert not any(".tmp" in f for f in files), files  # every rank committed its part
        if name in ("fsdp1", "fsdp3"):  # DCP shards of both ranks and rank 0's metadata
            assert files == sorted(DCP_RANK0 + DCP_RANK1), files
        elif name == "deepspeed3":  # DeepSpeed ZeRO-3: each rank's partition files
            for rank in (0, 1):
                assert any(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in f for f in files), files


def test_tensor_parallel_over_both_workers_trains_as_one_process(job):
    # One data-parallel rank: both workers read the same batches (the sampler takes the mesh's data-parallel
    # rank, not Ray's world rank) and their loss is one process's on the whole model. The one process reads
    # them as Lightning's sampler for training does (one replica, shuffled with seed 0).
    from torch.utils.data import DataLoader, DistributedSampler

    from tests.jobs.ray_job import JobModule, _data

    (rank0, rank1) = _ranks(job, "two_workers", "tp2", 2)
    assert rank1["losses"] == rank0["losses"]
    L.seed_everything(0)
    model = JobModule(run_id=_two_workers().index("tp2"))
    trainer = L.Trainer(devices=1, **trainer_kwargs(max_steps=-1, max_epochs=2))
    data = _data().dataset
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(model, DataLoader(data, batch_size=4, sampler=sampler))
    assert len(model.losses) == 4 * STEPS_PER_EPOCH  # all 32 samples per epoch on the one data-parallel rank
    torch.testing.assert_close(rank0["losses"], model.losses, rtol=1e-5, atol=0)


def test_a_lost_worker_restarts_from_the_reported_sharded_checkpoint_and_ends_as_the_uninterrupted_run(job):
    # Rank 1 exited inside epoch 2 of the first attempt; Ray restarted both workers (max_failures=1).
    saved = [c for c in _part(job, "two_workers")["checkpoints"] if c["run_id"] == _lost()]
    assert [c["epoch"] for c in saved] == [0, 1]
    for checkpoint in saved:  # in s3:// storage: both workers' shards uploaded, every rank's part committed
        assert checkpoint["path"].startswith("ray/storage/two_workers/"), checkpoint["path"]
        assert checkpoint["files"] == sorted(DCP_RANK0 + DCP_RANK1), checkpoint["files"]
    resumed = _ranks(job, "two_workers", "fsdp3_lost_worker", 2)[0]
    assert resumed["start"] == STEPS_PER_EPOCH  # from the checkpoint reported at the end of epoch 1
    uninterrupted = _ranks(job, "two_workers", "fsdp3", 2)[0]["losses"]
    torch.testing.assert_close(resumed["losses"], uninterrupted[STEPS_PER_EPOCH:], rtol=1e-5, atol=0)


def _one_process_three_epochs() -> list[float]:
    """The reshard parts' reference without Ray or the package: one process trains the job's model with plain
    SGD for the 2 epochs the 2 workers trained (their 2 x 4 rows per step are one step of 8 rows), then the third
    epoch as the one worker trains it (4 rows per step), every epoch in the order Lightning's sampler gives one
    replica (shuffled with seed 0, reseeded per epoch); returns the third epoch's losses."""
    from torch.utils.data import DataLoader, DistributedSampler

    from tests.jobs.ray_job import JobModule, _data

    model = JobModule(run_id=0)
    optimizer = model.configure_optimizers()
    data = _data().dataset
    losses = []
    for epoch in range(3):
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=8 if epoch < 2 else 4, sampler=sampler):
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses[2 * STEPS_PER_EPOCH :]


@pytest.mark.parametrize("name", ["fsdp3", "deepspeed3"])
def test_a_checkpoint_of_two_workers_resumes_on_one(job, name):
    _part(job, "reshard")
    (one,) = _ranks(job, "reshard", name, 1)
    assert one["start"] == 2 * STEPS_PER_EPOCH  # the 2-worker checkpoint of epoch 2, resharded
    assert len(one["losses"]) == 2 * STEPS_PER_EPOCH  # the third epoch, all of it on one worker
    # This run's storage is a local directory: the one worker's checkpoint of epoch 3, whole.
    (saved,) = [
        c for c in _part(job, "reshard")["checkpoints"] if c["run_id"] == ["fsdp3", "deepspeed3"].index(name)
    ]
    assert saved["epoch"] == 2 and not any(".tmp" in f for f in saved["files"]), saved
    if name == "fsdp3":
        assert one["reported"] == [DCP_RANK0]
        assert saved["files"] == DCP_RANK0, saved
    # The weights and step resumed on one worker are those of an uninterrupted run in one process (measured:
    # 1.2e-7 relative; a resume that loses the weights or reads the wrong epoch is off by far more).
    expected = _one_process_three_epochs()
    torch.testing.assert_close(one["losses"], expected, rtol=1e-5, atol=0, msg=lambda m: f"{name}: {m}")


# --- outside a Ray worker: a clear error at Trainer construction (no Ray cluster needed) ----------


def test_outside_a_ray_worker_the_error_names_ray_and_the_fix():
    from ray.train.lightning import RayLightningEnvironment

    from lightning_shard.ray import RayShardStrategy

    with pytest.raises(RuntimeError, match="not a Ray Train worker.*TorchTrainer"):
        L.Trainer(accelerator="cpu", strategy=RayShardStrategy(stage=3), plugins=[RayLightningEnvironment()])


def test_without_ray_lightning_environment_the_error_names_the_plugin():
    from lightning.pytorch.plugins.environments import LightningEnvironment

    from lightning_shard.ray import RayShardStrategy

    with pytest.raises(RuntimeError, match=r"plugins=\[RayLightningEnvironment\(\)\]"):
        L.Trainer(accelerator="cpu", strategy=RayShardStrategy(stage=1), plugins=[LightningEnvironment()])


def test_ray_prepare_trainer_accepts_the_strategy_without_ddp_behaviour():
    from lightning.pytorch.strategies import DDPStrategy
    from ray.train.lightning import RayDDPStrategy

    from lightning_shard import ShardStrategy
    from lightning_shard.ray import RayShardStrategy

    assert issubclass(RayShardStrategy, RayDDPStrategy)  # what prepare_trainer checks
    assert DDPStrategy not in RayShardStrategy.__mro__ and issubclass(RayShardStrategy, ShardStrategy)
