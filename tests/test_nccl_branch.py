"""The native (NCCL) branch of :class:`Collectives` at 8 ranks, with real results.

No GPU here, and torch's ``fake`` backend returns garbage: the native branch runs on 8 real gloo
ranks instead (``Collectives.native = True``: the backend's own reduce-scatter, all-gather,
reduce, broadcast and all-reduce, each issued asynchronously and waited for, as on NCCL). Every
public method, the converting and chunked paths included (chunks of a few elements, and one
chunk), is checked against the sums computed here within the summation's rounding bound, and
against the gloo branch's results on the same inputs; the byte counters of both branches agree,
and every rank issues the same sequence of collectives (what NCCL needs), none of them an
all-to-all (no point-to-point connections).
"""
from __future__ import annotations

import pytest
import torch

from dist import run_ranks

pytestmark = pytest.mark.ranks

WORLD, SHARD = 8, 37
#: ranges tiling the buffer: inside shard 0, ending at its end, inside shard 1, across shards
#: 1-4 (its part in shard 4 one element), across 4-7
CUTS = [0, 10, SHARD, 60, 149, WORLD * SHARD]
#: (input, wire, output) dtypes of reduce_scatter: as they are, converted, 2-byte
RS_CASES = ((torch.float32, torch.float32, torch.float32), (torch.float32, torch.bfloat16, torch.float32),
            (torch.bfloat16, torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16))
#: NATIVE_CHUNK_BYTES in the chunked run: 5 fp32 or 10 bf16 elements per rank per chunk (37 is
#: not a multiple of either), and the shipped value (one chunk)
SMALL_CHUNK = 160


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(WORLD * SHARD, generator=torch.Generator().manual_seed(1000 + rank))


def _exercise(c, x: torch.Tensor, cuts) -> dict:
    """Every public method of ``c`` on this rank's inputs ``x`` (the whole buffer, c.world
    shards), its ranges ``cuts``; the results by name."""
    out = {}
    shard, rank, full = x.numel() // c.world, c.rank, x.numel()

    def nan(n, dtype=torch.float32):
        return torch.full((n,), float("nan"), dtype=dtype, device=x.device)

    for inp_dtype, wire, out_dtype in RS_CASES:
        got = nan(shard, out_dtype)
        c.reduce_scatter(got, x.to(inp_dtype), wire_dtype=wire)
        out[("rs", inp_dtype, wire)] = got
    sums = x.bfloat16()
    own = sums[rank * shard:(rank + 1) * shard]
    c.reduce_scatter(own, sums)  # in place, 2 bytes (NCCL: recv == send + rank·count)
    out[("rs_in_place",)] = own.clone()
    for wire in (torch.float32, torch.bfloat16):
        got = nan(shard)
        for start, end in reversed(list(zip(cuts, cuts[1:]))):  # backward order, as buckets go
            c.reduce_scatter_range(got, x, start, end, wire_dtype=wire)
        out[("rs_range", wire)] = got
    sums = x.bfloat16()
    own = sums[rank * shard:(rank + 1) * shard]
    for start, end in reversed(list(zip(cuts, cuts[1:]))):
        c.reduce_scatter_range(own, sums, start, end)  # in place, range by range
    out[("rs_range_in_place",)] = own.clone()
    mine = x[rank * shard:(rank + 1) * shard]
    for dtype in (torch.float32, torch.bfloat16):  # fp32 shard; into bf16: converted
        got = nan(full, dtype)
        c.all_gather(got, mine)
        out[("ag", dtype)] = got
        got = nan(full, dtype)
        for start, end in zip(cuts, cuts[1:]):
            c.all_gather_range(got, mine, start, end)
        out[("ag_range", dtype)] = got
    for dtype in (torch.float64, torch.float32):
        t = x.to(dtype)
        c.all_reduce(t)
        out[("ar", dtype)] = t
    return out


def _ranks(rank, world):
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import ds_lowcomm.comm.collectives as comm

    class Recorder(TorchDispatchMode):
        """Each collective this rank issues (c10d ops): name, tensors' dtype and shape, and its
        integer arguments (roots, sizes)."""

        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                leaves = torch.utils._pytree.tree_leaves((args, kwargs))
                self.ops.append((str(func), tuple((str(a.dtype), tuple(a.shape)) if isinstance(a, torch.Tensor)
                                                  else a for a in leaves if isinstance(a, (torch.Tensor, int)))))
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = {"results": {}, "ops": {}, "counters": {}}
        stats = comm.CommStats()
        c = comm.Collectives(dist.group.WORLD, stats, 30.0, "shard")
        assert not c.native  # gloo: the chunked all-to-all branch
        res["results"]["gloo"] = _exercise(c, _inputs(rank), CUTS)
        res["counters"]["gloo"] = {k: (v.calls, v.bytes_sent, v.bytes_received) for k, v in stats.ops.items()}
        for name, chunk in (("small", SMALL_CHUNK), ("shipped", comm.NATIVE_CHUNK_BYTES)):
            saved, comm.NATIVE_CHUNK_BYTES = comm.NATIVE_CHUNK_BYTES, chunk
            stats = comm.CommStats()
            c = comm.Collectives(dist.group.WORLD, stats, 30.0, "shard")
            c.native = True  # the branch NCCL takes
            try:
                with Recorder() as recorder:
                    res["results"][name] = _exercise(c, _inputs(rank), CUTS)
            finally:
                comm.NATIVE_CHUNK_BYTES = saved
            res["ops"][name] = recorder.ops
            res["counters"][name] = {k: (v.calls, v.bytes_sent, v.bytes_received) for k, v in stats.ops.items()}
        return res
    finally:
        dist.destroy_process_group()


#: unit roundoff of each dtype: a sum of W terms in it is within W·u·Σ|terms| of the exact sum
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float64: 2.0 ** -53}


def _bound(terms: torch.Tensor, wire: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """How far from the exact sum of ``terms`` (rank, element) a sum computed in ``wire`` in any
    order and rounded once to ``out_dtype`` may be: the classic W·u·Σ|terms| plus the rounding."""
    return WORLD * UNIT[wire] * terms.abs().sum(0) + UNIT[out_dtype] * terms.sum(0).abs()


def _expected(rank: int):
    """By result name: (terms, wire dtype, output dtype) of a sum, or the exact tensor of a gather."""
    xs = torch.stack([_inputs(r) for r in range(WORLD)]).double()
    mine = xs[:, rank * SHARD:(rank + 1) * SHARD]
    want = {("rs", i, w): (mine.to(i).to(w).double(), w, o) for i, w, o in RS_CASES}
    want[("rs_in_place",)] = want[("rs_range_in_place",)] = (mine.bfloat16().double(), torch.bfloat16, torch.bfloat16)
    for wire in (torch.float32, torch.bfloat16):
        want[("rs_range", wire)] = (mine.to(wire).double(), wire, torch.float32)
    for dtype in (torch.float64, torch.float32):
        want[("ar", dtype)] = (xs.to(dtype).double(), dtype, dtype)
    whole = torch.cat([xs[r, r * SHARD:(r + 1) * SHARD] for r in range(WORLD)]).float()
    for dtype in (torch.float32, torch.bfloat16):
        want[("ag", dtype)] = want[("ag_range", dtype)] = whole.to(dtype)
    return want


def test_the_native_branch_matches_the_sums_and_the_gloo_branch_at_8_ranks():
    results = run_ranks(_ranks, WORLD)
    for rank, res in enumerate(results):
        want = _expected(rank)
        gloo = res["results"]["gloo"]
        assert set(gloo) == set(want)
        for branch in ("small", "shipped"):
            got = res["results"][branch]
            assert set(got) == set(want)
            for key, expected in want.items():
                value, theirs = got[key], gloo[key]
                assert value.dtype == theirs.dtype and value.shape == theirs.shape, key
                if isinstance(expected, torch.Tensor):  # a gather moves values: exact
                    assert torch.equal(value, expected) and torch.equal(theirs, expected), (rank, branch, key)
                    continue
                terms, wire, out_dtype = expected
                exact, bound = terms.sum(0), _bound(terms, wire, out_dtype)
                err = (value.double() - exact).abs()
                assert torch.all(err <= bound), (rank, branch, key, (err / bound).max().item())
                # The gloo branch sums in fp32 in rank order (all-reduce: gloo's own, in the dtype).
                glo = _bound(terms, torch.float64 if wire == torch.float64 else torch.float32, out_dtype)
                assert torch.all((value.double() - theirs.double()).abs() <= bound + glo), (rank, branch, key)
            # Counted alike: the same calls and ring-formula bytes on both branches.
            assert res["counters"][branch] == res["counters"]["gloo"], (branch, res["counters"])
    # The same collectives in the same order on every rank, and never an all-to-all (NCCL would
    # open point-to-point connections to every peer for one).
    for branch in ("small", "shipped"):
        sequences = [res["ops"][branch] for res in results]
        assert sequences[0] and all(s == sequences[0] for s in sequences), branch
        names = {name for name, _ in sequences[0]}
        assert not any("alltoall" in n for n in names), names
    # Chunking happened: the converting reduce-scatters in chunks of 10 bf16 / 5 fp32 elements per
    # rank, the converting all-gather in chunks of 10 bf16 elements; one call each when shipped.
    rs, ag = "c10d._reduce_scatter_base_.default", "c10d._allgather_base_.default"
    small = [name for name, _ in results[0]["ops"]["small"]]
    shipped = [name for name, _ in results[0]["ops"]["shipped"]]
    assert small.count(rs) == 1 + -(-SHARD // 10) + -(-SHARD // 5) + 1 + 1, small.count(rs)  # + in place
    assert shipped.count(rs) == 5
    assert small.count(ag) == 1 + -(-SHARD // 10) and shipped.count(ag) == 2
    # One reduce (broadcast) per shard a range touches: 1 + 1 + 1 + 4 + 4 per tiling.
    per_tiling = 11
    assert small.count("c10d.reduce_.default") == 3 * per_tiling
    assert small.count("c10d.broadcast_.default") == 2 * per_tiling


def _one_gpu(rank, world):
    """The native branch on real NCCL: a group of this one GPU (what ``shard_group_size: 1``
    replaces by GroupOfOne), every public method issued from a side stream as the comm worker
    issues them; the results read back on the host."""
    import torch.distributed as dist

    import ds_lowcomm.comm.collectives as comm

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        c = comm.Collectives(dist.group.WORLD, comm.CommStats(), 60.0, "shard")
        assert c.native
        x, side = _inputs(0)[:SHARD].cuda(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = _exercise(c, x, (0, 10, SHARD))
        side.synchronize()
        return {k: v.cpu() for k, v in out.items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_the_native_branch_on_one_gpus_nccl():
    """On one GPU the sum over the group is the input through the wire dtype, exactly."""
    res, = run_ranks(_one_gpu, 1, env={})
    x = _inputs(0)[:SHARD]
    for inp_dtype, wire, out_dtype in RS_CASES:
        assert torch.equal(res[("rs", inp_dtype, wire)], x.to(inp_dtype).to(wire).to(out_dtype)), (inp_dtype, wire)
    for wire in (torch.float32, torch.bfloat16):
        assert torch.equal(res[("rs_range", wire)], x.to(wire).float()), wire
    assert torch.equal(res[("rs_in_place",)], x.bfloat16()) and torch.equal(res[("rs_range_in_place",)], x.bfloat16())
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(res[("ag", dtype)], x.to(dtype)) and torch.equal(res[("ag_range", dtype)], x.to(dtype))
    for dtype in (torch.float64, torch.float32):
        assert torch.equal(res[("ar", dtype)], x.to(dtype))

