"""The :class:`Checkpointer`: what a save and a load do around DeepSpeed's own, for one rank.

DeepSpeed (ZeRO stage 0 as far as it knows) calls ``optimizer.state_dict()`` on every rank and
writes rank 0's dict into its model file under ``"optimizer"``: that dict holds only metadata.
Each rank then writes what it owns (``optimizer.rank_state_dict()``: its shards and its mode's
per-rank state) to its own file; rank 0 writes the manifest, then ``latest``. Modes only describe
their state; this component owns paths, order, atomicity and checks.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Tuple

import torch.distributed as dist

from ds_lowcomm.checkpoint.files import (MANIFEST, MODEL_FILE, CheckpointError, atomic_save, atomic_write_text,
                                         file_record, rank_file_name, resolve_tag, safe_load, verify_files,
                                         write_manifest)
from ds_lowcomm.checkpoint.shards import ShardReader, check_same_model, reader_for


class Checkpointer:
    """Saves and loads one rank's part of a checkpoint of a
    :class:`~ds_lowcomm.optimizer.LowCommOptimizer` (``optimizer``), beside DeepSpeed's files.

    ``rank`` is the global rank, ``device`` where per-rank state is loaded to. Both methods are
    collective over the default process group."""

    def __init__(self, optimizer, rank: int, device) -> None:
        self.optimizer, self.rank, self.device = optimizer, rank, device

    def save(self, save_dir: str, tag: str, save_latest: bool, deepspeed_save: Callable[[], Any]) -> Any:
        """``deepspeed_save()`` (DeepSpeed's collective save, its ``latest`` switched off), then
        this rank's file, the manifest and ``latest``, in that order. Communication besides
        DeepSpeed's: one all-gather of each rank's file record (a few hundred bytes) and a
        barrier; no optimizer state is gathered. Returns what ``deepspeed_save`` returned."""
        tag_dir = os.path.join(save_dir, tag)
        if self.rank == 0 and os.path.isfile(os.path.join(tag_dir, MANIFEST)):
            os.remove(os.path.join(tag_dir, MANIFEST))  # re-saving a tag: never vouch for a mix
        out = deepspeed_save()  # ends with a barrier: DeepSpeed's files are complete
        name = rank_file_name(self.rank)
        atomic_save(self.optimizer.rank_state_dict(), os.path.join(tag_dir, name))
        records = {name: file_record(os.path.join(tag_dir, name))}
        if self.rank == 0:
            records[MODEL_FILE] = file_record(os.path.join(tag_dir, MODEL_FILE))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, records)
        if self.rank == 0:
            write_manifest(tag_dir, {k: v for r in everyone for k, v in r.items()})
            if save_latest:
                atomic_write_text(os.path.join(save_dir, "latest"), tag)
        dist.barrier()
        return out

    def load(self, load_dir: str, tag: Optional[str], load_optimizer_states: bool,
             deepspeed_load: Callable[[str], Any]) -> Any:
        """Check and read this rank's files (one verdict for every rank), then
        ``deepspeed_load(tag)`` (which calls ``optimizer.load_state_dict``, reading the flat state
        through ``optimizer.checkpoint_shards``), then this rank's per-rank state. Raises
        :class:`CheckpointError` naming the file on every rank when any rank's files are bad."""
        try:
            tag = resolve_tag(load_dir, tag)
            shards, rank_state = self._read(os.path.join(load_dir, str(tag)), load_optimizer_states)
            error = None
        except CheckpointError as err:
            error = str(err)
        # One verdict for every rank (a few bytes): a rank whose files are bad must not leave the
        # others waiting in DeepSpeed's load.
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if bad:
            raise CheckpointError(error if error is not None else f"rank {bad[0][0]}: {bad[0][1]}")
        opt = self.optimizer
        opt.checkpoint_shards = shards
        try:
            out = deepspeed_load(tag)
            if not load_optimizer_states:
                # DeepSpeed (0.19.8) then leaves the optimizer alone, which would keep the fp32
                # master of this run's start and overwrite the loaded weights at the next step.
                opt.load_state_dict(shards.saved_meta, load_optimizer_states=False)
        finally:
            opt.checkpoint_shards = None
        if rank_state is not None:
            opt.load_rank_state_dict(rank_state)
        return out

    def _read(self, tag_dir: str, load_optimizer_states: bool) -> Tuple[ShardReader, Optional[dict]]:
        """This rank's checks and safe reads, before DeepSpeed touches anything: returns the
        reader of the flat state (the files of this rank's new shard already checked against the
        manifest) and this rank's own file, when its mode keeps per-rank state (else None)."""
        path = os.path.join(tag_dir, MODEL_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path!r} does not exist: no checkpoint with tag "
                                  f"{os.path.basename(tag_dir)!r} in {os.path.dirname(tag_dir)!r}")
        opt = self.optimizer
        needs_rank_state = load_optimizer_states and opt.mode.has_rank_state
        rank_name = rank_file_name(self.rank)
        rank_path = os.path.join(tag_dir, rank_name)
        if needs_rank_state and not os.path.isfile(rank_path):
            raise CheckpointError(
                f"{rank_path!r} does not exist: this mode keeps per-rank state and the checkpoint has "
                f"none for rank {self.rank} (saved with fewer ranks, or by another mode?); "
                f"load with load_optimizer_states=False to take the weights only")
        verify_files(tag_dir, [MODEL_FILE])
        saved = safe_load(path, mmap=True).get("optimizer")  # also vets the file DeepSpeed unpickles
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path!r} has no optimizer state: it was not written by ds_lowcomm")
        check_same_model(saved, opt.param_names, [list(p.shape) for p in opt.flat.params])
        shards = reader_for(tag_dir, saved)
        layout = opt.flat.layout
        shards.verify(shards.files_for(layout.shard_start, layout.shard_size)
                      + ([rank_name] if needs_rank_state else []))
        return shards, (safe_load(rank_path, map_location=self.device) if needs_rank_state else None)
