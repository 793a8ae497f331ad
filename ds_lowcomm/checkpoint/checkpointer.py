"""The :class:`Checkpointer`: what a save and a load do around DeepSpeed's own, for one rank.

DeepSpeed (ZeRO stage 0 as far as it knows) calls ``optimizer.state_dict()`` on every rank and
writes rank 0's dict into its model file under ``"optimizer"``: that dict holds only metadata.
Each rank then writes what it owns (``optimizer.rank_state_dict()``: its shards and its mode's
per-rank state) to its own file; rank 0 writes the manifest, then ``latest``. Modes only describe
their state; this component owns paths, order, atomicity and checks.
"""
from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Tuple

import torch.distributed as dist

from ds_lowcomm.checkpoint.files import (MANIFEST, MODEL_FILE, CheckpointError, atomic_save, atomic_write_text,
                                         file_record, fsync_parent_dir, rank_file_name, resolve_tag, safe_load, verify_files,
                                         write_manifest)
from ds_lowcomm.checkpoint.shards import ShardReader, check_same_model, reader_for

#: a save of a tag that exists is written beside it under this suffix, then swapped in
STAGING = ".saving"
#: the tag's previous content while the new one is swapped in (loaded if a kill left only it)
REPLACED = ".replaced"
logger = logging.getLogger("ds_lowcomm")


class Checkpointer:
    """Saves and loads one rank's part of a checkpoint of a
    :class:`~ds_lowcomm.optimizer.LowCommOptimizer` (``optimizer``), beside DeepSpeed's files.

    ``rank`` is the global rank, ``device`` where per-rank state is loaded to. Both methods are
    collective over the default process group."""

    def __init__(self, optimizer, rank: int, device) -> None:
        self.optimizer, self.rank, self.device = optimizer, rank, device

    def save(self, save_dir: str, tag: str, save_latest: bool, deepspeed_save: Callable[[str], Any]) -> Any:
        """``deepspeed_save(tag)`` (DeepSpeed's collective save, its ``latest`` switched off),
        then this rank's file, the manifest and ``latest``, in that order. A tag that already
        exists (a second save at the same step) is written beside it and swapped in only once
        complete, so the checkpoint it held stays loadable until then. Communication besides
        DeepSpeed's: a few hundred bytes of file records and flags, and barriers; no optimizer
        state is gathered. Returns what ``deepspeed_save`` returned."""
        tag_dir = os.path.join(save_dir, tag)
        flag = [os.path.isdir(tag_dir)]
        dist.broadcast_object_list(flag, src=0)  # one decision for every rank
        write_tag = tag + STAGING if flag[0] else tag
        write_dir = os.path.join(save_dir, write_tag)
        if self.rank == 0:
            for stale in (tag + STAGING, tag + REPLACED):  # left by a save killed earlier
                shutil.rmtree(os.path.join(save_dir, stale), ignore_errors=True)
        dist.barrier()
        out = deepspeed_save(write_tag)  # ends with a barrier: DeepSpeed's files are complete
        name = rank_file_name(self.rank)
        with ThreadPoolExecutor(1) as pool:
            # Rank 0 reads DeepSpeed's model file back for its hash while it writes its own file
            # (hashlib and file I/O release the GIL).
            model_record = pool.submit(file_record, os.path.join(write_dir, MODEL_FILE)) if self.rank == 0 else None
            records = {name: atomic_save(self.optimizer.rank_state_dict(), os.path.join(write_dir, name))}
            if model_record is not None:
                records[MODEL_FILE] = model_record.result()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, records)
        if self.rank == 0:
            write_manifest(write_dir, {k: v for r in everyone for k, v in r.items()})
            if write_dir != tag_dir:
                # A kill between the renames leaves the old content under REPLACED, which load
                # falls back to; after them, the new one under the tag.
                os.rename(tag_dir, tag_dir + REPLACED)
                os.rename(write_dir, tag_dir)
                fsync_parent_dir(tag_dir)
                shutil.rmtree(tag_dir + REPLACED, ignore_errors=True)
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
            if not os.path.isdir(os.path.join(load_dir, tag)) and os.path.isdir(os.path.join(load_dir, tag + REPLACED)):
                logger.warning(f"ds_lowcomm: {tag!r} was being re-saved when the run stopped; loading its "
                               f"previous content, {tag + REPLACED!r}")
                tag += REPLACED
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
        elif load_optimizer_states and opt.mode.has_rank_state:
            opt.mode.reshard_rank_state(shards)  # saved at another layout
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
        verify_files(tag_dir, [MODEL_FILE])
        saved = safe_load(path, mmap=True).get("optimizer")  # also vets the file DeepSpeed unpickles
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path!r} has no optimizer state: it was not written by ds_lowcomm")
        check_same_model(saved, opt.param_names, [list(p.shape) for p in opt.flat.params])
        shards = reader_for(tag_dir, saved)
        # Per-rank state saved with this layout: this rank's own file; else the mode reshards it.
        needs_rank_state = (load_optimizer_states and opt.mode.has_rank_state
                            and shards.same_layout(opt.topology))
        rank_name = rank_file_name(self.rank)
        rank_path = os.path.join(tag_dir, rank_name)
        if needs_rank_state and not os.path.isfile(rank_path):
            raise CheckpointError(
                f"{rank_path!r} does not exist: this mode keeps per-rank state and the checkpoint has "
                f"none for rank {self.rank} (saved with fewer ranks, or by another mode?); "
                f"load with load_optimizer_states=False to take the weights only")
        layout = opt.flat.layout
        shards.verify(shards.files_for(layout.shard_start, layout.shard_size)
                      + ([rank_name] if needs_rank_state else []))
        return shards, (safe_load(rank_path, map_location=self.device) if needs_rank_state else None)

