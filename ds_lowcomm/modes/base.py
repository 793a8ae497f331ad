"""The :class:`Mode` interface every mode implements, and the checks modes share."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar, Dict, Optional

import torch

from ds_lowcomm.checkpoint import ShardReader
from ds_lowcomm.config import LowCommConfigError
from ds_lowcomm.shard.context import ModeContext


@dataclass
class ModeState:
    """What a checkpoint keeps of a mode, as :meth:`Mode.state` describes it (torch's
    ``Stateful``, Megatron's ``sharded_state_dict``): built without communication, of the
    tensors themselves (the :class:`~ds_lowcomm.checkpoint.Checkpointer` writes or copies them)."""

    #: small metadata (counters, flags; no parameter-sized tensors): into DeepSpeed's model file
    meta: dict
    #: this rank's shards of the flat state, keyed by name: into its own file, read back at any
    #: layout by a :class:`~ds_lowcomm.checkpoint.ShardReader`
    sharded: Dict[str, torch.Tensor]
    #: state tied to this rank and the layout (world size, shard group size): into its own file;
    #: None when the mode has none (:meth:`Mode.restore` then gets {} at the same layout)
    rank: Optional[dict] = field(default=None)


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
    #: ``lowcomm.pace: "fastest"`` works here: the mode's rounds carry the
    #: :class:`~ds_lowcomm.shard.pace.Pacer`'s weights and paces over the whole world
    paces: ClassVar[bool] = False

    def __init__(self, ctx: ModeContext, options) -> None:
        self.ctx = ctx
        self.options = options

    @classmethod
    def is_asynchronous(cls, options) -> bool:
        """Whether rounds run on a background CommWorker thread / side stream (``ctx.worker``)
        instead of on the training thread (:func:`~ds_lowcomm.shard.step.step_now`)."""
        return False

    @classmethod
    def state_bytes(cls, options, shard_group_size: int) -> float:
        """Bytes per model parameter that this mode's optimizer state with ``options`` takes on
        one rank, its shards ``shard_group_size`` ranks wide: what ``"mode": "automatic"`` checks
        against the free device memory before it picks a replica layout. An upper bound (fp32
        throughout); the weights and gradient buffers every mode has are not counted. Stated by
        the modes that keep replicas (``demo``, ``desloc``). No communication."""
        raise NotImplementedError(f"{cls.name} does not state its optimizer state's bytes")

    @classmethod
    def check_config(cls, ds: dict, cfg) -> None:
        """Reject settings this mode cannot run: ``ds`` the DeepSpeed JSON, ``cfg`` the parsed
        :class:`~ds_lowcomm.config.LowCommConfig` (raise ``LowCommConfigError``)."""

    @classmethod
    def pace_block(cls, options, gradient_accumulation_steps: int) -> int:
        """Micro-batches per block the :class:`~ds_lowcomm.shard.pace.Pacer` plans (one round's sums)."""
        return gradient_accumulation_steps

    @classmethod
    def check_loop(cls, options, marks_boundaries: bool) -> None:
        """Raise ``LowCommConfigError`` for ``options`` that a loop which does (or does not) mark
        its own accumulation boundaries cannot run (what :meth:`bind_loop` would raise)."""

    def bind_loop(self, marks_boundaries: bool) -> None:
        """Called once, before the first backward pass: whether the loop marks its own
        accumulation boundaries (``set_gradient_accumulation_boundary``: the Trainer, accelerate,
        TRL) or lets DeepSpeed count micro-batches (``engine.step()`` after each). Raise
        ``LowCommConfigError`` for a setting this loop cannot run."""

    def paces_in_loop(self) -> bool:
        """After :meth:`bind_loop`: whether ``lowcomm.pace`` applies in this loop (``paces`` modes)."""
        return self.paces

    def on_backward_start(self, boundary: bool) -> None:
        """Called before every backward pass; ``boundary`` is DeepSpeed's accumulation boundary.
        No communication."""

    def on_micro_batch_end(self, boundary: bool) -> None:
        """Called after every backward pass; ``boundary`` is DeepSpeed's accumulation boundary.
        May launch collectives that overlap the next compute (zero1 ``overlap``, acco)."""

    @abc.abstractmethod
    def step(self) -> None:
        """At an accumulation boundary: communicate and update (possibly asynchronously). Each
        mode states its bytes per step in its module docstring."""

    def flush(self) -> None:
        """Finish and install any round in flight, so the model holds the latest update.
        Collective where a mode gathers the master into the model (acco, desloc with a streamed
        sync in flight: an all-gather over the shard group); none by default."""

    def settle(self) -> None:
        """Make the optimizer state stable and the same step on every rank, without changing the
        model (collective). The engine calls it once before a checkpoint is tagged and written and
        once before one is loaded; the state methods below assume it and communicate nothing."""

    @abc.abstractmethod
    def master_weights(self) -> torch.Tensor:
        """The full fp32 master weights, unpadded flat (collective: every rank must call it; an
        all-gather over the shard group, (S−1)/S · P · 4 bytes sent per rank)."""

    def metrics(self) -> dict:
        """Mode-specific numbers for :meth:`LowCommOptimizer.comm_stats`."""
        return {}

    # -- checkpoint state: no communication in either method (tests/test_checkpoint.py counts);
    # the engine settles first, and the Checkpointer reads and writes the files

    @abc.abstractmethod
    def state(self) -> ModeState:
        """The optimizer state to save."""

    def check_saved(self, meta: dict) -> None:
        """Raise :class:`~ds_lowcomm.checkpoint.CheckpointError` where this mode, as configured,
        cannot continue the state saved with ``meta`` (:meth:`state`'s, merged into the
        optimizer's metadata): read before anything is loaded. No communication."""

    @abc.abstractmethod
    def restore(self, meta: Optional[dict], shards: ShardReader, rank: Optional[dict]) -> None:
        """Take a checkpoint's state back, from any layout: ``meta`` as :meth:`state` saved it
        (merged into the optimizer's metadata), or None to take only the fp32 master from
        ``shards`` (any mode's checkpoint: everything else restarts, the model gets the master);
        ``shards`` reads every saved rank's shards and per-rank part; ``rank`` this rank's
        per-rank part ({} where :meth:`state` saved None) when the checkpoint was saved with this
        run's layout, else None (the mode
        rebuilds its per-rank state from ``shards``, where that has a meaning)."""


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
