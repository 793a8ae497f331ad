"""Collectives tier: the chunked gloo reduce-scatter and all-gather against sums computed here."""
from __future__ import annotations

import pytest
import torch

from dist import run_ranks

pytestmark = pytest.mark.ranks

WORLD, SHARD = 3, 1001  # 1001 elements per shard: chunks of 5 and 6 elements end unevenly


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(WORLD * SHARD, generator=torch.Generator().manual_seed(100 + rank))


def _collectives(rank, world, chunk_bytes):
    import torch.distributed as dist

    import ds_lowcomm.comm.collectives as comm
    from ds_lowcomm import memory

    memory.CHUNK_BYTES = chunk_bytes
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        stats = comm.CommStats()
        c = comm.Collectives(dist.group.WORLD, stats, 30.0, "shard")
        out = {}
        for wire in (torch.float32, torch.bfloat16):
            got = torch.empty(SHARD)
            c.reduce_scatter(got, _inputs(rank), wire_dtype=wire)
            out[f"rs_{wire}"] = got
        # The same sums range by range, last range first (as backward produces gradients): ranges
        # inside one shard, straddling two, and one straddling all three.
        cuts = [0, 400, 1001, 1500, 2600, WORLD * SHARD]
        for wire in (torch.float32, torch.bfloat16):
            op = stats.ops["shard.reduce_scatter"]
            before = (op.bytes_sent, op.bytes_received)
            got = torch.full((SHARD,), float("nan"))
            for start, end in reversed(list(zip(cuts, cuts[1:]))):
                c.reduce_scatter_range(got, _inputs(rank), start, end, wire_dtype=wire)
            c.reduce_scatter_range(got, _inputs(rank), 0, WORLD * SHARD, wire_dtype=wire)  # one range
            out[f"rs_range_{wire}"] = got
            out[f"rs_range_bytes_{wire}"] = (op.bytes_sent - before[0], op.bytes_received - before[1])
        # 2-byte sums reduced into this rank's own part of them (ShardedStepRound, GradBuckets):
        # whole, and range by range in backward order.
        for ranged in (False, True):
            sums = _inputs(rank).bfloat16()
            own = sums[rank * SHARD:(rank + 1) * SHARD]
            if ranged:
                for start, end in reversed(list(zip(cuts, cuts[1:]))):
                    c.reduce_scatter_range(own, sums, start, end)
            else:
                c.reduce_scatter(own, sums)
            out[f"rs_in_place_{ranged}"] = own.clone()
        gathered = torch.empty(WORLD * SHARD)
        c.all_gather(gathered, _inputs(rank)[:SHARD])
        out["ag"] = gathered
        # An fp32 master gathered into a bf16 model, converted chunk by chunk.
        gathered = torch.empty(WORLD * SHARD, dtype=torch.bfloat16)
        c.all_gather(gathered, _inputs(rank)[:SHARD])
        out["ag_to_bf16"] = gathered
        # The same all-gather range by range, in forward order, in bf16 too.
        for dtype in (torch.float32, torch.bfloat16):
            op = stats.ops["shard.all_gather"]
            before = (op.bytes_sent, op.bytes_received)
            got = torch.full((WORLD * SHARD,), float("nan"), dtype=dtype)
            for start, end in zip(cuts, cuts[1:]):
                c.all_gather_range(got, _inputs(rank)[:SHARD].to(dtype), start, end)
            out[f"ag_range_{dtype}"] = got
            out[f"ag_range_bytes_{dtype}"] = (op.bytes_sent - before[0], op.bytes_received - before[1])
        out["ops"] = {k: (v.calls, v.bytes_sent) for k, v in stats.ops.items()}
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunk_bytes", [48, 1 << 25], ids=["many-chunks", "one-chunk"])
def test_reduce_scatter_and_all_gather_match_the_sums(chunk_bytes):
    results = run_ranks(_collectives, WORLD, chunk_bytes)
    inputs = [_inputs(r).view(WORLD, SHARD) for r in range(WORLD)]
    for rank, res in enumerate(results):
        # Summed in rank order in fp32: bit-equal, whatever the chunking.
        want = inputs[0][rank].clone()
        for r in range(1, WORLD):
            want += inputs[r][rank]
        assert torch.equal(res["rs_torch.float32"], want)
        want_bf16 = inputs[0][rank].bfloat16().float()
        for r in range(1, WORLD):
            want_bf16 += inputs[r][rank].bfloat16().float()
        assert torch.equal(res["rs_torch.bfloat16"], want_bf16)
        assert torch.equal(res["rs_range_torch.float32"], want)
        assert torch.equal(res["rs_range_torch.bfloat16"], want_bf16)
        # In place: the same fp32 sum of the bf16 values, rounded once to bf16.
        assert torch.equal(res["rs_in_place_False"], want_bf16.bfloat16())
        assert torch.equal(res["rs_in_place_True"], want_bf16.bfloat16())
        # Ranges tiling the input cost what one reduce-scatter costs (two tilings here).
        for wire, size in ((torch.float32, 4), (torch.bfloat16, 2)):
            assert res[f"rs_range_bytes_{wire}"] == pytest.approx((2 * (WORLD - 1) * SHARD * size,) * 2)
        assert torch.equal(res["ag"], torch.cat([inputs[r].reshape(-1)[:SHARD] for r in range(WORLD)]))
        assert torch.equal(res["ag_to_bf16"], res["ag"].bfloat16())
        for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
            want_ag = torch.cat([inputs[r].reshape(-1)[:SHARD] for r in range(WORLD)]).to(dtype)
            assert torch.equal(res[f"ag_range_{dtype}"], want_ag)
            # Ranges tiling the output cost what one all-gather costs.
            assert res[f"ag_range_bytes_{dtype}"] == pytest.approx(((WORLD - 1) * SHARD * size,) * 2)
        # Counted once per collective, at the ring formula's bytes: (W-1)/W of the full tensor.
        calls, sent = res["ops"]["shard.reduce_scatter"]
        # (three times each wire dtype, plus the two in-place bf16 tilings)
        assert calls == 2 + 2 * 6 + 1 + 5
        assert sent == pytest.approx((WORLD - 1) * SHARD * (3 * (4 + 2) + 2 * 2))
        calls, sent = res["ops"]["shard.all_gather"]
        assert calls == 2 + 2 * 5 and sent == pytest.approx((WORLD - 1) * SHARD * (4 + 2 + 4 + 2))


#: (input, wire, output) dtypes of the native branch's reduce-scatter: as they are, and converted
NATIVE_CASES = ((torch.float32, torch.float32, torch.float32), (torch.float32, torch.bfloat16, torch.float32),
                (torch.bfloat16, torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16))


def _native(rank, world, chunk_bytes):
    """The branch NCCL takes (the backend's own reduce-scatter and all-gather), run on gloo."""
    import torch.distributed as dist

    import ds_lowcomm.comm.collectives as comm

    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestResult(TorchDispatchMode):
        """The most elements any op's newly allocated result held: views and in-place results
        (sharing an argument's storage) aside, and ``torch.empty`` (on CPU ``temporary()`` cuts
        its chunk buffers from a large block whose rest is never touched)."""
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func is not torch.ops.aten.empty.memory_format and isinstance(result, torch.Tensor):
                held = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                        if isinstance(a, torch.Tensor)}
                if result.untyped_storage().data_ptr() not in held:
                    LargestResult.largest = max(LargestResult.largest, result.numel())
            return result

    comm.NATIVE_CHUNK_BYTES = chunk_bytes
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        stats = comm.CommStats()
        c = comm.Collectives(dist.group.WORLD, stats, 30.0, "shard")
        c.native = True  # the branch NCCL takes
        out = {"largest": {}}
        for inp_dtype, wire, out_dtype in NATIVE_CASES:
            got = torch.full((SHARD,), float("nan"), dtype=out_dtype)
            inp = _inputs(rank).to(inp_dtype)
            LargestResult.largest = 0
            with LargestResult():
                c.reduce_scatter(got, inp, wire_dtype=wire)
            out["largest"][f"rs_{inp_dtype}_{wire}"] = LargestResult.largest
            out[f"rs_{inp_dtype}_{wire}_{out_dtype}"] = got.float()
        for dtype in (torch.float32, torch.bfloat16):
            gathered = torch.full((WORLD * SHARD,), float("nan"), dtype=dtype)
            shard = _inputs(rank)[:SHARD]
            LargestResult.largest = 0
            with LargestResult():
                c.all_gather(gathered, shard)  # fp32 shard, converted when bf16
            out["largest"][f"ag_{dtype}"] = LargestResult.largest
            out[f"ag_{dtype}"] = gathered
        out["ops"] = {k: (v.calls, v.bytes_sent) for k, v in stats.ops.items()}
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunk_bytes", [48, 1 << 26], ids=["many-chunks", "one-chunk"])
def test_native_branch_matches_the_sums(chunk_bytes):
    """NCCL's branch sums in the wire dtype in the backend's order: equal to the sums computed
    here within what that dtype's rounding allows; a conversion goes chunk by chunk."""
    results = run_ranks(_native, WORLD, chunk_bytes)
    inputs = [_inputs(r).view(WORLD, SHARD) for r in range(WORLD)]
    for rank, res in enumerate(results):
        for inp_dtype, wire, out_dtype in NATIVE_CASES:
            want = sum(inputs[r][rank].to(inp_dtype).to(wire).double() for r in range(WORLD))
            tol = 1e-6 if wire == out_dtype == torch.float32 else 2e-2  # bf16: 8 bits of mantissa
            got = res[f"rs_{inp_dtype}_{wire}_{out_dtype}"].double()
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * 3)
        whole = torch.cat([inputs[r].reshape(-1)[:SHARD] for r in range(WORLD)])
        assert torch.equal(res["ag_torch.float32"], whole)
        assert torch.equal(res["ag_torch.bfloat16"], whole.bfloat16())  # converted once, exactly
        if chunk_bytes == 48:  # converted 4 elements per rank at a time: no buffer-sized copy
            assert max(res["largest"].values()) <= WORLD * 4, res["largest"]
        calls, sent = res["ops"]["shard.reduce_scatter"]  # one per call, the ring formula's bytes
        assert calls == 4 and sent == pytest.approx((WORLD - 1) * SHARD * (4 + 2 + 4 + 2))
        calls, sent = res["ops"]["shard.all_gather"]
        assert calls == 2 and sent == pytest.approx((WORLD - 1) * SHARD * (4 + 2))


ONE_CASES = ((torch.float32, torch.float32, torch.float32), (torch.float32, torch.bfloat16, torch.float32),
             (torch.bfloat16, torch.float32, torch.bfloat16), (torch.float32, torch.float16, torch.bfloat16))


def _group_of_one(rank, world):
    import torch.distributed as dist

    import ds_lowcomm.comm.collectives as comm
    from ds_lowcomm import memory
    from ds_lowcomm.comm.topology import Topology

    memory.CHUNK_BYTES = 48  # conversions 12 fp32 elements at a time: chunk ends fall mid-range
    dist.init_process_group("gloo", rank=rank, world_size=world)
    created = []
    new_group = dist.new_group

    def counting(ranks=None, *args, **kwargs):
        created.append(len(ranks) if ranks is not None else world)
        return new_group(ranks, *args, **kwargs)

    dist.new_group = counting
    try:
        stats = comm.CommStats()
        topo = Topology.build(1, 30.0, stats)
        c = topo.shard
        out = {"created": created, "shard_world": c.world, "replica_world": topo.replica.world}
        x = _inputs(rank)
        for inp_dtype, wire, out_dtype in ONE_CASES:
            got = torch.full((x.numel(),), float("nan"), dtype=out_dtype)
            c.reduce_scatter(got, x.to(inp_dtype), wire_dtype=wire)
            out[f"rs_{inp_dtype}_{wire}_{out_dtype}"] = got
            got = torch.full((x.numel(),), float("nan"), dtype=out_dtype)
            for start, end in ((1500, x.numel()), (0, 7), (7, 1500)):
                c.reduce_scatter_range(got, x.to(inp_dtype), start, end, wire_dtype=wire)
            out[f"rs_range_{inp_dtype}_{wire}_{out_dtype}"] = got
        sums = x.bfloat16()
        c.reduce_scatter(sums, sums)  # in place, as a 2-byte round reduces its own part
        out["rs_in_place"] = sums
        for dtype in (torch.float32, torch.bfloat16):
            got = torch.full((x.numel(),), float("nan"), dtype=dtype)
            c.all_gather(got, x)
            out[f"ag_{dtype}"] = got
            got = torch.full((x.numel(),), float("nan"), dtype=dtype)
            for start, end in ((0, 7), (7, 1500), (1500, x.numel())):
                c.all_gather_range(got, x, start, end)
            out[f"ag_range_{dtype}"] = got
        t = x.clone()
        c.all_reduce(t)
        out["ar"] = t
        out["ops"] = {k: (v.calls, v.bytes_sent, v.bytes_received) for k, v in stats.ops.items()}
        return out
    finally:
        dist.new_group = new_group
        dist.destroy_process_group()


def test_a_shard_group_of_one_is_no_process_group():
    """``shard_group_size: 1`` creates no group of one rank (on GPUs each would be an eagerly
    created NCCL communicator): the replica group and the gloo control group only. Its
    collectives are the sums over one rank: the input through the wire dtype, zero bytes."""
    results = run_ranks(_group_of_one, 2)
    for rank, res in enumerate(results):
        assert sorted(res["created"]) == [2, 2], res["created"]  # the replica group, the control group
        assert (res["shard_world"], res["replica_world"]) == (1, 2)
        x = _inputs(rank)
        for inp_dtype, wire, out_dtype in ONE_CASES:
            want = x.to(inp_dtype).to(wire).to(out_dtype)
            assert torch.equal(res[f"rs_{inp_dtype}_{wire}_{out_dtype}"], want), (inp_dtype, wire, out_dtype)
            assert torch.equal(res[f"rs_range_{inp_dtype}_{wire}_{out_dtype}"], want), (inp_dtype, wire, out_dtype)
        assert torch.equal(res["rs_in_place"], x.bfloat16())
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(res[f"ag_{dtype}"], x.to(dtype))
            assert torch.equal(res[f"ag_range_{dtype}"], x.to(dtype))
        assert torch.equal(res["ar"], x)
        assert res["ops"] == {"shard.reduce_scatter": (4 * len(ONE_CASES) + 1, 0.0, 0.0),
                              "shard.all_gather": (2 * 4, 0.0, 0.0), "shard.all_reduce": (1, 0.0, 0.0)}
