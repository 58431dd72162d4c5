import compileall
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_DEEPSPEED_INSTALL = "needs DeepSpeed: pip install --no-build-isolation -e '.[deepspeed]' (after torch)"


def _missing_cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device"


def _missing_fp16_cpu() -> str | None:
    from lightning_shard.engines.deepspeed.precision import cpu_supports_fp16

    if cpu_supports_fp16():
        return None
    return (
        "needs a CPU with fp16 support in DeepSpeed's CPU accelerator: torch.ops.mkldnn._is_mkldnn_fp16_supported()"
        " is False here (no AVX512-FP16 / AMX-FP16, e.g. AMD EPYC), so DeepSpeed 16-mixed is refused on this CPU"
    )


def _missing_libaio() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return _DEEPSPEED_INSTALL  # the probe below is DeepSpeed's
    from lightning_shard.offload import require_libaio

    try:
        require_libaio()  # the very check ShardStrategy makes for NVMe offload
    except ValueError:
        return "needs libaio for DeepSpeed's NVMe offload: apt-get install libaio-dev"
    return None


def _missing_torchao() -> str | None:
    if importlib.util.find_spec("torchao") is not None:
        return None
    return "needs torchao for fp8: pip install -e '.[fp8]'"


def _missing_deepspeed() -> str | None:
    return None if importlib.util.find_spec("deepspeed") is not None else _DEEPSPEED_INSTALL


#: What each marker needs, probed only when a collected test carries the marker: None when present,
#: else the skip reason (what is missing and how to get it).
_NEEDS: dict[str, Callable[[], str | None]] = {
    "deepspeed": _missing_deepspeed,
    "cuda": _missing_cuda,
    "needs_fp16_cpu": _missing_fp16_cpu,
    "needs_libaio": _missing_libaio,
    "torchao": _missing_torchao,
}


#: The test files that take longest (a 2-core machine, longest first), run first: pytest-xdist hands each
#: worker whole files in collection order (``--dist loadfile --no-loadscope-reorder``), so the long ones start
#: at once and the short ones fill in around them. Files not named here follow in their usual order.
_LONGEST_FIRST = (
    "test_fault_tolerance_multirank",
    "test_exit_multirank",
    "test_ray_multirank",
    "test_readme",
    "test_slurm_multirank",
    "test_pipeline_multirank",
    "test_benchmarks_smoke",
    "test_lightning_callbacks_multirank",
    "test_parallel_multirank",
    "test_lifecycle_multirank",
    "test_fabric_multirank",
    "test_expert_parallel_multirank",
    "test_export_bench_smoke",
    "test_context_parallel_multirank",
    "test_s3_multirank",
    "test_parallel_torchrun",
    "test_deepspeed_multirank",
    "test_pipeline_checkpoint_multirank",
    "test_parity_multirank",
    "test_ema_multirank",
)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per two cores plus two, at most 4 (3 on 2 cores). A multi-rank test runs 2-4
    processes, but they spend much of their time waiting (ranks starting, a timeout that is the test's subject,
    a restart, a quorum): on 2 cores, 2 workers kept the cores busy about 65% of the suite's time, 3 about 95%."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return min(cores // 2 + 2, 4)


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker computes with its share of the cores: torch's default (a thread per core in each worker)
    puts 2 threads per worker on each core here, which wait on each other (a tensor-parallel pair in one process
    took seconds a step on a busy machine). ``-n 0`` keeps torch's default."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // int(workers)))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the package's and the tests' bytecode once, before any test: the suite starts a few hundred
    interpreters (launched jobs, torchrun agents, Ray workers) that would each compile them again where
    ``PYTHONDONTWRITEBYTECODE`` is set (about 1.5 s of CPU each here). Installed libraries have theirs from pip."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller has done it
    root = Path(__file__).resolve().parent.parent
    for folder in ("lightning_shard", "tests", "examples", "benchmarks"):
        if (root / folder).is_dir():
            compileall.compile_dir(root / folder, quiet=2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip exactly the tests whose markers name something this machine lacks, with the reason; the longest
    files first.

    The marker is the one place a test says what it needs, so a module never skips whole because
    some of its tests need DeepSpeed or some hardware; everything unmarked runs everywhere.
    """
    place = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    # A stable sort: the tests of a file keep their order.
    items.sort(key=lambda item: place.get(item.path.stem, len(place)))
    for name, probe in _NEEDS.items():
        marked = [item for item in items if item.get_closest_marker(name) is not None]
        reason = probe() if marked else None
        if reason is not None:
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _process_group_as_found() -> Iterator[None]:
    """A default process group that a test's in-process ``fit`` left alive (as Lightning's strategies do, until
    the process exits) is destroyed after that test, so the next file on this worker starts as in a new process,
    whichever files ran before it there; one that was alive before the test is left alone."""
    import torch.distributed as dist

    alive = dist.is_available() and dist.is_initialized()
    yield
    if not alive and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _rank_zero_as_found() -> Iterator[None]:
    """Each test leaves the process's rank-zero rank as it found it: Lightning's environments set it process-wide
    (``LightningEnvironment.set_global_rank`` of a test that plays rank 3 left every later in-process
    ``rank_zero_warn`` silent, so a test asserting a warning failed or passed by the order the tests ran in)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", None)
    yield
    if rank is not None:
        rank_zero_only.rank = rank
