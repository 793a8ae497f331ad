"""Test harness, not part of a user's script: emulates a slower accelerator on the ranks that
``SLOW_RANKS`` names ("RANK:FACTOR[,...]"), as the tests run these scripts with one rank slowed.

A forward hook stretches each forward pass of the model so that the rank's micro-batch takes
FACTOR times as long: with gradients enabled the forward stands for forward and backward (the
backward costs about twice the forward), without them (a forward-only micro-batch) for itself.
"""
import os
import time

import torch


def install(model: torch.nn.Module) -> None:
    """Slow ``model`` down on this rank if ``SLOW_RANKS`` names it; otherwise do nothing."""
    spec = dict(item.split(":") for item in os.environ.get("SLOW_RANKS", "").split(",") if item)
    factor = float(spec.get(os.environ.get("RANK", "0"), 1.0))
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
