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

The component, one file per concern: :mod:`~ds_lowcomm.checkpoint.files` (atomic writes,
manifest, safe reads), :mod:`~ds_lowcomm.checkpoint.shards` (the cut and :class:`ShardReader`),
:mod:`~ds_lowcomm.checkpoint.checkpointer` (the order of a save and a load, which the engine
delegates to), :mod:`~ds_lowcomm.checkpoint.migrate` (earlier versions' checkpoints brought to the
current format, in one place), :mod:`~ds_lowcomm.checkpoint.export`.
"""
from ds_lowcomm.checkpoint.checkpointer import Checkpointer
from ds_lowcomm.checkpoint.export import export_fp32
from ds_lowcomm.checkpoint.files import (FORMAT, LEGACY_FORMAT, MANIFEST, MODEL_FILE, CheckpointError, atomic_save,
                                         atomic_write_text, file_record, rank_file_name, resolve_tag, safe_load,
                                         verify_files, write_manifest)
from ds_lowcomm.checkpoint.migrate import LegacyReader, reader_for
from ds_lowcomm.checkpoint.shards import ShardReader, check_same_model, shard_meta

__all__ = ["Checkpointer", "CheckpointError", "ShardReader", "LegacyReader", "export_fp32", "reader_for",
           "shard_meta", "check_same_model", "safe_load", "verify_files",
           "atomic_save", "atomic_write_text", "file_record", "write_manifest", "rank_file_name", "resolve_tag",
           "FORMAT", "LEGACY_FORMAT", "MANIFEST", "MODEL_FILE"]
