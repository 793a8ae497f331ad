"""The DeepSpeed configs shipped with the package, addressable by name from any directory.

A name is a JSON file's path below this folder without ``.json``: ``zero1``, ``acco_zero1``,
``demo_slow_link``, ``hf/zero1`` (the Hugging Face Trainer's and accelerate's, which leave batch
sizes, clipping and the optimizer to the script), ... ``ds_configs/`` in a source checkout is this
folder. ``deepspeed.initialize(config="zero1")`` takes a name where a path would go (ds_lowcomm
resolves it), and so does ``examples/train.py --deepspeed zero1``; for any other script,
``ds-lowcomm-config NAME`` prints the file's path::

    python finetune.py --deepspeed "$(ds-lowcomm-config hf/zero1)"
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

HERE = Path(__file__).resolve().parent


def names() -> List[str]:
    """Every shipped config's name, sorted."""
    return sorted(p.relative_to(HERE).with_suffix("").as_posix() for p in HERE.rglob("*.json"))


def path(name: str) -> Optional[str]:
    """The file of the shipped config ``name`` (``"zero1"``, ``"hf/acco"``, ``.json`` optional,
    a ``ds_configs/`` prefix allowed), or None when no shipped config has that name."""
    name = name[len("ds_configs/"):] if name.startswith("ds_configs/") else name
    name = name[:-len(".json")] if name.endswith(".json") else name
    return str(HERE / f"{name}.json") if name in names() else None


def resolve(config: str) -> str:
    """A config argument as a user gives it (a path, or a shipped config's name) -> an existing
    file. Raises ``FileNotFoundError`` with one line naming the argument, the working directory
    and the shipped names when it is neither."""
    if os.path.isfile(config):
        return config
    shipped = path(config)
    if shipped is not None:
        return shipped
    raise FileNotFoundError(f"DeepSpeed config {config!r}: no such file (working directory {os.getcwd()!r}) and "
                            f"not a shipped config; give a path, or one of: {', '.join(names())}")


def main(argv=None) -> int:
    """``ds-lowcomm-config [NAME]``: the path of a shipped config; without a name, every name."""
    ap = argparse.ArgumentParser(prog="ds-lowcomm-config", description="Print the path of a DeepSpeed config "
                                 "shipped with ds_lowcomm (for --deepspeed of any script), or list them.")
    ap.add_argument("name", nargs="?", help="e.g. zero1, demo_slow_link, hf/zero1")
    args = ap.parse_args(argv)
    if args.name is None:
        print("\n".join(names()))
        return 0
    found = path(args.name)
    if found is None:
        print(f"error: no shipped config {args.name!r}; one of: {', '.join(names())}", file=sys.stderr)
        return 2
    print(found)
    return 0
