"""``python -m ds_lowcomm.checkpoint export CHECKPOINT_DIR OUT.pt|OUT.safetensors [--tag TAG]``:
plain fp32 weights from a checkpoint's shards, what ``zero_to_fp32.py`` does for stock ZeRO."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Optional

import torch

from ds_lowcomm.checkpoint.files import (FORMAT, LEGACY_FORMAT, MODEL_FILE, CheckpointError, resolve_tag,
                                         safe_load, verify_files)
from ds_lowcomm.checkpoint.migrate import reader_for


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

