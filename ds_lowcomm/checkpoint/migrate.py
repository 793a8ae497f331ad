"""Checkpoints written by earlier versions, brought to the current format in one place, so the
modes only ever see today's state (:class:`~ds_lowcomm.modes.base.ModeState`).

- ``ds_lowcomm/1`` (before sharded saves): the optimizer's flat state gathered into full tensors
  in DeepSpeed's model file, per-rank state alone in the rank files. :class:`LegacyReader` reads
  ranges out of the full tensors. Its rank files' state is not carried over: a resume of an
  ``acco``, ``demo`` or ``desloc`` checkpoint in it is refused with the way out, its weights
  (:func:`check_loadable`).
- ``ds_lowcomm/2`` before per-replica state was sharded: desloc's moments and outer state, and
  demo's momentum (then ``"delta"``), were in the mode's part of each rank file; acco's part had
  no ``"weights"`` (every micro-batch computed, each weighing one); desloc's metadata counted
  its rounds under ``"step"``. :func:`upgrade_rank_file` and :func:`upgrade_meta` move them.
"""
from __future__ import annotations

from typing import Iterable, List

import torch

from ds_lowcomm.checkpoint.files import LEGACY_FORMAT, CheckpointError
from ds_lowcomm.checkpoint.shards import ShardReader

#: per-replica flat tensors once kept in the mode's part of a rank file (this rank's shard of them)
_MOVED_TO_SHARDS = ("exp_avg", "exp_avg_sq", "anchor", "outer_buf", "delta")
#: renamed shard keys: demo's momentum
_RENAMED = {"delta": "momentum"}


#: the modes whose ds_lowcomm/1 checkpoints kept state in the rank files
_LEGACY_RANK_STATE = ("acco", "demo", "desloc")


def check_loadable(saved: dict, load_optimizer_states: bool) -> None:
    """Raise :class:`CheckpointError` for a checkpoint whose optimizer state this version cannot
    resume (``saved``: its model file's optimizer metadata)."""
    if load_optimizer_states and saved.get("format") == LEGACY_FORMAT and saved.get("mode") in _LEGACY_RANK_STATE:
        raise CheckpointError(f"this {saved['mode']} checkpoint was written in the {LEGACY_FORMAT} format, whose "
                              "per-rank state this version no longer reads; load it with "
                              "load_optimizer_states=False to keep the weights")


def upgrade_meta(saved: dict) -> dict:
    """The optimizer metadata of a model file, in the current format (a copy where changed)."""
    if saved.get("mode") == "desloc" and "rounds" not in saved:
        saved = {**saved, "rounds": saved.get("step", 0)}
    return saved


def upgrade_rank_file(state: dict, saved_meta: dict) -> dict:
    """A rank file's content in the current format: ``{"shards", "mode", "guard"}``."""
    if "shards" not in state:  # ds_lowcomm/1: the mode's per-rank state alone
        state = {"shards": {}, "mode": state, "guard": None}
    mode, shards = state.get("mode"), dict(state["shards"])
    if isinstance(mode, dict):
        mode = dict(mode)
        for key in _MOVED_TO_SHARDS:
            if key in mode and isinstance(mode[key], torch.Tensor):
                shards[key] = mode.pop(key)
        if "accumulator" in mode and "weights" not in mode:  # acco, before paced weights
            mode["weights"] = [mode["micro_batches"]] * 2
    for old, new in _RENAMED.items():
        if old in shards and saved_meta is not None and saved_meta.get("mode") == "demo":
            shards[new] = shards.pop(old)
    return {**state, "shards": shards, "mode": mode}


class LegacyReader(ShardReader):
    """The reads of a :class:`ShardReader` from a :data:`LEGACY_FORMAT` checkpoint, whose model
    file holds the flat state gathered into full tensors (``key`` → ``saved[key]``, or acco's
    pending parameters)."""

    def __init__(self, tag_dir: str, saved: dict) -> None:
        super().__init__(tag_dir, {"numel": saved["master"].numel()}, upgrade=upgrade_rank_file)
        self.saved_meta = saved

    def verify(self, names: Iterable[str]) -> None:
        pass  # the state is in the model file, verified before it was read

    def of_replica(self, replica: int) -> "ShardReader":
        return self  # (per-replica state is refused by check_loadable)

    def own_files(self, rank: int) -> List[str]:
        return []  # (its per-rank state is not carried over)

    def keys(self) -> List[str]:
        return [k for k, v in self.saved_meta.items() if isinstance(v, torch.Tensor)]

    def same_layout(self, topology) -> bool:
        return False  # no per-rank state is read from its rank files

    @property
    def num_replicas(self) -> int:
        return 1

    def files_for(self, start: int, length: int) -> List[str]:
        return []

    def read(self, key: str, start: int, length: int, like: torch.Tensor) -> torch.Tensor:
        full = self.saved_meta.get(key)
        if key == "pending_params":
            full = self.saved_meta["acco"]["pending"]["params"]
        if full is None:
            raise CheckpointError(f"this {LEGACY_FORMAT} checkpoint has no {key!r}")
        out = torch.zeros(length, dtype=like.dtype, device=like.device)
        end = min(start + length, full.numel())
        if end > start:
            out[: end - start].copy_(full[start:end])
        return out


def reader_for(tag_dir: str, saved: dict) -> ShardReader:
    """The reader of a checkpoint's flat state in any format, given the optimizer metadata of its
    model file (``saved_meta`` then holds it upgraded)."""
    saved = upgrade_meta(saved)
    if saved.get("format") == LEGACY_FORMAT:
        return LegacyReader(tag_dir, saved)
    reader = ShardReader(tag_dir, saved["shards"], upgrade=upgrade_rank_file)
    reader.saved_meta = saved
    return reader
