"""Plain fp32 weights from a checkpoint's shards, what ``zero_to_fp32.py`` does for stock ZeRO.

Three spellings of one conversion:

- ``ds-lowcomm-export CHECKPOINT_DIR OUT.pt|OUT.bin|OUT.safetensors [--tag TAG]`` (console script;
  ``python -m ds_lowcomm.checkpoint export ...`` is the same);
- ``python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [--tag TAG]``, the
  script every save writes into its directory, with stock DeepSpeed's arguments (but
  ``--exclude_frozen_parameters``; ``--max_shard_size`` is accepted, one file is written): it
  writes ``pytorch_model.bin`` (or ``model.safetensors``) into ``OUTPUT_DIR``;
- :func:`export_fp32` from Python.

The weights get the model's ``config.json`` beside them when the checkpoint directory has
one (the engine writes it at save for a model with a Hugging Face config; the Trainer does too),
so ``from_pretrained`` on that directory works.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Dict, List, Optional

import torch

from ds_lowcomm.checkpoint.files import (FORMAT, LEGACY_FORMAT, MODEL_FILE, CheckpointError, atomic_write_text,
                                         resolve_tag, safe_load, verify_files)
from ds_lowcomm.checkpoint.migrate import reader_for

#: the model's Hugging Face config, written beside the checkpoints and beside an export
CONFIG_FILE = "config.json"
#: stock DeepSpeed's name for the conversion script it copies into every ZeRO save directory
RECOVERY_SCRIPT = "zero_to_fp32.py"
_RECOVERY_SOURCE = '''#!/usr/bin/env python
"""Written by ds_lowcomm into each checkpoint directory, as stock DeepSpeed writes its own:
fp32 weights from this directory's checkpoints. Stock DeepSpeed's arguments:

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [--tag TAG]
"""
import sys

try:
    import ds_lowcomm.checkpoint.export as export
except ImportError:
    sys.exit("error: this checkpoint was saved by ds_lowcomm; install it (pip install ds_lowcomm) to convert it")
if not hasattr(export, "recovery_main"):
    sys.exit(f"error: the installed ds_lowcomm ({export.__file__}) is older than this script; upgrade it")
sys.exit(export.recovery_main())
'''


def export_fp32(load_dir: str, tag: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The model's ``state_dict`` with every trainable parameter taken from the fp32 master
    (replica 0's under DES-LOC), read from the rank files one shard at a time. Raises
    :class:`CheckpointError` naming the file for a missing, changed or foreign checkpoint."""
    tag_dir = os.path.join(load_dir, resolve_tag(load_dir, tag))
    path = os.path.join(tag_dir, MODEL_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path!r} does not exist")
    verify_files(tag_dir, [MODEL_FILE])
    ckpt = safe_load(path, mmap=True)
    opt = ckpt.get("optimizer")
    if not isinstance(opt, dict) or opt.get("format") not in (FORMAT, LEGACY_FORMAT):
        raise CheckpointError(f"{path!r} holds no ds_lowcomm optimizer state; for a stock DeepSpeed "
                              "ZeRO checkpoint use DeepSpeed's own zero_to_fp32.py")
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


def write_recovery_files(save_dir: str, model_config: Optional[str]) -> None:
    """Rank 0, at every save: ``zero_to_fp32.py`` into ``save_dir`` (as stock DeepSpeed does) and,
    given one and unless the directory has one (the Trainer writes its own first), the model's
    Hugging Face config as ``config.json``. Atomic writes; no communication."""
    script = os.path.join(save_dir, RECOVERY_SCRIPT)
    atomic_write_text(script, _RECOVERY_SOURCE)
    os.chmod(script, 0o755)
    config = os.path.join(save_dir, CONFIG_FILE)
    if model_config is not None and not os.path.exists(config):
        atomic_write_text(config, model_config)


def save_weights(state: Dict[str, torch.Tensor], output: str, checkpoint_dir: str) -> List[str]:
    """Write ``state`` to ``output``: safetensors when it ends in ``.safetensors``, else
    ``torch.save``; the checkpoint's ``config.json``, if it has one, is copied beside it. Returns
    the files written. Raises :class:`CheckpointError` when safetensors is not installed."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if not output.endswith(".safetensors"):
        torch.save(state, output)
        return [output] + _copy_config(checkpoint_dir, output)
    try:  # optional: installed with transformers
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError("writing .safetensors needs the safetensors package: pip install safetensors") from None
    # safetensors refuses tensors that share memory: tied weights get their own copy.
    seen, flat = set(), {}
    for k, v in state.items():
        flat[k] = v.clone() if v.data_ptr() in seen else v.contiguous()
        seen.add(v.data_ptr())
    save_file(flat, output, metadata={"format": "pt"})
    return [output] + _copy_config(checkpoint_dir, output)


def _copy_config(checkpoint_dir: str, output: str) -> List[str]:
    config = os.path.join(checkpoint_dir, CONFIG_FILE)
    beside = os.path.join(os.path.dirname(os.path.abspath(output)), CONFIG_FILE)
    if not os.path.isfile(config) or os.path.abspath(config) == beside:
        return []
    shutil.copyfile(config, beside)
    return [beside]


def _convert(checkpoint_dir: str, output: str, tag: Optional[str]) -> int:
    try:
        state = export_fp32(checkpoint_dir, tag)
        written = save_weights(state, output, checkpoint_dir)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = sum(v.numel() for v in state.values())
    print(f"wrote {len(state)} tensors ({n:,} elements, fp32) to {', '.join(written)}")
    return 0


def main(argv=None) -> int:
    """``ds-lowcomm-export CHECKPOINT_DIR OUTPUT [--tag TAG]``; exit code 2 with one line on error."""
    ap = argparse.ArgumentParser(prog="ds-lowcomm-export",
                                 description="Write plain fp32 weights (a torch state_dict, or safetensors with the "
                                             "model's config.json beside it) from a ds_lowcomm checkpoint.")
    ap.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint")
    ap.add_argument("output", help="output file: .pt or .bin (torch.save), or .safetensors")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    args = ap.parse_args(argv)
    return _convert(args.checkpoint_dir, args.output, args.tag)


def recovery_main(argv=None) -> int:
    """The ``zero_to_fp32.py`` written into each checkpoint directory: stock DeepSpeed's
    ``CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [-t TAG]``."""
    ap = argparse.ArgumentParser(prog=RECOVERY_SCRIPT,
                                 description="fp32 weights from a ds_lowcomm checkpoint directory (stock "
                                             "DeepSpeed's arguments; one output file, never sharded)")
    ap.add_argument("checkpoint_dir", help="the checkpoint directory (the one holding 'latest'), e.g. '.'")
    ap.add_argument("output_dir", help="directory for pytorch_model.bin, or model.safetensors and config.json")
    ap.add_argument("--safe_serialization", action="store_true", help="write model.safetensors instead")
    ap.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    ap.add_argument("--max_shard_size", default=None, help="accepted for stock's command lines; one file is written")
    ap.add_argument("-d", "--debug", action="store_true", help="accepted for stock's command lines; no effect")
    args = ap.parse_args(argv)
    name = "model.safetensors" if args.safe_serialization else "pytorch_model.bin"
    return _convert(args.checkpoint_dir, os.path.join(args.output_dir, name), args.tag)
