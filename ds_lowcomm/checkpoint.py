"""Checkpoint state: sharded at save, resharded at load, exact, and exportable as plain fp32 weights.

DeepSpeed (ZeRO stage 0 as far as it knows) calls ``optimizer.state_dict()`` on every rank and
writes rank 0's dict into ``<dir>/<tag>/mp_rank_00_model_states.pt`` under ``"optimizer"``: that
dict holds only small metadata (names, shapes, hyperparameters, counters, how the state was
cut). Each rank writes what it owns to its own file, ``lowcomm_rank<r>.pt``: its shards of the
flat fp32 state (master, Adam moments, ...) and its mode's per-rank state. Nothing is gathered
and nothing crosses the network at save but a barrier and each file's size and hash. At load,
:class:`ShardReader` cuts each rank's new shard out of whichever files hold it, memory-mapped, so
sharded state loads at any world size and ``shard_group_size``.

Files are safe to keep and to load: every file of ours is written under a temporary name and
renamed; a manifest (``lowcomm_manifest.json``: each file's size and sha256) is written after every
rank's files are complete, and ``latest`` only after it, so a save killed at any point leaves the
previous checkpoint the one that resumes. At load the files a rank reads are checked against the
manifest, and every file (DeepSpeed's model file included, before DeepSpeed unpickles it) is read
with ``weights_only=True``: a file that needs arbitrary unpickling is refused, as are changed,
truncated and missing files, each with a :class:`CheckpointError` naming the file.

Export::

    python -m ds_lowcomm.checkpoint export CHECKPOINT_DIR OUT.pt [--tag TAG]
    python -m ds_lowcomm.checkpoint export CHECKPOINT_DIR model.safetensors

writes ``{parameter name: fp32 tensor}`` (every name of the model's ``state_dict``, tied weights
included, buffers as saved) from the fp32 master weights, what ``zero_to_fp32.py`` does for stock
ZeRO; as safetensors (what Hugging Face's ``from_pretrained`` reads) when the output ends in
``.safetensors``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import pickle
import sys
from typing import Any, Dict, Iterable, List, Optional

import torch

from ds_lowcomm.comm import Collectives
from ds_lowcomm.flat import ShardLayout

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

def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary name in the same directory, flushed, then renamed: ``path``
    is either absent, its previous content, or complete."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` the same way as :func:`atomic_save`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path)


def file_record(path: str) -> dict:
    """Size and sha256 of a file, as the manifest records them."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
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


def gather_full(comm: Collectives, layout: ShardLayout, shard: torch.Tensor) -> torch.Tensor:
    """Every rank's ``shard`` concatenated and unpadded (collective over ``comm``'s group)."""
    full = shard.new_empty(layout.padded)
    comm.all_gather(full, shard.contiguous())
    return full[: layout.numel].clone()


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

    def __init__(self, tag_dir: str, meta: dict, replica: int = 0, verified: Optional[set] = None) -> None:
        self.tag_dir, self.meta, self.replica = tag_dir, meta, replica
        #: the optimizer metadata from the model file this state belongs to
        self.saved_meta: Optional[dict] = None
        self._cache: Dict[int, dict] = {}
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
        other = ShardReader(self.tag_dir, self.meta, replica, self.verified)
        other.saved_meta = self.saved_meta
        return other

    def files_for(self, start: int, length: int) -> List[str]:
        """The rank files :meth:`read` opens for elements ``[start, start + length)``."""
        return [rank_file_name(r) for r in self._ranks(start, length)]

    def _shards(self, rank: int) -> dict:
        if rank not in self._cache:
            self.verify([rank_file_name(rank)])
            path = os.path.join(self.tag_dir, rank_file_name(rank))
            shards = safe_load(path, mmap=True).get("shards")
            if not isinstance(shards, dict):
                raise CheckpointError(f"{path!r} holds no shards: it was not written by this ds_lowcomm")
            self._cache[rank] = shards
        return self._cache[rank]

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


class LegacyReader(ShardReader):
    """The same reads from a :data:`LEGACY_FORMAT` checkpoint, whose model file holds the state
    gathered into full tensors (``key`` → ``saved[key]``, or acco's pending parameters)."""

    def __init__(self, saved: dict) -> None:
        self.saved_meta = saved
        self.meta = {"numel": saved["master"].numel()}

    def verify(self, names: Iterable[str]) -> None:
        pass  # the state is in the model file, verified before it was read

    def of_replica(self, replica: int) -> "ShardReader":
        return self  # replica 0's: per-replica state comes with the rank files

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
    """The reader of a checkpoint's flat state, given the optimizer metadata of its model file."""
    if saved.get("format") == LEGACY_FORMAT:
        return LegacyReader(saved)
    reader = ShardReader(tag_dir, saved["shards"])
    reader.saved_meta = saved
    return reader


def rank_layout(topology) -> dict:
    """What per-rank state depends on: saved with it, checked by :func:`check_rank_layout`."""
    return {"world_size": topology.world_size, "shard_group_size": topology.shard_group_size}


def check_rank_layout(saved: dict, topology, holds: str) -> None:
    """Raise :class:`CheckpointError` unless per-rank state was saved with this run's layout."""
    now = rank_layout(topology)
    then = {k: saved.get(k) for k in now}
    if then != now:
        raise CheckpointError(
            f"this checkpoint holds {holds} for {then['world_size']} ranks in shard groups of "
            f"{then['shard_group_size']}; this run has {now['world_size']} ranks in groups of "
            f"{now['shard_group_size']}. Resume with the same layout, or load with "
            f"load_optimizer_states=False to keep only the weights")


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


def export_fp32(load_dir: str, tag: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The model's ``state_dict`` with every trainable parameter taken from the fp32 master
    (replica 0's under DES-LOC), read from the rank files one shard at a time."""
    tag_dir = os.path.join(load_dir, resolve_tag(load_dir, tag))
    path = os.path.join(tag_dir, MODEL_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path!r} does not exist")
    verify_files(tag_dir, [MODEL_FILE])
    ckpt = safe_load(path, mmap=True)
    opt = ckpt.get("optimizer")
    if not isinstance(opt, dict) or opt.get("format") not in (FORMAT, LEGACY_FORMAT):
        raise CheckpointError(f"{path!r} holds no ds_lowcomm optimizer state; for stock DeepSpeed "
                              "ZeRO checkpoints use the zero_to_fp32.py script saved next to them")
    reader = reader_for(tag_dir, opt)  # checks each rank file against the manifest as it opens it
    out = {k: v.float() if v.is_floating_point() else v for k, v in ckpt["module"].items()}
    like, offset = torch.empty(0), 0
    for names, shape in zip(opt["param_names"], opt["param_shapes"]):
        n = int(torch.Size(shape).numel())
        value = reader.read("master", offset, n, like).view(shape)
        for name in names:
            out[name] = value
        offset += n
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_lowcomm.checkpoint",
                                     description="Tools for ds_lowcomm checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write plain fp32 weights (a torch state_dict) from a checkpoint")
    exp.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint")
    exp.add_argument("output", help="output file: .pt (torch.save), or .safetensors")
    exp.add_argument("--tag", default=None, help="checkpoint tag (default: the 'latest' file)")
    args = parser.parse_args(argv)
    try:
        state = export_fp32(args.checkpoint_dir, args.tag)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.output.endswith(".safetensors"):
        try:  # optional: installed with transformers
            from safetensors.torch import save_file
        except ImportError:
            print("error: writing .safetensors needs the safetensors package: pip install safetensors",
                  file=sys.stderr)
            return 2
        # safetensors refuses tensors that share memory: tied weights get their own copy.
        seen, flat = set(), {}
        for k, v in state.items():
            flat[k] = v.clone() if v.data_ptr() in seen else v.contiguous()
            seen.add(v.data_ptr())
        save_file(flat, args.output, metadata={"format": "pt"})
    else:
        torch.save(state, args.output)
    n = sum(v.numel() for v in state.values())
    print(f"wrote {len(state)} tensors ({n:,} elements, fp32) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
