"""The native (NCCL) branch on a backend that is not gloo, in this one process: torch's ``fake``
backend (torch/testing/_internal/distributed/fake_pg.py) makes this process rank r of 8 for each r
in turn, with no communication and garbage results. :class:`Collectives` takes the native branch
by itself there; what is checked is what does not depend on the data: the sequence of collectives
(NCCL needs it equal on every rank), NCCL's in-place rule, and that a backend whose collectives
fail (``error_on_collective``) makes every public method raise :class:`CollectiveError`.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

WORLD, SHARD = 8, 24


def _calls(c, rank: int):
    """Every public method of ``c`` once, by name (a callable each)."""
    x = torch.randn(WORLD * SHARD)
    sums = x.bfloat16()
    own = sums[rank * SHARD:(rank + 1) * SHARD]
    out = torch.empty(SHARD)
    return {
        "reduce_scatter": lambda: c.reduce_scatter(out, x),
        "reduce_scatter converting": lambda: c.reduce_scatter(out, x, wire_dtype=torch.bfloat16),
        "reduce_scatter in place": lambda: c.reduce_scatter(own, sums),
        "reduce_scatter_range": lambda: c.reduce_scatter_range(out, x, 5, 2 * SHARD + 3),
        "all_gather": lambda: c.all_gather(torch.empty(WORLD * SHARD), x[:SHARD]),
        "all_gather converting": lambda: c.all_gather(torch.empty(WORLD * SHARD, dtype=torch.bfloat16), x[:SHARD]),
        "all_gather_range": lambda: c.all_gather_range(torch.empty(WORLD * SHARD), x[:SHARD], 5, 2 * SHARD + 3),
        "all_reduce": lambda: c.all_reduce(x.double()),
    }


def _fake_ranks():
    """In this process, each rank of 8 in turn on the fake backend: the calls each issues, and
    what the failing fake backend raises."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers the "fake" backend
    from torch._C._distributed_c10d import FakeProcessGroup
    from torch.utils._python_dispatch import TorchDispatchMode

    import ds_lowcomm.comm.collectives as comm

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.in_place = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                self.ops.append((str(func), tuple((str(t.dtype), tuple(t.shape)) for t in tensors)))
                if str(func) == "c10d._reduce_scatter_base_.default":
                    out, inp = tensors[0], tensors[1]
                    if out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
                        self.in_place.append((out.data_ptr() - inp.data_ptr()) // inp.element_size() // out.numel())
            return func(*args, **(kwargs or {}))

    out = {"ops": [], "in_place": [], "errors": {}}
    for r in range(WORLD):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=r, world_size=WORLD)
        try:
            c = comm.Collectives(dist.group.WORLD, comm.CommStats(), 30.0, "shard")
            assert c.native and c.world == WORLD and c.rank == r
            with Recorder() as recorder:
                for call in _calls(c, r).values():
                    call()
            out["ops"].append(recorder.ops)
            out["in_place"].append(recorder.in_place)
        finally:
            dist.destroy_process_group()
    options = FakeProcessGroup.Options()
    options.error_on_collective = True
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=3, world_size=WORLD, pg_options=options)
    try:
        c = comm.Collectives(dist.group.WORLD, comm.CommStats(), 30.0, "shard")
        for name, call in _calls(c, 3).items():
            try:
                call()
                out["errors"][name] = None
            except Exception as err:  # what the caller sees
                out["errors"][name] = (type(err).__name__, str(err), type(err.__cause__).__name__)
    finally:
        dist.destroy_process_group()
    return out


def test_the_native_branch_on_a_backend_that_is_not_gloo():
    """Every rank issues the same collectives in the same order, none an all-to-all; the in-place
    2-byte reduce-scatter hands NCCL an output at the input plus rank·count; a failing backend
    makes every public method raise :class:`CollectiveError` naming the collective, the group,
    the rank and the timeout, with the backend's error as its cause."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "this test makes this process a rank of its own"
    res = _fake_ranks()
    assert not dist.is_initialized()
    assert res["ops"][0] and all(ops == res["ops"][0] for ops in res["ops"])
    assert not any("alltoall" in name for name, _ in res["ops"][0])
    assert res["in_place"] == [[r] for r in range(WORLD)]
    for name, error in res["errors"].items():
        assert error is not None, f"{name}: no error from a failing backend"
        kind, message, cause = error
        op = name.split()[0].replace("_range", "")  # a range is counted as its collective
        assert kind == "CollectiveError" and cause == "RuntimeError", (name, error)
        assert f"{op} of " in message and "on the shard group failed on global rank 3" in message, message
        assert "collective_timeout_s=30" in message and "error_on_collective" in message, message
