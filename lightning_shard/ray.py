"""ShardStrategy inside Ray Train workers: :class:`RayShardStrategy` (``pip install 'lightning-shard[ray]'``).

Ray's ``TorchTrainer`` starts one process per worker, gives each its device and makes the process group
before the training function runs. :class:`RayShardStrategy` takes the flags of :class:`ShardStrategy` and
reads all of this from Ray instead of from Lightning's launcher:

* the device from ``ray.train.torch.get_device()`` (each worker sees one device, so Lightning's
  ``parallel_devices[local_rank]`` does not exist on the second worker of a node);
* ranks and world size from ``RayLightningEnvironment`` (Ray's train context), and the device mesh laid out
  over Ray's world size rather than ``num_nodes * devices`` (one per worker);
* the default process group Ray made, joined as it is (never a second one) and left for Ray to destroy;
  the ``timeout`` flag applies to the groups this package makes (the mesh's, DeepSpeed's); Ray's own group
  takes ``TorchConfig(timeout_s=...)``.

``ray.train.lightning.prepare_trainer`` accepts only Ray's three Lightning strategies (an ``isinstance``
check); importing this module registers :class:`RayShardStrategy` as a virtual subclass of
``RayDDPStrategy`` (``abc.ABCMeta.register``), which inherits none of its behaviour. Checks of the form
``isinstance(strategy, DDPStrategy)`` are then true as well (in Lightning 2.6 they only mark a strategy
distributed and allow ``torch.compile``'d modules, both already so for this strategy).

Checkpoints under ``RayTrainReportCallback``: every worker saves into a directory of its own
(``<tmp>/...world_rank=R/<epoch>/checkpoint.ckpt``, on its own host) and Ray merges the directories the
workers report into one checkpoint in storage. When the ranks' paths differ, each rank therefore writes
its own shards under its own path (rank 0 adds DCP's ``.metadata`` and Lightning's ``meta.pt``; DeepSpeed's
per-rank files likewise), through the same commit protocol: a fresh ``NAME.tmp`` per rank, renamed to
``NAME`` once every rank's part is on disk. Shard file names carry the rank, so the merged checkpoint is
whole; resuming reads it from each rank's own copy (``Checkpoint.as_directory()`` may download it per
node). When every rank is given the same path (a shared file system or object store, as with
``ModelCheckpoint``) the checkpoint is written as under :class:`ShardStrategy`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment
from typing_extensions import override

from lightning_shard.checkpoint import TMP_SUFFIX, commit, remove
from lightning_shard.checkpoint.storage import Location, Remote, resolve
from lightning_shard.core.process_groups import parallel_dims
from lightning_shard.core.processes import guarded
from lightning_shard.flags import args_doc, takes_flags
from lightning_shard.parallel import ParallelDims
from lightning_shard.trainer.strategy import ShardStrategy

__all__ = ["RayShardStrategy"]

log = logging.getLogger(__name__)

_FIX = (
    "Build the Trainer inside the training function of ray.train.torch.TorchTrainer(train_func, ...), with"
    " plugins=[ray.train.lightning.RayLightningEnvironment()]; outside Ray use ShardStrategy."
)


def _outside_ray(what: str, error: BaseException) -> RuntimeError:
    return RuntimeError(
        f"RayShardStrategy takes {what} from Ray Train, but this process is not a Ray Train worker ({error})."
        f" {_FIX}"
    )


class RayShardStrategy(ShardStrategy):
    """:class:`~lightning_shard.ShardStrategy` (the same flags) inside Ray Train ``TorchTrainer`` workers.

    Use it where Ray's guide uses ``RayDDPStrategy``/``RayFSDPStrategy``/``RayDeepSpeedStrategy``::

        trainer = L.Trainer(devices="auto", accelerator="auto", strategy=RayShardStrategy(stage=3),
                            plugins=[RayLightningEnvironment()], callbacks=[RayTrainReportCallback()])
        trainer = ray.train.lightning.prepare_trainer(trainer)

    ``process_group_backend`` must match the group Ray made (``TorchConfig(backend=...)``) or be left unset.
    """

    strategy_name = "ray_shard"

    @takes_flags
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._own_copies: set[str] = set()  # checkpoints written per rank, each rank's path its own

    __doc__ = (__doc__ or "").rstrip() + "\n\n" + args_doc() + "\n"

    def __repr__(self) -> str:
        return f"RayShardStrategy(stage={self.config.stage!r}, engine={self.config.engine!r})"

    # --- processes: Ray's ------------------------------------------------------------------------

    def _check_ray(self) -> None:
        env = self.cluster_environment
        if not isinstance(env, RayLightningEnvironment):
            raise RuntimeError(
                "RayShardStrategy takes ranks and world size from Ray Train's context, but the Trainer's cluster"
                f" environment is {type(env).__name__}. Pass plugins=[RayLightningEnvironment()] to L.Trainer"
                " (from ray.train.lightning import RayLightningEnvironment)."
            )
        try:
            ray.train.get_context()
        except RuntimeError as error:
            raise _outside_ray("ranks and world size", error) from error

    @property
    @override
    def root_device(self) -> torch.device:
        try:
            return ray.train.torch.get_device()
        except RuntimeError as error:
            raise _outside_ray("the device", error) from error

    @property
    @override
    def dims(self) -> ParallelDims:
        # Ray starts one process per worker: the world is Ray's, not num_nodes x devices.
        return parallel_dims(self.config, self.world_size)

    @override
    def set_world_ranks(self) -> None:
        # The first place Lightning reads the ranks (while the Trainer is built): outside Ray, or without
        # Ray's environment, fail here with the fix rather than inside Ray's context lookup.
        self._check_ray()
        super().set_world_ranks()  # Ray's environment keeps its own ranks; this sets rank_zero_only's

    @override
    def _configure_launcher(self) -> None:
        # Runs while the Trainer is built: a missing RayLightningEnvironment or a layout that does not
        # divide Ray's world fails here. Ray made the processes: no launcher.
        self._check_ray()
        self.dims  # noqa: B018
        self._launcher = None

    @override
    def setup_environment(self) -> None:
        self._check_ray()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "RayShardStrategy joins the process group Ray Train makes for its workers, but none exists in"
                " this worker. Run the Trainer under ray.train.torch.TorchTrainer (it makes the group), not a"
                f" trainer without torch's backend. {_FIX}"
            )
        ray_world = ray.train.get_context().get_world_size()
        if dist.get_world_size() != ray_world:
            raise RuntimeError(
                f"RayShardStrategy: the default process group has {dist.get_world_size()} ranks but Ray Train"
                f" has {ray_world} workers; leave the group Ray makes in place (do not re-create it)."
            )
        backend = dist.get_backend()
        if self._requested_backend not in (None, backend):
            raise ValueError(
                f"RayShardStrategy(process_group_backend={self._requested_backend!r}) differs from the {backend!r}"
                " group Ray Train made. Leave process_group_backend unset, or choose the backend with"
                f" TorchTrainer(torch_config=TorchConfig(backend={self._requested_backend!r}))."
            )
        self._requested_backend = backend
        super().setup_environment()

    # --- checkpoints: each rank's own copy where the paths differ ---------------------------------

    @override
    def _checkpoint_location(self, filepath: Any, argument: str) -> Location:
        # Each worker names its own directory (RayTrainReportCallback) or its own copy of a checkpoint
        # to resume from (Checkpoint.as_directory() downloads it per node): rank 0's path may not exist
        # on another host.
        return resolve(str(filepath), argument)

    @guarded
    def _paths_differ(self, filepath: Any) -> bool:
        paths: list[Any] = [None] * self.world_size
        dist.all_gather_object(paths, str(filepath))
        return len(set(paths)) > 1

    @override
    def _save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, exception: bool) -> None:
        if self.config.checkpoint == "full" or not self._paths_differ(filepath):
            # One file, written by rank 0 alone; or one path for all ranks: one shared checkpoint.
            super()._save_checkpoint(checkpoint, filepath, exception)
            return
        path = resolve(str(filepath), "save_checkpoint(filepath)")
        if isinstance(path, Remote):
            raise ValueError(
                f"RayShardStrategy.save_checkpoint(filepath={str(filepath)!r}): the ranks gave different paths"
                " on an object store, where a checkpoint is committed once, by rank 0. Give every rank the same"
                " URL, or a local path each (as RayTrainReportCallback does)."
            )
        tmp = path.with_name(path.name + TMP_SUFFIX)
        if self.global_rank != 0:
            # Rank 0's engine prepares its own NAME.tmp; every other rank's is prepared here, before the
            # engine's first barrier, so no rank writes into a stale or missing directory.
            remove(tmp)
            tmp.mkdir(parents=True)
        # Written whole (never a link to another checkpoint: the link would name rank 0's path) and
        # waited for: the caller hands the directory to Ray as soon as this returns.
        super()._save_checkpoint(checkpoint, filepath, exception=True)
        self._engines.wait_for_checkpoints()
        if self.global_rank != 0:
            commit(tmp, path)
        self.barrier("RayShardStrategy.save_checkpoint")
        self._own_copies.add(str(path))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if str(filepath) in self._own_copies:
            self._own_copies.discard(str(filepath))
            remove(Path(filepath))  # this rank's own copy
            return
        super().remove_checkpoint(filepath)


# Ray's prepare_trainer accepts RayDDPStrategy and its subclasses only (isinstance).
RayDDPStrategy.register(RayShardStrategy)
