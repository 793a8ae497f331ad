"""The native (NCCL) branch's failures at the wait become a :class:`CollectiveError`: a gloo group
whose peer stalls, on the native branch (``Collectives.native = True``), fails each collective at
the wait of its asynchronous work, where NCCL reports one under ``TORCH_NCCL_BLOCKING_WAIT=1``.
torch's ``fake`` backend covers the failures at enqueue (tests/test_nccl_fake.py).
"""
from __future__ import annotations

import time

import pytest
import torch

from dist import run_ranks

pytestmark = pytest.mark.ranks

TIMEOUT_S = 2.0


def _stalled_peer(rank, world):
    """Rank 0 calls the native branch on a gloo group (timeout TIMEOUT_S) while rank 1 stalls,
    then exits; returns each call's error, when it came and whether the work's wait raised it."""
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    import ds_lowcomm.comm.collectives as comm

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    dist.barrier()
    if rank == 1:
        time.sleep(TIMEOUT_S * 1.5)  # stalled through rank 0's first call, then gone
        return None
    c = comm.Collectives(dist.group.WORLD, comm.CommStats(), TIMEOUT_S, "replica")
    c.native = True
    out = {}
    x = torch.randn(2 * 8)
    calls = {"reduce_scatter": lambda: c.reduce_scatter(torch.empty(8), x),
             "reduce_scatter_range": lambda: c.reduce_scatter_range(torch.empty(8), x, 3, 12),
             "all_gather": lambda: c.all_gather(torch.empty(16, dtype=torch.bfloat16), x[:8]),
             "all_gather_range": lambda: c.all_gather_range(torch.empty(16), x[:8], 3, 12),
             "all_reduce": lambda: c.all_reduce(x),
             # issued without waiting (desloc's streamed sync): the failure comes at the wait
             "asynchronous all_reduce": lambda: _issued_then_waited(c, x)}
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = None
        except Exception as err:
            frames = traceback.extract_tb(err.__cause__.__traceback__) if err.__cause__ else []
            at_wait = any(f.filename.endswith("collectives.py") and "work.wait()" in (f.line or "") for f in frames)
            out[name] = (type(err).__name__, str(err), time.monotonic() - t0, at_wait)
    return out


def _issued_then_waited(c, x):
    pending = c.asynchronous()
    pending.all_reduce(x)
    pending.wait()


def test_a_stalled_peer_fails_the_wait_with_a_collective_error():
    """The native branch issues each collective asynchronously and waits inside its error
    handling: a failure the backend reports at the wait (gloo's timeout here; NCCL's with
    ``TORCH_NCCL_BLOCKING_WAIT=1``) is a :class:`CollectiveError` from every public method, the
    first one after the group's timeout, not before."""
    res = run_ranks(_stalled_peer, 2)[0]
    for name, error in res.items():
        assert error is not None, f"{name}: returned with its peer stalled"
        kind, message, elapsed, _ = error
        assert kind == "CollectiveError", (name, error)
        assert f"{name.split('_range')[0].split(' ')[-1]} of " in message and "replica group failed on global rank 0" in message
        assert f"collective_timeout_s={TIMEOUT_S:g}" in message and "Another rank probably died" in message
    kind, message, elapsed, at_wait = res["reduce_scatter"]
    assert at_wait, "the first failure did not come from the work's wait"
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 30, elapsed
