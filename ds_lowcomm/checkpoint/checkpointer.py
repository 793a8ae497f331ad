"""The :class:`Checkpointer`: what a save and a load do around DeepSpeed's own, for one rank.

DeepSpeed (ZeRO stage 0 as far as it knows) calls ``optimizer.state_dict()`` on every rank and
writes rank 0's dict into its model file under ``"optimizer"``: that dict holds only metadata.
Each rank then writes what it owns (``optimizer.rank_state_dict()``: its shards and its mode's
per-rank state) to its own file; rank 0 writes the manifest, then ``latest``. Modes only describe
their state; this component owns paths, order, atomicity and checks.

With ``async_save`` a save returns once DeepSpeed's files are written and this rank's state is
copied: the copy is written, hashed and made durable on a background thread while training goes
on, and the manifest and ``latest`` follow when every rank's file is complete (a private gloo
group agrees on that off the training thread), as torch.distributed.checkpoint's ``async_save``
and torchtitan do. Until then ``latest`` still names the previous checkpoint, which stays
resumable. The next save, any load, ``engine.destroy()``, ``torch.distributed.destroy_process_group``
and interpreter exit wait for it.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Protocol

import torch
import torch.distributed as dist

from ds_lowcomm.checkpoint.files import (MODEL_FILE, CheckpointError, atomic_save, atomic_write_text,
                                         file_record, fsync_parent_dir, rank_file_name, resolve_tag, safe_load, verify_files,
                                         write_manifest)
from ds_lowcomm.checkpoint.export import write_recovery_files
from ds_lowcomm.checkpoint.migrate import check_loadable, reader_for, upgrade_meta
from ds_lowcomm.checkpoint.shards import ShardReader, check_same_model
from ds_lowcomm.comm.collectives import destroy_group

#: a save of a tag that exists is written beside it under this suffix, then swapped in
STAGING = ".saving"
#: the tag's previous content while the new one is swapped in (loaded if a kill left only it)
REPLACED = ".replaced"
logger = logging.getLogger("ds_lowcomm")

#: background saves of this process not yet finished (any engine's): loads and exit wait for them
_PENDING: "set[Future]" = set()
_PENDING_LOCK = threading.Lock()


def wait_for_saves() -> None:
    """Block until every background save of this process (any engine's) has finished, published
    or not. A failure is not raised here: it was logged when it happened and is raised by its own
    checkpointer's next save (:meth:`Checkpointer.wait`)."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
    wait_all(pending)


def _wait_before_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group`` wait for background saves first: it tears
    down the group a save finishes on, and scripts call it right after their last save."""
    destroy = dist.destroy_process_group
    if getattr(destroy, "waits_for_lowcomm_saves", False):
        return

    @functools.wraps(destroy)
    def destroy_process_group(*args, **kwargs):
        wait_for_saves()
        return destroy(*args, **kwargs)

    destroy_process_group.waits_for_lowcomm_saves = True
    dist.destroy_process_group = destroy_process_group


def _snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors training cannot change: each copied to the CPU (a GPU
    tensor leaves the accelerator's memory alone; a CPU one is cloned)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return obj


class Checkpointed(Protocol):
    """What the Checkpointer uses of the optimizer it saves and loads
    (:class:`~ds_lowcomm.optimizer.LowCommOptimizer`); no member is called with communication."""

    #: names per parameter, matched against a checkpoint's before anything is loaded
    param_names: List[List[str]]
    flat: Any  # FlatParams: ``params`` (shapes) and ``layout`` (this rank's shard range)
    topology: Any  # Topology: world size and shard group size, for a checkpoint's layout
    #: set around DeepSpeed's load: where :meth:`load_state_dict` reads the flat state and, saved
    #: with this layout, this rank's own file
    checkpoint_shards: Optional[ShardReader]

    def load_state_dict(self, state_dict: dict, load_optimizer_states: bool = True) -> None:
        """Restore the metadata, and the rest from ``checkpoint_shards``."""

    def rank_state_dict(self) -> dict:
        """What this rank writes to its own file."""


class Checkpointer:
    """Saves and loads one rank's part of a checkpoint of a
    :class:`~ds_lowcomm.optimizer.LowCommOptimizer` (``optimizer``), beside DeepSpeed's files.

    ``rank`` is the global rank, ``device`` where per-rank state is loaded to, ``model_config``
    returns the model's Hugging Face config as JSON (None: no config): rank 0 writes it (unless the
    directory has one, as the Trainer writes it) and a ``zero_to_fp32.py`` that converts our
    checkpoints into every save directory. Both methods are
    collective over the default process group, and so is construction with ``async_save`` (it
    creates the private gloo group the background saves agree on)."""

    def __init__(self, optimizer: Checkpointed, rank: int, device, async_save: bool = False,
                 timeout_s: float = 300.0, model_config: Optional[Callable[[], str]] = None) -> None:
        self.optimizer, self.rank, self.device = optimizer, rank, device
        self.model_config = model_config
        self.async_save = async_save
        self._pool: Optional[ThreadPoolExecutor] = None
        self._group = None
        self._pending: Optional[Future] = None
        if async_save:
            # gloo whatever the training backend: the records are CPU objects, and its own
            # connections keep these collectives apart from the training thread's.
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ds_lowcomm-save")
            _wait_before_destroy()

    def wait(self) -> None:
        """Block until this checkpointer's background save (if any) is published. Raises
        :class:`CheckpointError` if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the background save, then stop the save thread and destroy its group
        (``engine.destroy()``). Idempotent. No communication of its own."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            destroy_group(self._group)
            self._group = None

    def save(self, save_dir: str, tag: str, save_latest: bool, deepspeed_save: Callable[[str], Any]) -> Any:
        """``deepspeed_save(tag)`` (DeepSpeed's collective save, its ``latest`` switched off,
        returning its result and this rank's write error or None: a failure on any rank raises
        :class:`CheckpointError` on every rank, ``latest`` unchanged), then this rank's file, the
        manifest and ``latest``, in that order. A tag that already
        exists (a second save at the same step; or only its previous content does, under
        ``REPLACED``, left by a save of it killed mid-swap) is written beside it and swapped in
        only once complete, so the checkpoint it held stays loadable until then. Communication besides
        DeepSpeed's: a few hundred bytes of file records and flags, and barriers; no optimizer
        state is gathered. With ``async_save`` this rank's state is copied (memory: one shard of
        state and the mode's per-rank state, until written) and the rest runs on the save thread;
        a previous background save is waited for first. Returns what ``deepspeed_save`` returned."""
        self.wait()
        tag_dir = os.path.join(save_dir, tag)
        # The tag exists, or only its previous content does (a save killed between the swap's
        # renames left it under REPLACED, which is what loads): staged either way, so that
        # content is never deleted or overwritten before the new one is complete.
        flag = [os.path.isdir(tag_dir) or os.path.isdir(tag_dir + REPLACED)]
        dist.broadcast_object_list(flag, src=0)  # one decision for every rank
        write_tag = tag + STAGING if flag[0] else tag
        write_dir = os.path.join(save_dir, write_tag)
        if self.rank == 0:  # left by a save killed earlier
            shutil.rmtree(tag_dir + STAGING, ignore_errors=True)
            if os.path.isdir(tag_dir):  # the tag is what loads: its previous content is garbage
                shutil.rmtree(tag_dir + REPLACED, ignore_errors=True)
        dist.barrier()
        out, error = deepspeed_save(write_tag)  # ends with a barrier: DeepSpeed's files are written
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, error)  # a write that failed on any rank ends the save on all
        errors = [e for e in everyone if e]
        if errors:
            raise CheckpointError(f"checkpoint {tag!r} in {save_dir!r} was not saved ({errors[0]}); "
                                  f"'latest' still names the previous checkpoint")
        if not self.async_save:
            self._publish(self.optimizer.rank_state_dict(), write_dir, tag_dir, save_dir, tag, save_latest, None)
            return out
        state = _snapshot(self.optimizer.rank_state_dict())
        future = self._pool.submit(self._publish, state, write_dir, tag_dir, save_dir, tag, save_latest, self._group)
        self._pending = future
        with _PENDING_LOCK:
            _PENDING.add(future)
        future.add_done_callback(self._forget)
        return out

    @staticmethod
    def _forget(future: Future) -> None:
        with _PENDING_LOCK:
            _PENDING.discard(future)
        if future.exception() is not None:  # also raised at the next wait; logged now for the user
            logger.error(f"ds_lowcomm: a background checkpoint save failed: {future.exception()}")

    def _publish(self, state: Dict[str, Any], write_dir: str, tag_dir: str, save_dir: str, tag: str,
                 save_latest: bool, group) -> None:
        """Write this rank's file, agree with every rank that all files are complete, then (rank
        0) the manifest, the swap of a re-saved tag, and ``latest``; ends with a barrier. On the
        save thread with ``group`` (the private gloo group) under ``async_save``; else on the
        caller's thread over the default group. A rank that fails to write tells the others, so
        no rank waits and none publishes."""
        name = rank_file_name(self.rank)
        records: Dict[str, Any] = {}
        try:
            with ThreadPoolExecutor(1) as pool:
                # Rank 0 reads DeepSpeed's model file back for its hash while it writes its own
                # file (hashlib and file I/O release the GIL).
                model_record = (pool.submit(file_record, os.path.join(write_dir, MODEL_FILE))
                                if self.rank == 0 else None)
                records[name] = atomic_save(state, os.path.join(write_dir, name))
                if model_record is not None:
                    records[MODEL_FILE] = model_record.result()
                    write_recovery_files(save_dir, self.model_config() if self.model_config else None)
        except Exception as err:  # noqa: BLE001  (any failure must reach the other ranks, not strand them)
            records = {"error": f"rank {self.rank} could not write {os.path.join(write_dir, name)!r}: "
                                f"{type(err).__name__}: {err}"}
        del state
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, records, group=group)
        errors = [r["error"] for r in everyone if "error" in r]
        if errors:
            raise CheckpointError(f"checkpoint {tag!r} in {save_dir!r} was not saved ({errors[0]}); "
                                  f"'latest' still names the previous checkpoint")
        if self.rank == 0:
            write_manifest(write_dir, {k: v for r in everyone for k, v in r.items()})
            if write_dir != tag_dir:
                # A kill between the renames leaves the old content under REPLACED, which load
                # falls back to; after them, the new one under the tag. (The old content is
                # already there when such a kill hit the previous save of this tag.)
                if os.path.isdir(tag_dir):
                    os.rename(tag_dir, tag_dir + REPLACED)
                os.rename(write_dir, tag_dir)
                fsync_parent_dir(tag_dir)
                shutil.rmtree(tag_dir + REPLACED, ignore_errors=True)
            if save_latest:
                atomic_write_text(os.path.join(save_dir, "latest"), tag)
        dist.barrier(group=group)

    def load(self, load_dir: str, tag: Optional[str], load_optimizer_states: bool,
             deepspeed_load: Callable[[str], Any]) -> Any:
        """Check and read this rank's files (one verdict for every rank), then
        ``deepspeed_load(tag)`` (which calls ``optimizer.load_state_dict``, reading the state
        through ``optimizer.checkpoint_shards``). Raises
        :class:`CheckpointError` naming the file on every rank when any rank's files are bad.
        Background saves of this process are waited for first (one that failed left ``latest``
        on the previous checkpoint, which is what loads). Communication: up to four verdicts,
        each an ``all_gather_object`` of a few bytes per rank (the tag, the metadata, the
        optimizer's check, the files); each rank reads the saved files that cover its own shard
        (its own file when the layout is unchanged), none of another's state over the network."""
        wait_for_saves()
        tag = _agreed(functools.partial(self._find_tag, load_dir, tag))
        tag_dir = os.path.join(load_dir, tag)
        opt = self.optimizer
        saved = _agreed(lambda: self._checked_meta(tag_dir, load_optimizer_states))
        if load_optimizer_states:
            meta = upgrade_meta(saved)
            if opt.mode is None:
                # "mode": "automatic" before it has chosen: it resumes in the checkpoint's mode and layout
                opt.adopt(meta)
            # Refused on every rank before anything is read (load_state_dict checks again, for
            # callers that reach it directly).
            _agreed(lambda: opt.check_saved(meta))
        shards = _agreed(lambda: self._read(tag_dir, load_optimizer_states, saved))
        opt.checkpoint_shards = shards
        try:
            out = deepspeed_load(tag)
            if not load_optimizer_states:
                # DeepSpeed (0.19.8) then leaves the optimizer alone, which would keep the fp32
                # master of this run's start and overwrite the loaded weights at the next step.
                opt.load_state_dict(shards.saved_meta, load_optimizer_states=False)
        finally:
            opt.checkpoint_shards = None
        return out

    @staticmethod
    def _find_tag(load_dir: str, tag: Optional[str]) -> str:
        """The tag to load (``latest``'s when None); a tag caught being re-saved loads its previous content."""
        tag = str(resolve_tag(load_dir, tag))
        if not os.path.isdir(os.path.join(load_dir, tag)) and os.path.isdir(os.path.join(load_dir, tag + REPLACED)):
            logger.warning(f"ds_lowcomm: {tag!r} was being re-saved when the run stopped; loading its "
                           f"previous content, {tag + REPLACED!r}")
            tag += REPLACED
        return tag

    def _checked_meta(self, tag_dir: str, load_optimizer_states: bool) -> dict:
        """The optimizer metadata in the checkpoint's model file, checked against the manifest
        and read with ``weights_only=True`` (which also vets the file DeepSpeed unpickles), of
        this model, and loadable as asked."""
        path = os.path.join(tag_dir, MODEL_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path!r} does not exist: no checkpoint with tag "
                                  f"{os.path.basename(tag_dir)!r} in {os.path.dirname(tag_dir)!r}")
        verify_files(tag_dir, [MODEL_FILE])
        saved = safe_load(path, mmap=True).get("optimizer")
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path!r} has no optimizer state: it was not written by ds_lowcomm")
        opt = self.optimizer
        check_same_model(saved, opt.param_names, [list(p.shape) for p in opt.flat.params])
        check_loadable(saved, load_optimizer_states)
        return saved

    def _read(self, tag_dir: str, load_optimizer_states: bool, saved: dict) -> ShardReader:
        """This rank's checks and safe reads, before DeepSpeed touches anything: returns the
        reader of the checkpoint's state (``saved``: its :meth:`_checked_meta`), the files of
        this rank's new shard checked against the manifest, and, saved with this layout, this
        rank's own file checked and read."""
        opt = self.optimizer
        shards = reader_for(tag_dir, saved)
        layout = opt.flat.layout
        shards.verify(shards.files_for(layout.shard_start, layout.shard_size))
        if load_optimizer_states and shards.same_layout(opt.topology):
            for name in shards.own_files(self.rank):
                if not os.path.isfile(os.path.join(tag_dir, name)):
                    raise CheckpointError(
                        f"{os.path.join(tag_dir, name)!r} does not exist: the checkpoint has no file for rank "
                        f"{self.rank} (saved with fewer ranks?); load with load_optimizer_states=False to "
                        f"take the weights only")
            shards.rank_file(self.rank)  # read now, so a bad file is every rank's verdict
        return shards


def _agreed(fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank with one verdict for all (a few bytes over the world): a
    :class:`CheckpointError` on any rank is raised on every rank, so a rank whose files are bad
    never leaves the others waiting in a collective (DeepSpeed's load, a new process group)."""
    try:
        out, error = fn(), None
    except CheckpointError as err:
        out, error = None, str(err)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        raise CheckpointError(error if error is not None else f"rank {bad[0][0]}: {bad[0][1]}")
    return out
