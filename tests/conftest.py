import importlib.util

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip exactly the tests marked ``deepspeed`` (or ``cuda``) where that is missing.

    The marker is the one place a test says what it needs, so a module never skips whole because
    some of its tests need DeepSpeed; everything unmarked runs everywhere.
    """
    missing = {}
    if importlib.util.find_spec("deepspeed") is None:
        missing["deepspeed"] = (
            "needs DeepSpeed: pip install --no-build-isolation -e '.[deepspeed]' (after torch)"
        )
    if any(item.get_closest_marker("cuda") for item in items):
        import torch

        if not torch.cuda.is_available():
            missing["cuda"] = "needs a CUDA device"
    for item in items:
        for name, reason in missing.items():
            if item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
