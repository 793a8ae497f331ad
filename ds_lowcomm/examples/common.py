"""What the example scripts share: their argparse types, the emulated slower accelerator
(``--slow-ranks RANK:FACTOR[,...]``, which the tests' user scripts also take, from ``SLOW_RANKS``)
and the reductions of their own host numbers over the ranks."""
from __future__ import annotations

import argparse
import os
import time

import torch


def parse_slow_ranks(text: str) -> dict:
    """argparse type: ``"1:3,2:1.5"`` -> ``{1: 3.0, 2: 1.5}``."""
    out = {}
    for part in filter(None, text.split(",")):
        rank, _, factor = part.partition(":")
        try:
            out[int(rank)] = float(factor)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected RANK:FACTOR, e.g. 1:3") from None
        if out[int(rank)] < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: FACTOR must be >= 1")
    return out


def _number(text: str, kind, allowed, says: str, example):
    """``text`` as ``kind`` (int or float) for which ``allowed(value)`` holds (NaN never does),
    else an argparse error that gives ``example`` (unparseable) or ``says`` (out of range)."""
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r}: expected {what}, e.g. {example}") from None
    if not allowed(value):
        raise argparse.ArgumentTypeError(f"got {value:g}; must be {says}")
    return value


def at_least(kind, lo):
    """argparse type: an int (``kind`` int) or a float at least ``lo``."""
    return lambda text: _number(text, kind, lambda v: v >= lo, f">= {lo:g}", lo)


def dropout(text: str) -> float:
    """argparse type: a dropout probability, at least 0 and below 1."""
    return _number(text, float, lambda v: 0.0 <= v < 1.0, "in [0, 1)", 0.2)


def fraction(text: str) -> float:
    """argparse type: a number strictly between 0 and 1."""
    return _number(text, float, lambda v: 0.0 < v < 1.0, "between 0 and 1 (exclusive)", 0.05)


def slow_factor(slow_ranks: dict, rank: int, world: int) -> float:
    """This rank's factor from ``--slow-ranks``; a rank the launch does not have is an error (it
    would otherwise be ignored silently)."""
    missing = sorted(r for r in slow_ranks if not 0 <= r < world)
    if missing:
        raise SystemExit(f"error: --slow-ranks names rank {', '.join(map(str, missing))}, but this launch "
                         f"has ranks 0-{world - 1}")
    return slow_ranks.get(rank, 1.0)


def slow_down(model: torch.nn.Module, factor: float) -> None:
    """Emulates an accelerator ``factor`` times slower: each forward pass of ``model`` is followed by
    a sleep of (factor - 1) times its work, the work of a forward with gradients counted as three
    forwards (the backward costs about twice the forward), one without gradients as itself. Inside
    the forward, so the device's own time per micro-batch (what ds_lowcomm's pace reads) grows and
    the time waiting for communication does not."""
    if factor == 1.0:
        return
    started = []

    def before(module, args, kwargs):
        started.append(time.perf_counter())

    def after(module, args, kwargs, output):
        work = (time.perf_counter() - started.pop()) * (3.0 if torch.is_grad_enabled() else 1.0)
        time.sleep((factor - 1.0) * work)

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


def slow_down_from_env(model: torch.nn.Module) -> None:
    """:func:`slow_down` by ``SLOW_RANKS`` ("RANK:FACTOR[,...]") for this process's ``RANK``."""
    spec = parse_slow_ranks(os.environ.get("SLOW_RANKS", ""))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    slow_down(model, slow_factor(spec, rank, world))


def host_group():
    """A gloo group over every rank for a script's host numbers (losses, counts, memory), or None
    without a process group. CPU tensors: reading a result never waits for the GPU, and it is never
    an NCCL collective beside a round ds_lowcomm has in flight on its own communicator (NCCL
    documents concurrent work on two communicators as a possible deadlock). Collective: every rank
    calls it."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return torch.distributed.new_group(backend="gloo")


def max_over_ranks(x: float, group) -> float:
    """``x``'s maximum over the ranks of ``group`` (:func:`host_group`); ``x`` when it is None."""
    if group is None:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return t.item()


def mean_over_ranks(x: float, group) -> float:
    """``x``'s mean over the ranks of ``group`` (:func:`host_group`); ``x`` when it is None."""
    if group is None:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    torch.distributed.all_reduce(t, group=group)
    return t.item() / torch.distributed.get_world_size(group)
