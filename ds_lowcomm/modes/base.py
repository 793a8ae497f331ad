"""The :class:`Mode` interface every mode implements, and the checks modes share."""
from __future__ import annotations

import abc
from typing import ClassVar, Dict, Optional

import torch

from ds_lowcomm.checkpoint import CheckpointError
from ds_lowcomm.config import LowCommConfigError
from ds_lowcomm.shard.context import ModeContext


class Mode(abc.ABC):
    """The algorithm behind a :class:`~ds_lowcomm.optimizer.LowCommOptimizer`.

    The optimizer owns the flat buffers, the gradient accumulator, the topology and the comm
    worker, and hands the mode a :class:`ModeContext` of them; the mode owns its optimizer state
    and decides what rounds to run and when.
    """

    name: ClassVar[str]
    Options: ClassVar[type]
    #: the mode decides when an optimizer step is taken (it calls ``ctx.step_taken()``);
    #: DeepSpeed's engine then never sees an accumulation boundary of its own
    drives_steps: ClassVar[bool] = False
    #: :meth:`rank_state_dict` returns state tied to this rank (a resume then needs the layout
    #: the checkpoint was saved with; the sharded state alone reshards)
    has_rank_state: ClassVar[bool] = False
    #: ``lowcomm.pace: "fastest"`` works here: the mode's rounds carry the
    #: :class:`~ds_lowcomm.shard.pace.Pacer`'s weights and paces over the whole world
    paces: ClassVar[bool] = False

    def __init__(self, ctx: ModeContext, options) -> None:
        self.ctx = ctx
        self.options = options

    @classmethod
    def is_asynchronous(cls, options) -> bool:
        """Whether rounds run on a background CommWorker thread / side stream instead of inline."""
        return False

    @classmethod
    def check_config(cls, ds: dict, cfg) -> None:
        """Reject settings this mode cannot run: ``ds`` the DeepSpeed JSON, ``cfg`` the parsed
        :class:`~ds_lowcomm.config.LowCommConfig` (raise ``LowCommConfigError``)."""

    @classmethod
    def pace_block(cls, options, gradient_accumulation_steps: int) -> int:
        """Micro-batches per block the :class:`~ds_lowcomm.shard.pace.Pacer` plans (one round's sums)."""
        return gradient_accumulation_steps

    def bind_loop(self, marks_boundaries: bool) -> None:
        """Called once, before the first backward pass: whether the loop marks its own
        accumulation boundaries (``set_gradient_accumulation_boundary``: the Trainer, accelerate,
        TRL) or lets DeepSpeed count micro-batches (``engine.step()`` after each). Raise
        ``LowCommConfigError`` for a setting this loop cannot run."""

    def paces_in_loop(self) -> bool:
        """After :meth:`bind_loop`: whether ``lowcomm.pace`` applies in this loop (``paces`` modes)."""
        return self.paces

    def on_backward_start(self, boundary: bool) -> None:
        """Called before every backward pass; ``boundary`` is DeepSpeed's accumulation boundary."""

    def on_micro_batch_end(self, boundary: bool) -> None:
        """Called after every backward pass; ``boundary`` is DeepSpeed's accumulation boundary."""

    @abc.abstractmethod
    def step(self) -> None:
        """At an accumulation boundary: communicate and update (possibly asynchronously)."""

    def flush(self) -> None:
        """Finish and install any round in flight, so the model holds the latest update."""

    def settle(self) -> None:
        """Make the optimizer state stable and the same step on every rank, without changing the
        model (collective). The engine calls it once before a checkpoint is tagged and written and
        once before one is loaded; the state methods below assume it and communicate nothing."""

    @abc.abstractmethod
    def master_weights(self) -> torch.Tensor:
        """The full fp32 master weights, unpadded flat (collective: every rank must call it)."""

    # -- state: no communication in any of these (tests/test_checkpoint.py counts); the engine
    # settles first, and reads and writes files through the Checkpointer

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Small metadata of the optimizer state (counters, flags): what goes into the model file.
        No communication, no parameter-sized tensors."""

    @abc.abstractmethod
    def sharded_state(self) -> Dict[str, torch.Tensor]:
        """This rank's shards of the flat state, written to its own file as they are (no copy,
        no communication); read back by a :class:`~ds_lowcomm.checkpoint.ShardReader` at any
        layout."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict, shards) -> None:
        """Restore from :meth:`state_dict` and the shards (a ``ShardReader``)."""

    @abc.abstractmethod
    def load_weights(self, shards) -> None:
        """Take the fp32 master from the shards (any mode's checkpoint); everything else
        restarts, and the model gets the master."""

    def metrics(self) -> dict:
        """Mode-specific numbers for :meth:`LowCommOptimizer.comm_stats`."""
        return {}

    def rank_state_dict(self) -> Optional[dict]:
        """State tied to this rank and layout (saved in its file beside its shards), or None."""
        return None

    def load_rank_state_dict(self, state: dict) -> None:
        """Restore from :meth:`rank_state_dict` of the same rank, saved with this layout."""

    def reshard_rank_state(self, shards) -> None:
        """Rebuild the per-rank state of a checkpoint saved with another world size or
        ``shard_group_size`` (after :meth:`load_state_dict`), from the saved ranks' state read
        through ``shards`` (no communication), where that has a meaning; otherwise raise a
        ``CheckpointError`` naming the way out."""
        raise CheckpointError(
            f"this {self.name} checkpoint holds per-rank state for {shards.meta['world_size']} ranks in "
            f"shard groups of {shards.meta['shard_group_size']}, which does not carry over to another "
            f"layout; resume with that layout, or load with load_optimizer_states=False to keep only "
            f"the weights")


def require_one_shard_group(ctx: ModeContext, mode: str) -> None:
    """For modes that shard over the whole world: reject a smaller ``shard_group_size`` (the shard
    groups would otherwise train as independent replicas, silently)."""
    topo = ctx.topology
    if topo.replica is not None:
        raise LowCommConfigError(
            f"lowcomm.shard_group_size: got {topo.shard_group_size}; mode {mode!r} shards over all "
            f"{topo.world_size} ranks, remove the key or set it to {topo.world_size}")


def require_shard_group_size(cfg, mode: str, why: str) -> None:
    """For modes whose replicas are the shard groups: ``shard_group_size`` must be given."""
    if cfg.shard_group_size is None:
        raise LowCommConfigError(f"lowcomm.shard_group_size: mode {mode!r} {why}; set it to the ranks per "
                                 f"node (1 = every rank its own replica)")
