"""Every private torch / Lightning Fabric API below the doors, imported here and nowhere else (the Trainer's own
are in :mod:`lightning_shard.trainer._compat`).

Each one is imported under a guard. Where the public API can do the same job, a fallback written on
it takes over when a release removes the private one (the tests run every fallback against the real
thing); where nothing public can, using it raises an error naming the API and the versions this
package was tested with, so a new release degrades one feature instead of breaking
``import lightning_shard``. docs/compatibility.md lists them all, with the ones outside the core.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

TESTED = "torch 2.6-2.13, lightning 2.5-2.6"


def _unavailable(name: str, error: Exception) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"lightning_shard needs {name}, which this torch / lightning release does not have ({error})."
            f" It was tested with {TESTED}: install one of those versions."
        ) from error

    return fail


# --- process groups (lightning.fabric.utilities.distributed) ---------------------------------------


def distributed_is_initialized_fallback() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_backend_fallback(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def sync_ddp_fallback(tensor: torch.Tensor, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
    if not distributed_is_initialized_fallback():
        return tensor
    op = str(reduce_op).lower().rsplit(".", 1)[-1]
    out = tensor.clone()
    if op in ("max", "min"):
        dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
        return out
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    if op in ("mean", "avg"):
        out = out / dist.get_world_size(group)
    return out


try:
    from lightning.fabric.utilities.distributed import (
        _distributed_is_initialized as distributed_is_initialized,
    )
    from lightning.fabric.utilities.distributed import (
        _get_default_process_group_backend_for_device as default_backend,
    )
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp
except ImportError:  # pragma: no cover  (exercised through the fallbacks' own tests)
    distributed_is_initialized = distributed_is_initialized_fallback
    default_backend = default_backend_fallback
    sync_ddp = sync_ddp_fallback  # type: ignore[assignment]


# --- modules and optimizers -------------------------------------------------------------------------


def optimizers_to_device_fallback(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device != device and key != "step":
                    state[key] = value.to(device)


try:
    from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
except ImportError:  # pragma: no cover
    optimizers_to_device = optimizers_to_device_fallback  # type: ignore[assignment]


# --- process groups torch keeps, and FSDP2's cached ones ------------------------------------------


def live_process_groups_fallback() -> list[Any]:
    return [dist.group.WORLD] if dist.is_available() and dist.is_initialized() else []


def live_process_groups() -> list[Any]:
    """Every process group alive in this process: the default one, meshes', engines' (DeepSpeed's)."""
    try:  # private torch API, imported where used: a release without it takes the fallback
        from torch.distributed.distributed_c10d import _world

        return list(_world.pg_map)
    except (ImportError, AttributeError):  # pragma: no cover  (a release without the registry)
        return live_process_groups_fallback()


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Join torch's fake process group as ``rank`` of ``world_size``: every collective returns at once, nothing
    is sent (the dry run builds one rank's shards of a large world in this one process)."""
    # private torch module, imported where used: importing it registers the "fake" backend
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


@contextmanager
def ddp_without_shape_check() -> Iterator[None]:
    """DDP built over parameters on the meta device (the dry run's stages 0-1): its check that every rank holds
    the same shapes reads the gathered sizes back as numbers, which meta tensors do not hold. The dry run's ranks
    are built from one module, so there is nothing to check."""
    try:  # private torch API: DDP's module-level name for the check
        import torch.nn.parallel.distributed as ddp_module

        check = ddp_module._verify_param_shape_across_processes
    except (ImportError, AttributeError):  # pragma: no cover  (a release without it: DDP then refuses meta)
        yield
        return
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = check


def fsdp_padded_shards(model: torch.nn.Module) -> dict[int, int]:
    """``{id(parameter): elements}`` of each FSDP2 parameter's padded local shard (what the rank allocates:
    uneven shards are padded to the largest); ``{}`` where a release lacks FSDP2's private parameter records
    (the caller then counts the unpadded local tensors)."""
    found: dict[int, int] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:  # private torch API: the FSDP state and its parameter group
            group = module._get_fsdp_state()._fsdp_param_group
            params = [] if group is None else group.fsdp_params
            for fsdp_param in params:
                found[id(fsdp_param.sharded_param)] = fsdp_param._sharded_param_data.numel()
        except AttributeError:  # pragma: no cover  (a release without them)
            return {}
    return found


def fsdp_units(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Each FSDP2 unit of ``model``: its padded local elements, the bytes of an element as gathered and as
    reduced (the mixed-precision policy's), the sizes of its shard and replicate groups, and whether forward
    reshards it (gathered again in backward). ``[]`` where a release lacks FSDP2's private records."""
    units, seen = [], set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:  # private torch API: the FSDP state, its parameter group and mesh records
            group = module._get_fsdp_state()._fsdp_param_group
            # The modules of a grouped unit (``fully_shard([block, block])``) share one state: counted once.
            if group is None or not group.fsdp_params or id(group) in seen:
                continue
            seen.add(id(group))
            info, policy = group.mesh_info, group.mp_policy
            dtype = group.fsdp_params[0].sharded_param.dtype
            units.append(
                {
                    "elements": sum(p._sharded_param_data.numel() for p in group.fsdp_params),
                    "gather_bytes": (policy.param_dtype or dtype).itemsize,
                    "reduce_bytes": (policy.reduce_dtype or policy.param_dtype or dtype).itemsize,
                    "shard": getattr(info, "shard_mesh_size", 1),
                    "replicate": getattr(info, "replicate_mesh_size", 1),
                    "reshards": group.post_forward_mesh_info is not None,
                }
            )
        except AttributeError:  # pragma: no cover  (a release without them)
            return []
    return units


def unflatten_mesh(root: Any, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any | None:
    """``DeviceMesh._unflatten`` (torch >= 2.9): a view of the 1-D ``root`` as ``sizes`` named ``names``,
    sharing its root; ``None`` where torch lacks it (the caller then builds a mesh of its own)."""
    unflatten = getattr(root, "_unflatten", None)
    return None if unflatten is None else unflatten(0, sizes, names)


def fsdp_is_unsharded(module: Any) -> bool:
    """Whether an ``FSDPModule`` holds its parameters gathered right now (between unshard and reshard)."""
    try:
        group = module._get_fsdp_state()._fsdp_param_group
    except AttributeError as error:  # pragma: no cover
        _unavailable("FSDPModule._get_fsdp_state()._fsdp_param_group", error)()
    return group is not None and bool(group.is_unsharded)


def fsdp_keep_gathered_after_nested_forward(root: Any) -> None:
    """Have the root keep its parameters gathered to backward when its forward ran inside its own forward.

    A ``training_step`` routed through the root's forward that calls ``self(x)`` runs the root's forward
    twice, nested. The inner call's end leaves the root's group idle, so the outer call's end reshards it
    whatever ``reshard_after_forward`` says, and backward gathers it again: one more all-gather of the
    root's parameters (embeddings and head, often a third of a language model) every step. Marking the
    still-gathered group as in forward again lets the outer end keep it, as a single forward would.
    """
    try:  # private torch API, imported where used: a release without it costs one more gather
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        groups = root._get_fsdp_state()._fsdp_param_groups
    except (ImportError, AttributeError):  # pragma: no cover  (a release that moved them: one more gather)
        return
    for group in groups:
        if (
            group._training_state == TrainingState.IDLE
            and group.is_unsharded
            and not group._reshard_after_forward
        ):
            group._training_state = TrainingState.FORWARD


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpointed block's recompute)."""
    current = getattr(torch._C, "_current_graph_task_id", None)  # private torch API
    return current is not None and current() != -1


def fsdp_forward_hooks(module: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """FSDP2's own pre- and post-forward of ``module``: ``pre(module, args, kwargs) -> (args, kwargs)``,
    ``post(module, args, output) -> output``.

    What torch's ``register_fsdp_forward_method`` runs around a method, here the root's run around a call
    to one of its submodules: the root's parameters gathered, inputs cast and moved, backward hooks set.
    """
    try:
        state = module._get_fsdp_state()
        return state._pre_forward, state._post_forward
    except AttributeError as error:  # pragma: no cover
        fail = _unavailable("FSDPState._pre_forward / _post_forward", error)
        return fail, fail


def dynamo_skips_for_dispatch_mode() -> bool:
    """Whether dynamo would refuse to compile a frame now, for a torch dispatch mode on the stack.

    Dynamo runs such a frame eagerly and remembers the refusal on its code object for good: a compiled
    block whose first call meets a FLOP counter (``MFUMonitor``'s first step) never compiles after it.
    The checks are dynamo's own: modes that are infra or ignore compile internals (selective activation
    checkpointing's) do not count.
    """
    try:  # private torch API, imported where used: a release without it takes the fallback
        import torch._dynamo.config as dynamo_config
        from torch.utils import _python_dispatch as dispatch

        if getattr(dynamo_config, "inline_torch_dispatch_torch_compile", False):
            return bool(dispatch.any_torch_dispatch_mode_on_stack())
        return bool(dispatch.is_in_any_mode_without_ignore_compile_internals())
    except (ImportError, AttributeError):  # pragma: no cover  (an older release: any user mode counts)
        return dynamo_skips_for_dispatch_mode_fallback()


def dynamo_skips_for_dispatch_mode_fallback() -> bool:
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode  # private torch API, used only here

    return is_in_torch_dispatch_mode(include_infra_modes=False)


def queue_fsdp_post_backward(root: Any) -> None:
    """From inside a backward: have FSDP2 reduce every gathered group's gradients when it ends.

    FSDP2 queues this itself from hooks its modules' post-forward leaves on their outputs; a backward
    that runs inside the root's forward (manual optimization routed through it) meets none of the
    root's, and the root's gradients would never reach its shards before the optimizer steps.
    """
    try:
        root._get_fsdp_state()._register_root_post_backward_final_callback()
    except AttributeError as error:  # pragma: no cover
        _unavailable("FSDPState._register_root_post_backward_final_callback", error)()


def refresh_fsdp_groups(module: torch.nn.Module) -> None:
    """Point the modules ``fully_shard`` wrapped at their meshes' current process groups.

    FSDP2 caches each mesh's process group objects when it shards a module; the mesh itself looks
    its groups up by name. After the groups were destroyed and made again under the same names (one
    Trainer call's teardown, the next call's set-up), the cached objects are refreshed from the mesh.
    """
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        try:
            groups = sub._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
        except AttributeError as error:  # pragma: no cover
            _unavailable("FSDPModule._get_fsdp_state()._fsdp_param_groups", error)()
        for group in groups:
            infos = [group.mesh_info, group.post_forward_mesh_info]
            for param in group.fsdp_params:
                infos += [param.mesh_info, param.post_forward_mesh_info]
            for info in infos:
                if info is None:
                    continue
                for attr, dim in (
                    ("shard_process_group", "shard_mesh_dim"),
                    ("replicate_process_group", "replicate_mesh_dim"),
                ):
                    if getattr(info, attr, None) is not None:
                        setattr(info, attr, info.mesh.get_group(getattr(info, dim)))
                if hasattr(info, "reduce_scatter_process_group"):
                    info.reduce_scatter_process_group = None


# --- torch.distributed.checkpoint's key flattening ----------------------------------------------------


def flatten_state_dict_fallback(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's flattening of nested dicts and lists: keys joined with ".", as its ``.metadata`` stores them."""
    flat: dict[str, Any] = {}
    mapping: dict[str, Any] = {}

    def visit(value: Any, path: tuple[str, ...]) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                visit(item, (*path, str(key)))
        elif isinstance(value, list) and any(isinstance(item, (Mapping, list)) for item in value):
            for index, item in enumerate(value):
                visit(item, (*path, str(index)))
        else:
            flat[".".join(path)] = value
            mapping[".".join(path)] = path

    visit(state, ())
    return flat, mapping


try:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
except ImportError:  # pragma: no cover
    flatten_state_dict = flatten_state_dict_fallback  # type: ignore[assignment]


# --- torch's extension build root (public: torch documents TORCH_EXTENSIONS_DIR and its default) ----


def build_directory() -> Path:
    """The root under which torch JIT-builds C++ extensions (DeepSpeed's CPU-Adam, async I/O)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "torch_extensions"


def build_per_environment() -> None:
    """Give this Python environment its own extension build root, unless ``TORCH_EXTENSIONS_DIR`` is set.

    torch's default root is one per user and Python version, while each build records the environment's
    include paths: two virtual environments on one machine rebuild each other's DeepSpeed ops (minutes each)
    whenever they take turns. Set in ``os.environ``, so the ranks a job starts build and load in the same place.
    """
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    tag = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(build_directory() / f"{version}-env-{tag}")


def ring_attention_module(module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``module`` (one ``F.scaled_dot_product_attention`` call on ``(b, h, t, d)``) run as torch's ring
    attention over ``mesh``: its inputs become DTensors sharded along the sequence, its output local again.

    Private (torch 2.7+, ``torch.distributed.tensor.experimental._attention``): ``_ContextParallel`` and
    ``_enable_context_parallel_dispatcher``; the public ``context_parallel`` context manager shards buffers
    itself, where the strategy has already cut the batch. CUDA SDPA kernels only.
    """
    try:  # private torch API, may move between releases
        from torch.distributed.tensor.experimental._attention import (
            _ContextParallel,
            _enable_context_parallel_dispatcher,
        )
    except ImportError as error:
        raise RuntimeError(
            "context_parallel_method='ring' needs torch's private _ContextParallel /"
            f" _enable_context_parallel_dispatcher (tested with torch 2.13): {error}. Use"
            " context_parallel_method='allgather'."
        ) from error
    _enable_context_parallel_dispatcher()
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    return style._apply(module, mesh)
