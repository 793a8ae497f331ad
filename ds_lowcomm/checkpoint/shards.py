"""Sharded state: how flat state is cut into rank files, and :class:`ShardReader`, which cuts any
range back out of them (memory-mapped, ``weights_only``), so sharded state loads into any world
size and ``shard_group_size``.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, List, Optional

import torch

from ds_lowcomm.checkpoint.files import (FORMAT, LEGACY_FORMAT, CheckpointError, rank_file_name, safe_load,
                                         verify_files)
from ds_lowcomm.shard.flat import ShardLayout


def check_same_model(saved: dict, names: list, shapes: list) -> None:
    """Raise :class:`CheckpointError` unless the checkpoint's parameters match this model's."""
    if saved.get("format") not in (FORMAT, LEGACY_FORMAT):
        raise CheckpointError(f"optimizer state has format {saved.get('format')!r}, expected {FORMAT!r}: "
                              "this checkpoint was not written by ds_lowcomm (stock DeepSpeed?); load "
                              "it with load_optimizer_states=False to take the weights only")
    old_names, old_shapes = saved["param_names"], [tuple(s) for s in saved["param_shapes"]]
    if len(old_names) != len(names):
        raise CheckpointError(f"checkpoint has {len(old_names)} trainable parameters, this model has "
                              f"{len(names)}: it was saved from a different model")
    for old_n, old_s, n, s in zip(old_names, old_shapes, names, shapes):
        if old_n != n or old_s != tuple(s):
            raise CheckpointError(f"checkpoint parameter {old_n[0]} {list(old_s)} does not match this "
                                  f"model's {n[0]} {list(s)}: it was saved from a different model")


def shard_meta(layout: ShardLayout, topology) -> dict:
    """How this run cuts flat state into rank files (saved with the metadata, read by
    :class:`ShardReader`)."""
    return {"numel": layout.numel, "shard_size": layout.shard_size,
            "shard_group_size": topology.shard_group_size, "world_size": topology.world_size}


class ShardReader:
    """Ranges of flat state saved one shard per rank file, read memory-mapped with
    ``weights_only=True``.

    Rank ``r``'s file holds, under ``"shards"``, elements ``[i·S, (i+1)·S)`` of each flat tensor of
    its replica (``i = r mod G``, ``S`` the saved shard size, ``G`` the saved shard group size);
    :meth:`read` cuts any range out of the files of one replica (replica 0 unless told), so the
    state loads into any layout. Elements past the real ones (padding) read as zeros.
    """

    def __init__(self, tag_dir: str, meta: dict, replica: int = 0, verified: Optional[set] = None,
                 upgrade: Callable[[dict, dict], dict] = lambda state, saved_meta: state) -> None:
        self.tag_dir, self.meta, self.replica = tag_dir, meta, replica
        #: ``upgrade(rank file, saved_meta)``: a rank file in the current format
        #: (:func:`ds_lowcomm.checkpoint.migrate.reader_for` passes it)
        self.upgrade = upgrade
        #: the optimizer metadata from the model file this state belongs to
        self.saved_meta: Optional[dict] = None
        self._cache: Dict[int, dict] = {}  # rank files read so far
        self.verified = set() if verified is None else verified  # file names checked against the manifest

    def verify(self, names: Iterable[str]) -> None:
        """Check files against the manifest (once each); every file is checked before it is read."""
        todo = [n for n in names if n not in self.verified]
        verify_files(self.tag_dir, todo)
        self.verified.update(todo)

    def _ranks(self, start: int, length: int) -> List[int]:
        size, numel = self.meta["shard_size"], self.meta["numel"]
        end = min(start + length, numel)
        first = self.replica * self.meta["shard_group_size"]
        return [first + i for i in range(start // size, -(-end // size))] if end > start else []

    def of_replica(self, replica: int) -> "ShardReader":
        """The same state as held by replica ``replica`` (per-replica state, same layout only)."""
        other = ShardReader(self.tag_dir, self.meta, replica, self.verified, self.upgrade)
        other.saved_meta, other._cache = self.saved_meta, self._cache
        return other

    def own_files(self, rank: int) -> List[str]:
        """The file rank ``rank`` saved, which a resume at the same layout reads as its own."""
        return [rank_file_name(rank)]

    def files_for(self, start: int, length: int) -> List[str]:
        """The rank files :meth:`read` opens for elements ``[start, start + length)``."""
        return [rank_file_name(r) for r in self._ranks(start, length)]

    def keys(self) -> List[str]:
        """The flat tensors the checkpoint holds (as this replica's first rank saved them)."""
        return list(self._shards(self.replica * self.meta["shard_group_size"]))

    def same_layout(self, topology) -> bool:
        """Whether the checkpoint was saved with ``topology``'s world size and shard group size
        (per-rank state then loads as it was saved, each rank its own file)."""
        return (self.meta["world_size"], self.meta["shard_group_size"]) == (
            topology.world_size, topology.shard_group_size)

    @property
    def num_replicas(self) -> int:
        """Replicas (shard groups) the checkpoint was saved with."""
        return self.meta["world_size"] // self.meta["shard_group_size"]

    def replica_mean(self, key: str, start: int, length: int, like: torch.Tensor) -> torch.Tensor:
        """:meth:`read` of per-replica state ``key`` averaged over the saved replicas (what an
        average of the replicas, DES-LOC's sync, would make of it)."""
        out = self.of_replica(0).read(key, start, length, like)
        for r in range(1, self.num_replicas):
            out.add_(self.of_replica(r).read(key, start, length, like))
        return out.div_(self.num_replicas)

    def rank_file(self, rank: int) -> dict:
        """Saved rank ``rank``'s file, checked against the manifest, read memory-mapped and
        ``weights_only``, in the current format (:attr:`upgrade`):
        ``"shards"``, ``"mode"`` (the mode's per-rank part, or None) and ``"guard"``."""
        if rank not in self._cache:
            self.verify([rank_file_name(rank)])
            path = os.path.join(self.tag_dir, rank_file_name(rank))
            state = safe_load(path, mmap=True)
            if not isinstance(state, dict):
                raise CheckpointError(f"{path!r} holds no rank state: it was not written by ds_lowcomm")
            self._cache[rank] = self.upgrade(state, self.saved_meta)
        return self._cache[rank]

    def rank_state(self, rank: int) -> dict:
        """The mode's per-rank part (:attr:`~ds_lowcomm.modes.base.ModeState.rank`) of saved rank
        ``rank``'s file."""
        state = self.rank_file(rank).get("mode")
        if not isinstance(state, dict):
            raise CheckpointError(f"{os.path.join(self.tag_dir, rank_file_name(rank))!r} holds no per-rank "
                                  f"state: it was saved by another mode")
        return state

    def _shards(self, rank: int) -> dict:
        shards = self.rank_file(rank).get("shards")
        if not isinstance(shards, dict):
            raise CheckpointError(f"{os.path.join(self.tag_dir, rank_file_name(rank))!r} holds no shards: it "
                                  f"was not written by this ds_lowcomm")
        return shards

    def read(self, key: str, start: int, length: int, like: torch.Tensor) -> torch.Tensor:
        """Elements ``[start, start + length)`` of flat tensor ``key``, as ``like``'s dtype/device."""
        out = torch.zeros(length, dtype=like.dtype, device=like.device)
        size = self.meta["shard_size"]
        end = min(start + length, self.meta["numel"])
        for rank in self._ranks(start, length):
            shards = self._shards(rank)
            if key not in shards:
                raise CheckpointError(f"{os.path.join(self.tag_dir, rank_file_name(rank))!r} has no "
                                      f"{key!r}: it was saved by another mode or version")
            lo = (rank - self.replica * self.meta["shard_group_size"]) * size
            a, b = max(start, lo), min(end, lo + size)
            out[a - start: b - start].copy_(shards[key][a - lo: b - lo])
        return out

    def shard(self, key: str, layout: ShardLayout, like: torch.Tensor) -> torch.Tensor:
        """This run's shard of ``key`` (``layout``'s range)."""
        return self.read(key, layout.shard_start, layout.shard_size, like)

    def full(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """All real elements of ``key`` (unpadded)."""
        return self.read(key, 0, self.meta["numel"], like)
