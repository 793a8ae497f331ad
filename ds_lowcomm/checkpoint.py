"""Checkpoint state: world-size independent, exact, and exportable as plain fp32 weights.

DeepSpeed (ZeRO stage 0 as far as it knows) calls ``optimizer.state_dict()`` on every rank and
writes rank 0's dict into ``<dir>/<tag>/mp_rank_00_model_states.pt`` under ``"optimizer"``; at load
every rank receives that dict. So sharded state is gathered, unpadded, into full tensors when
saving and each rank pads and slices its own shard when loading, whatever the world size.

Export::

    python -m ds_lowcomm.checkpoint export CHECKPOINT_DIR OUT.pt [--tag TAG]

writes ``{parameter name: fp32 tensor}`` (every name of the model's ``state_dict``, tied weights
included, buffers as saved) from the fp32 master weights, what ``zero_to_fp32.py`` does for stock
ZeRO.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Optional

import torch

from ds_lowcomm.comm import Collectives
from ds_lowcomm.flat import ShardLayout

FORMAT = "ds_lowcomm/1"
MODEL_FILE = "mp_rank_00_model_states.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says why and what to do."""


def gather_full(comm: Collectives, layout: ShardLayout, shard: torch.Tensor) -> torch.Tensor:
    """Every rank's ``shard`` concatenated and unpadded (collective over ``comm``'s group)."""
    full = shard.new_empty(layout.padded)
    comm.all_gather(full, shard.contiguous())
    return full[: layout.numel].clone()


def shard_of(full: torch.Tensor, layout: ShardLayout, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an unpadded full tensor, as ``like``'s dtype and device."""
    return layout.shard(layout.pad(full.to(like.device, like.dtype))).clone()


def check_same_model(saved: dict, names: list, shapes: list) -> None:
    """Raise :class:`CheckpointError` unless the checkpoint's parameters match this model's."""
    if saved.get("format") != FORMAT:
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
    """The model's ``state_dict`` with every trainable parameter taken from the fp32 master."""
    path = os.path.join(load_dir, resolve_tag(load_dir, tag), MODEL_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path!r} does not exist")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    opt = ckpt.get("optimizer")
    if not isinstance(opt, dict) or opt.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} holds no ds_lowcomm optimizer state; for stock DeepSpeed "
                              "ZeRO checkpoints use the zero_to_fp32.py script saved next to them")
    master = opt["master"]
    out = {k: v.float() if v.is_floating_point() else v for k, v in ckpt["module"].items()}
    offset = 0
    for names, shape in zip(opt["param_names"], opt["param_shapes"]):
        n = int(torch.Size(shape).numel())
        value = master[offset: offset + n].view(shape).clone()
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
    exp.add_argument("output", help="output .pt file")
    exp.add_argument("--tag", default=None, help="checkpoint tag (default: the 'latest' file)")
    args = parser.parse_args(argv)
    try:
        state = export_fp32(args.checkpoint_dir, args.tag)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.save(state, args.output)
    n = sum(v.numel() for v in state.values())
    print(f"wrote {len(state)} tensors ({n:,} elements, fp32) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
