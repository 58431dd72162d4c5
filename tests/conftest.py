import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
# Spawned ranks re-import test modules by name: they need the same paths.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])


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
