import importlib.util
from collections.abc import Callable, Iterator

import pytest

_DEEPSPEED_INSTALL = "needs DeepSpeed: pip install --no-build-isolation -e '.[deepspeed]' (after torch)"


def _missing_cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device"


def _missing_fp16_cpu() -> str | None:
    from lightning_shard.engines._deepspeed_precision import cpu_supports_fp16

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip exactly the tests whose markers name something this machine lacks, with the reason.

    The marker is the one place a test says what it needs, so a module never skips whole because
    some of its tests need DeepSpeed or some hardware; everything unmarked runs everywhere.
    """
    for name, probe in _NEEDS.items():
        marked = [item for item in items if item.get_closest_marker(name) is not None]
        reason = probe() if marked else None
        if reason is not None:
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=reason))


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
