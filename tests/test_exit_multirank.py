"""Jobs end cleanly: launched as users launch them (``python script.py``, Lightning starts rank 1),
judged by exit code, wall time and what is left on disk and in the process table."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_shard.demos.ranks import free_port
from tests.helpers import ENGINES, job_env

JOB = Path(__file__).parent / "jobs" / "exit_job.py"


def _start(root: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, str(JOB), "--root", str(root), *args]
    # as a user starts it: no rank or port variables an in-process test of this session may have set
    env = {**job_env(), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _alive(root: Path) -> list[str]:
    """Job processes (either rank) still running for this root."""
    found = subprocess.run(["pgrep", "-af", f"--root {root}"], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def _torchrun_start(torchrun_args: list[str], root: Path, *args: str, workers: int = 2) -> subprocess.Popen:
    """The job under torchrun's elastic agent, 2 workers, as a user starts it (no rank variables of ours)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers), *torchrun_args]
    env = {
        key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    return subprocess.Popen(
        [*cmd, str(JOB), "--root", str(root), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _torchrun_finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        _kill_tree(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _torchrun(
    torchrun_args: list[str], root: Path, *args: str, workers: int = 2
) -> subprocess.CompletedProcess:
    return _torchrun_finish(_torchrun_start(torchrun_args, root, *args, workers=workers))


def _process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (torchrun starts its workers in sessions of their own)."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [grandchild for child in children for grandchild in _process_tree(int(child))]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process under it, if it is still running (a test that failed midway)."""
    for pid in _process_tree(proc.pid) if proc.poll() is None else []:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.returncode is None:
        proc.wait()


def _engine_args(engine: str) -> list[str]:
    return ["--engine", engine, "--stage", "3", "--async-checkpoint"]


#: 4 steps per epoch, a checkpoint at each epoch's end: a resume from one is exact (Lightning resumes a plain
#: DataLoader exactly only at an epoch's end), so a restarted run must end with the uninterrupted run's weights.
EXACT = ("--epoch-steps", "4", "--every", "4", "--max-steps", "8", "--digest")


def _weights(out: str) -> set[str]:
    """The weight digests the ranks printed after fit."""
    return set(re.findall(r"rank \d weights ([0-9a-f]{64})", out))


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess:
    """The job under torchrun, uninterrupted: fit 8 steps, fit again, test."""
    return _torchrun([], tmp_path_factory.mktemp("torchrun"), *_engine_args("fsdp"), *EXACT, "--then-test")


def test_under_torchrun_groups_stay_alive_between_calls_and_the_job_exits_zero(torchrun_job):
    # torchrun's workers share the agent's store; the groups made on it outlive each Trainer call.
    run = torchrun_job
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} process group alive after fit: True" in run.stdout
        assert f"rank {rank} finished test" in run.stdout


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def _sigterm_then_resume(engine: str, root: Path, resumed_root: Path) -> SimpleNamespace:
    """Two jobs, one after the other. The first is sent SIGTERM mid-training (after its step-2 checkpoint);
    the second, a new job, resumes from the exception checkpoint the first committed, trains 2 steps, fits
    again (2 more), tests, and runs collectives after fit and after test. What each test judges, as it was
    when each job ended."""
    ckpts = root / "checkpoints"
    proc = _start(root, *_engine_args(engine), "--max-steps", "100000")
    try:
        _wait_for(ckpts / "epoch=0-step=2.ckpt", proc, seconds=240)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # to the launching process, as SLURM / Kubernetes do
        rc, out = _finish(proc, timeout=120)
        elapsed = time.monotonic() - start
    finally:
        _kill_tree(proc)
    run = SimpleNamespace(
        sigterm_rc=rc,
        sigterm_out=out,
        sigterm_elapsed=elapsed,
        # every rank's stop step: one value when all stopped at the same step
        stopped={int(s) for s in re.findall(r"stopped by SIGTERMException at step (\d+)", out)},
        exception_ckpt=ckpts / "on_exception.ckpt",
        exception_ckpt_is_dir=(ckpts / "on_exception.ckpt").is_dir(),
        exception_ckpt_is_link=(ckpts / "on_exception.ckpt").is_symlink(),
        sigterm_tmp=list(root.rglob("*.tmp")),
        sigterm_alive=_alive(root),
        step=None,
    )
    if len(run.stopped) != 1 or not run.exception_ckpt_is_dir:
        return run  # nothing to resume from: the tests report why
    (run.step,) = run.stopped
    args = ["--max-steps", str(run.step + 2), "--every", "1", "--then-test", "--collectives"]
    proc = _start(resumed_root, *_engine_args(engine), *args, "--resume", str(run.exception_ckpt))
    try:
        run.resumed_rc, run.resumed_out = _finish(proc, timeout=300)
    finally:
        _kill_tree(proc)
    run.resumed_tmp = list(resumed_root.rglob("*.tmp"))
    run.resumed_alive = _alive(resumed_root)
    return run


@pytest.fixture(scope="module")
def sigterm_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future]:
    """Per engine, :func:`_sigterm_then_resume`: the SIGTERM test judges both jobs, the fit / fit again /
    test one the second (one launch serves both). The engines' jobs run at once: each mostly runs one
    process at a time (rank 0 imports, then rank 1; each exits in turn), so two share 2 cores."""
    engines = sorted(
        {
            item.callspec.params["engine"]
            for item in request.session.items
            if "sigterm_runs" in getattr(item, "fixturenames", ()) and item.get_closest_marker("skip") is None
        }
    )
    pool = ThreadPoolExecutor(max_workers=len(engines) or 1)
    runs = {
        engine: pool.submit(
            _sigterm_then_resume,
            engine,
            tmp_path_factory.mktemp(f"sigterm-{engine}"),
            tmp_path_factory.mktemp(f"resumed-{engine}"),
        )
        for engine in engines
    }
    pool.shutdown(wait=True)
    return runs  # each engine's tests take their own result (or its error) with .result()


@pytest.mark.parametrize("engine", ENGINES)
def test_sigterm_mid_training_commits_an_exception_checkpoint_that_resumes_at_its_step(sigterm_runs, engine):
    run = sigterm_runs[engine].result()
    out = run.sigterm_out
    assert run.sigterm_elapsed < 60, out[-3000:]
    assert run.sigterm_rc == 0, out[-3000:]  # Lightning ends a SIGTERM-stopped fit with SystemExit(None)
    assert len(run.stopped) == 1, out[-3000:]  # every rank stopped at the same step
    step = run.step
    assert run.exception_ckpt_is_dir
    assert not run.exception_ckpt_is_link  # written, not linked to a prunable checkpoint
    assert not run.sigterm_tmp
    assert not run.sigterm_alive

    out = run.resumed_out
    assert run.resumed_rc == 0, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 starts training at step {step}" in out
        assert f"rank {rank} finished fit at step {step + 2}" in out


@pytest.mark.parametrize("engine", ENGINES)
def test_fit_fit_again_and_test_in_one_process_exit_zero_with_groups_alive_between_calls(
    sigterm_runs, engine
):
    # The job that resumes the SIGTERM test's exception checkpoint: fit (2 steps), fit again (2 more), test,
    # asynchronous checkpoints after every step, collectives after fit and after test.
    run = sigterm_runs[engine].result()
    assert run.step is not None, f"no job resumed: the SIGTERM run failed\n{run.sigterm_out[-3000:]}"
    rc, out, step = run.resumed_rc, run.resumed_out, run.step
    assert rc == 0, out[-3000:]
    for rank in (0, 1):
        for after in ("fit", "test"):
            expected = f"rank {rank} after {after}: broadcast=path-from-rank-0 sum=3.0 gather=[0.0, 1.0]"
            assert expected in out, out[-3000:]
        assert f"rank {rank} finished fit at step {step + 2}" in out
        assert f"rank {rank} process group alive after fit: True" in out
        assert f"rank {rank} finished second fit at step {step + 4}" in out
        assert f"rank {rank} finished test" in out
    assert not run.resumed_tmp
    assert not run.resumed_alive


@pytest.mark.parametrize("engine", ENGINES)
def test_a_hung_rank_ends_the_job_within_the_timeout_with_an_error_naming_it(tmp_path, engine):
    timeout = 6  # a step's collectives take well under a second here
    proc = _start(
        tmp_path, *_engine_args(engine), "--timeout", str(timeout), "--hang-rank", "1", "--max-steps", "50"
    )
    rc, out = _finish(proc, timeout=240)
    ended = time.time()
    assert rc != 0
    hung_at = re.search(r"rank 1 hangs at step 2 at ([0-9.]+)", out)
    assert hung_at, out[-3000:]
    assert "CollectiveTimeoutError" in out, out[-3000:]
    assert f"ShardStrategy(timeout=0:00:{timeout:02d})" in out
    # At most two timeouts after the hang began (the step's collective, then nothing else waits on the
    # lost rank), then rank 0 waits CHILD_EXIT_GRACE_S before stopping the hung rank; its error report and exit
    # take seconds more beside a busy suite on 2 cores (20.1 s in all, once). Without the flag's timeout
    # the job would wait torch's 30 minutes (the rank hangs for an hour).
    assert ended - float(hung_at.group(1)) < 2 * timeout + 2 + 12, (
        ended - float(hung_at.group(1)),
        out[-3000:],
    )
    assert "rank 1 (pid" in out and "stopping it" in out
    assert not _alive(tmp_path)


def _save_after_fit(root: str, engine: str, stages: tuple[int, ...]) -> dict[int, dict]:
    """Per stage, on the same ranks: fit, save between calls, fit again from that checkpoint."""
    import lightning as L
    import torch.distributed as dist

    from lightning_shard import ShardStrategy
    from tests.helpers import full_weights, loader, tiny_gpt, trainer_kwargs

    by_stage: dict[int, dict] = {}
    for stage in stages:
        trainer = L.Trainer(
            devices=2, strategy=ShardStrategy(stage=stage, engine=engine), **trainer_kwargs(max_steps=2)
        )
        model = tiny_gpt()
        trainer.fit(model, loader(4))
        out: dict = {"alive_after_fit": dist.is_initialized()}
        path = Path(root) / f"s{stage}" / "after_fit.ckpt"
        trainer.save_checkpoint(path)  # between calls, on the groups the fit used
        out["saved"] = path.exists()
        out["weights"] = full_weights(trainer)
        trainer.fit_loop.epoch_loop.max_steps = 3
        trainer.fit(model, loader(4), ckpt_path=str(path))  # resumes at step 2
        out["steps"] = trainer.global_step
        out["alive_at_end"] = dist.is_initialized()
        by_stage[stage] = out
    return by_stage


@pytest.mark.parametrize("engine", ENGINES)
def test_save_checkpoint_after_fit_on_the_live_groups_then_resume_from_it(tmp_path, engine):
    from lightning_shard.demos.ranks import run_ranks

    ranks = run_ranks(_save_after_fit, str(tmp_path), engine, (1, 3))
    for stage in (1, 3):
        results = [by_stage[stage] for by_stage in ranks]
        for out in results:
            assert out["alive_after_fit"] is True and out["alive_at_end"] is True
            assert out["saved"] and out["steps"] == 3
        for name, value in results[0]["weights"].items():
            assert torch.equal(value, results[1]["weights"][name])


OUTLIVE_JOB = Path(__file__).parent / "jobs" / "outlive_job.py"


def _outliving(root: Path, *args: str) -> SimpleNamespace:
    """``outlive_job.py``, whose rank 1 writes its file 12 s after rank 0 finished: what the tests judge once
    the job ended."""
    proc = subprocess.Popen(
        [sys.executable, str(OUTLIVE_JOB), "--root", str(root), "--outlive", "12", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**job_env(), "PYTHONUNBUFFERED": "1"},
    )
    try:
        rc, out = _finish(proc, timeout=240)
    finally:
        _kill_tree(proc)
        lingering = _alive(root)  # a rank 1 that rank 0 left behind: not in rank 0's process tree any more
        for line in lingering:
            os.kill(int(line.split()[0]), signal.SIGKILL)
    return SimpleNamespace(rc=rc, out=out, written=(root / "rank1.done").exists(), lingering=lingering)


@pytest.fixture(scope="module")
def outliving_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    """Both doors' jobs at once (each mostly runs one process at a time, then sleeps): the Trainer's fits at
    stage 3 then stage 0 on the same ranks; the Fabric one's rank 1 exits with code 3 once its file is written."""
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {
        "trainer": pool.submit(_outliving, tmp_path_factory.mktemp("outlive-trainer"), "--stages", "3", "0"),
        "fabric": pool.submit(
            _outliving, tmp_path_factory.mktemp("outlive-fabric"), "--door", "fabric", "--exit-code", "3"
        ),
    }
    pool.shutdown(wait=True)
    return runs


def test_a_rank_that_outlives_rank_0_is_waited_for_and_the_job_exits_zero(outliving_runs):
    # A slower shard, a slow disk: rank 1 writes its file 12 s after rank 0 finished. Rank 0 waits for it, as
    # torchrun waits for its workers and as under DDPStrategy, however long it takes; no rank is stuck.
    run = outliving_runs["trainer"].result()
    assert run.rc == 0, run.out[-3000:]
    for rank in (0, 1):
        for stage in (3, 0):
            assert f"rank {rank} finished stage {stage} at step 2" in run.out, run.out[-3000:]
    assert run.written, run.out[-3000:]
    assert "stopping it" not in run.out, run.out[-3000:]
    assert not run.lingering, run.lingering


def test_a_rank_that_fails_after_rank_0_succeeded_makes_the_job_fail(outliving_runs):
    # The Fabric door's launcher waits as the Trainer's does; rank 1 then exits with code 3 while rank 0 had
    # finished without error: the job's exit code is rank 1's, as a scheduler must see it.
    run = outliving_runs["fabric"].result()
    assert run.rc == 3, run.out[-3000:]
    assert "rank 0 stepped" in run.out and "rank 1 stepped" in run.out, run.out[-3000:]
    assert run.written, run.out[-3000:]
    assert "rank 1 (pid" in run.out and "exited with code 3" in run.out, run.out[-3000:]
    assert not run.lingering, run.lingering


def test_a_torchrun_restart_reconnects_and_resumes_to_the_uninterrupted_runs_weights(tmp_path, torchrun_job):
    # torchrun's agent keeps its store across restarts; the restarted attempt must not dial the dead
    # attempt's addresses (the default group is keyed by run id and restart count).
    run = _torchrun(
        ["--max-restarts", "1", "--standalone"],
        tmp_path,
        *_engine_args("fsdp"),
        *EXACT,
        *("--die-rank", "1", "--die-step", "7", "--resume", "last"),
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "rank 1 dies at step 7" in out, out[-4000:]
    assert "Restoring states from the checkpoint path at" in out, out[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 starts training at step 4" in out, out[
            -4000:
        ]  # from last: the first epoch's end
        assert f"rank {rank} finished fit at step 8" in out, out[-4000:]
    uninterrupted = _weights(torchrun_job.stdout)
    assert len(uninterrupted) == 1 and _weights(out) == uninterrupted, out[-4000:]
    # The resumed run keeps saving `last` under its name, as after plain saves (no last-v1.ckpt).
    names = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], names
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_torchrun_job_that_loses_a_node_resumes_on_the_one_left_resharded(tmp_path):
    # Two torchrun agents on this host form a 2-node job (--nnodes=1:2, one worker each); the second node is
    # killed whole after a checkpoint. The first agent restarts its worker in a 1-node world, which resumes
    # from `last` (written by 2 ranks, read by 1) and trains to the end.
    port = free_port()
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}",
        "--rdzv-id=lose-a-node",
        "--max-restarts=1",
        "--monitor-interval=0.5",
    ]
    # A node is declared dead 3 s after its last heartbeat (1 s apart), not torch's 15 s (5 s x 3): the
    # restart waits that long for the killed node to leave the rendezvous, then last_call_timeout.
    rdzv_conf = "last_call_timeout=3,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3"
    job = [str(JOB), "--root", str(tmp_path), *_engine_args("fsdp"), "--elastic", "--resume", "last"]
    # Steps sleep in the first attempt only: time for the kill to land mid-training; the restart runs at speed.
    job += ["--max-steps", "10", "--step-sleep", "0.5", "--sleep-first-attempt", "--digest"]
    env = {
        key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    kwargs: dict = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "env": env}
    # The first agent hosts the rendezvous store (it outlives the second node); the second dials it, retrying
    # until it is up, so both start at once.
    first = subprocess.Popen([*torchrun, f"--rdzv-conf={rdzv_conf},is_host=1", *job], **kwargs)
    second = subprocess.Popen([*torchrun, f"--rdzv-conf={rdzv_conf},is_host=0", *job], **kwargs)
    reference: subprocess.Popen | None = None
    ckpts = tmp_path / "checkpoints"

    def start_reference(step: int) -> subprocess.Popen:
        """One process that resumes from the step-``step`` checkpoint and trains to the end uninterrupted."""
        return _torchrun_start(
            ["--standalone"],
            tmp_path / f"reference-{step}",
            *_engine_args("fsdp"),
            *("--elastic", "--every", "0", "--max-steps", "10", "--digest"),
            *("--resume", str(ckpts / f"epoch=0-step={step}.ckpt")),
            workers=1,
        )

    try:
        deadline = time.time() + 180
        while not (ckpts / "epoch=0-step=4.ckpt").exists():
            assert time.time() < deadline and first.poll() is None, "no checkpoint at step 4"
            time.sleep(0.2)
        for pid in _process_tree(second.pid):  # the node: its agent and its worker (in its own session)
            os.kill(pid, signal.SIGKILL)
        # The reference from the step-4 checkpoint runs while the first agent restarts its worker: the step
        # the restart resumes at is `last` when the node died, step 4 unless a later checkpoint was committed
        # before the kill landed (then the reference is run again from that one, below).
        reference = start_reference(4)
        out, _ = first.communicate(timeout=300)
        ref = _torchrun_finish(reference)
    finally:
        for proc in (first, second, *([reference] if reference else [])):
            _kill_tree(proc)
    assert first.returncode == 0, out[-4000:]
    # The first attempt on 2 nodes, then torchrun's one restart on the node left.
    starts = re.findall(r"rank 0 of (\d) starts training at step (\d+)\nrank 0 torchrun restart (\d)", out)
    assert len(starts) == 2 and starts[0] == ("2", "0", "0"), (starts, out[-4000:])
    world, step, restart = starts[1]
    resumed = int(step)
    assert (world, restart) == ("1", "1"), (starts, out[-4000:])
    # From `last` as it was when the node died: a checkpoint written at step 4 or later, every 2 steps.
    assert "Restoring states from the checkpoint path at" in out, out[-4000:]
    assert resumed >= 4 and (ckpts / f"epoch=0-step={resumed}.ckpt").is_dir(), resumed
    assert "rank 0 finished fit at step 10" in out, out[-4000:]
    assert not list(tmp_path.rglob("*.tmp"))
    # The same weights as one process that resumes from that checkpoint and trains to the end uninterrupted.
    if resumed != 4:
        ref = _torchrun_finish(start_reference(resumed))
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    assert f"rank 0 of 1 starts training at step {resumed}" in ref.stdout, ref.stdout[-4000:]
    expected = _weights(ref.stdout)
    assert len(expected) == 1 and _weights(out) == expected, (out[-2000:], ref.stdout[-2000:])
