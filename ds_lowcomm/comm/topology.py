"""Which ranks share optimizer state (shard groups) and which ranks hold the same shard (replicas).

Ranks form shard groups of ``shard_group_size`` consecutive ranks (one node: fast links) and
replica groups (ranks with the same index in every shard group: the slow links between nodes)::

    world 4, shard_group_size 2:   shard groups  [0 1] [2 3]     replica groups  [0 2] [1 3]

ZeRO-1 sharding happens inside a shard group; modes that exchange compressed or infrequent
updates (DeMo, DES-LOC) talk across replica groups. All groups are private (``dist.new_group``)
so our collectives never interleave with the training script's or DeepSpeed's own; a shard group
of one rank is no group at all (:class:`~ds_lowcomm.comm.collectives.GroupOfOne`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ds_lowcomm.comm.collectives import Collectives, CommStats, GroupOfOne, destroy_group
from ds_lowcomm.config import AUTO, LowCommConfigError


@dataclass
class Topology:
    world_size: int
    rank: int
    shard_group_size: int
    shard: Collectives      # this rank's shard group (the whole world when shard_group_size == W)
    replica: Optional[Collectives]  # this rank's replica group, None when there is one shard group
    #: the whole world on gloo with CPU tensors, used only from the training thread (agreements
    #: such as acco's round count, which must not queue behind the comm worker's collectives on
    #: the shard group): on GPUs never a second NCCL communicator busy while a round is in flight
    #: on the shard group (NCCL documents that as a possible deadlock), and reading its result
    #: never waits for the GPU
    control: Collectives

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.shard_group_size

    @property
    def blocking_collectives(self) -> bool:
        """Whether the shard or replica group's collectives block the calling thread until they
        complete (gloo's), rather than return once enqueued on the device (NCCL's; a group of
        one has none): where they do, a round needs a thread of its own to overlap training."""
        return not all(c.native for c in (self.shard, self.replica) if c is not None)

    @staticmethod
    def build(shard_group_size: Optional[int], timeout_s: float, stats: CommStats,
              control: Optional[Collectives] = None) -> "Topology":
        """Create the private groups (``control``: another topology's, kept). Collective over the
        world: every rank must call it; no bytes of its own beyond each group's rendezvous."""
        world, rank = dist.get_world_size(), dist.get_rank()
        g = world if shard_group_size is None else shard_group_size
        if g > world or world % g:
            raise LowCommConfigError(
                f"lowcomm.shard_group_size: got {g}, which does not divide the world size {world}; "
                f"use a divisor of {world} (e.g. the number of ranks per node) or null")
        timeout = timedelta(seconds=timeout_s)
        shard = replica = None
        # new_group is collective over the world and must be called for every group in the same
        # order on every rank, including the groups this rank is not in.
        if g == 1:  # no communicator for a group of one (each would be an eager NCCL one)
            shard = GroupOfOne(stats, timeout_s, "shard")
        else:
            for start in range(0, world, g):
                ranks = list(range(start, start + g))
                pg = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    shard = Collectives(pg, stats, timeout_s, "shard")
        if g < world:
            for index in range(g):
                ranks = list(range(index, world, g))
                pg = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    replica = Collectives(pg, stats, timeout_s, "replica")
        if control is None:
            control = Collectives(dist.new_group(list(range(world)), timeout=timeout, backend="gloo"),
                                  stats, timeout_s, "control")
        return Topology(world, rank, g, shard, replica, control)

    def close(self, control: bool = False) -> None:
        """Destroy this rank's shard and replica groups, and with ``control`` the control group
        (without it kept: another topology may share it, as when "mode": "automatic" replaces a
        topology before training, whose communicators, NCCL's holding device buffers, would
        otherwise stay open unused). Idempotent. No communication: call it once this rank's
        collectives on them have completed."""
        for collectives in (self.shard, self.replica) + ((self.control,) if control else ()):
            if collectives is not None:
                destroy_group(collectives.group)


def warn_one_hardware_queue(cfg, modes: Mapping, env: Mapping[str, str] = os.environ,
                            cuda: Optional[bool] = None) -> bool:
    """Warn once per node when ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is set and the mode of ``cfg``
    (a :class:`~ds_lowcomm.config.LowCommConfig`; ``modes``: the registry) overlaps
    communication with training, and say the fix. Returns whether it warned.

    With one connection every CUDA stream of the process feeds one hardware queue, in launch
    order: the comm worker's side stream, NCCL's and the training stream. An NCCL kernel that
    waits for a slower peer then holds up every training kernel queued behind it, so the
    overlap the mode exists for is lost (Megatron-style launchers set it to order tensor-parallel
    communication, which ds_lowcomm does not use). ``"automatic"`` may pick an overlapping mode.
    Only on CUDA (``cuda``: default whether CUDA is available)."""
    if env.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() != "1":
        return False
    if cuda is None:
        cuda = torch.cuda.is_available()
    automatic = cfg.mode == AUTO
    if not cuda or not (automatic or modes[cfg.mode].is_asynchronous(cfg.mode_options)):
        return False
    if env.get("LOCAL_RANK", "0") == "0":
        what = "may pick a mode that overlaps" if automatic else "overlaps"
        logging.getLogger("ds_lowcomm").warning(
            "ds_lowcomm: CUDA_DEVICE_MAX_CONNECTIONS=1 is set: every CUDA stream shares one hardware queue, "
            "so a collective waiting for a slower rank on the communication stream holds up the training "
            "kernels queued behind it, and lowcomm.mode %r %s communication with training. Unset "
            "CUDA_DEVICE_MAX_CONNECTIONS for this job (CUDA's default is 8 connections)", cfg.mode, what)
    return True
