"""Checkpoint files: atomic writes, the manifest, and ``weights_only`` reads, each failure a
:class:`CheckpointError` naming the file.

Every file of ours is written under a temporary name and renamed; a manifest
(``lowcomm_manifest.json``: each file's size and sha256) is written after every rank's files are
complete, and ``latest`` only after it, so a save killed at any point leaves the previous
checkpoint the one that resumes. At load the files a rank reads are checked against the manifest,
and every file (DeepSpeed's model file included, before DeepSpeed unpickles it) is read with
``weights_only=True``: a file that needs arbitrary unpickling is refused.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from typing import Any, Dict, Iterable, Optional

import torch

FORMAT = "ds_lowcomm/2"
#: the format before sharded saves: full (gathered) state in the model file; still loaded
LEGACY_FORMAT = "ds_lowcomm/1"
MODEL_FILE = "mp_rank_00_model_states.pt"
MANIFEST = "lowcomm_manifest.json"
logger = logging.getLogger("ds_lowcomm")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says why and what to do."""


def rank_file_name(rank: int) -> str:
    """The file holding global rank ``rank``'s own state in a checkpoint's tag directory."""
    return f"lowcomm_rank{rank:05d}.pt"

# -- files: atomic writes, manifest, safe reads ------------------------------------------------------

def fsync_parent_dir(path: str) -> None:
    """Make a rename of ``path`` durable (fsync of its directory)."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A file for ``torch.save`` (which writes it front to back) that hashes what it writes."""

    def __init__(self, f) -> None:
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.bytes += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def atomic_save(obj: Any, path: str) -> dict:
    """``torch.save`` to a temporary name in the same directory, flushed, then renamed: ``path``
    is either absent, its previous content, or complete. Returns its :func:`file_record`,
    hashed as it was written (reading a just-written file back for its hash doubled the I/O)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_parent_dir(path)
    return {"bytes": writer.bytes, "sha256": writer.sha256.hexdigest()}


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` the same way as :func:`atomic_save`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_parent_dir(path)


def file_record(path: str) -> dict:
    """Size and sha256 of a file, as the manifest records them."""
    h = hashlib.sha256()
    block = memoryview(bytearray(1 << 22))  # one reused 4 MiB buffer: no growth of RSS
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            h.update(block[:n])
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def write_manifest(tag_dir: str, records: Dict[str, dict]) -> None:
    """Record the tag directory's files (name -> :func:`file_record`); atomic."""
    atomic_write_text(os.path.join(tag_dir, MANIFEST),
                      json.dumps({"format": FORMAT, "files": records}, indent=1, sort_keys=True))


_UNVERIFIED_WARNED: set = set()


def verify_files(tag_dir: str, names: Iterable[str]) -> None:
    """Check the files ``names`` of a tag directory against its manifest (size, then sha256).

    Raises :class:`CheckpointError` naming the first missing, changed or unrecorded file. A
    directory without a manifest (written before ds_lowcomm kept one) is loaded unverified, with
    a warning; its files are still read with ``weights_only=True``.
    """
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        if tag_dir not in _UNVERIFIED_WARNED:  # once per directory, not once per file
            _UNVERIFIED_WARNED.add(tag_dir)
            logger.warning(f"ds_lowcomm: {tag_dir!r} has no {MANIFEST} (an older checkpoint, or a "
                           "save that did not finish): its files are not verified")
        return
    try:
        with open(path) as f:
            records = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path!r} is not a readable manifest ({err}); the checkpoint cannot "
                              "be verified: resume from another one") from None
    for name in names:
        file = os.path.join(tag_dir, name)
        want = records.get(name)
        if want is None:
            raise CheckpointError(f"{file!r} is not in the checkpoint's manifest: it was not part of "
                                  "this save (saved with another world size or mode?)")
        if not os.path.isfile(file):
            raise CheckpointError(f"{file!r} is missing: the checkpoint is incomplete; resume from "
                                  "another one")
        size = os.path.getsize(file)
        if size != want["bytes"]:
            raise CheckpointError(f"{file!r} has {size} bytes, the manifest recorded {want['bytes']}: "
                                  "the file is truncated or was replaced; resume from another checkpoint")
        if file_record(file)["sha256"] != want["sha256"]:
            raise CheckpointError(f"{file!r} does not match the sha256 the manifest recorded at save: "
                                  "the file was changed or damaged; resume from another checkpoint")


def safe_load(path: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``, with a :class:`CheckpointError` naming the file
    when it is missing, needs arbitrary unpickling (refused: loading it could run code), or
    cannot be read (truncated or corrupt)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path!r} does not exist: the checkpoint is incomplete")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path!r} needs arbitrary unpickling to load ({first}); refused, since "
                              "loading it could run code. ds_lowcomm and DeepSpeed write only tensors "
                              "and plain containers: this file was not written by them, or was "
                              "tampered with") from None
    except Exception as err:  # noqa: BLE001  (torch raises RuntimeError, EOFError, ... for a bad zip)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(f"{path!r} cannot be read ({type(err).__name__}: {first}): the file is "
                              "truncated or corrupt; resume from another checkpoint") from None



def resolve_tag(load_dir: str, tag: Optional[str]) -> str:
    """The tag to load: ``tag``, else the content of ``<load_dir>/latest``."""
    if tag is not None:
        return tag
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        raise CheckpointError(f"no checkpoint in {load_dir!r}: {latest!r} does not exist; pass a "
                              "directory written by engine.save_checkpoint, or an explicit tag")
    with open(latest) as f:
        return f.read().strip()


