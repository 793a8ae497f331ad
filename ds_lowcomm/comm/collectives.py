"""Collectives on ds_lowcomm's private process groups, with byte accounting and timeouts.

Every collective ds_lowcomm issues during training goes through :class:`Collectives`, so the
byte counters in :class:`CommStats` are complete. Bytes are counted as a bandwidth-optimal (ring)
implementation moves them per rank, which is what NCCL and gloo's ring algorithms put on the wire:

=================  ==========================  ==========================
collective         sent per rank               received per rank
=================  ==========================  ==========================
reduce-scatter     (W-1)/W · input bytes       (W-1)/W · input bytes
all-gather         (W-1)/W · output bytes      (W-1)/W · output bytes
all-reduce         2(W-1)/W · bytes            2(W-1)/W · bytes
=================  ==========================  ==========================
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ds_lowcomm import memory
from ds_lowcomm.memory import temporary

# torch 2.13 deprecates the *_tensor spellings in favour of the *_single ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: bytes of each chunk of a native (NCCL) reduce-scatter or all-gather that converts dtypes: a
#: converted copy of the whole buffer would cost 2-4 bytes per parameter of GPU memory, many
#: small chunks would cost kernel launches
NATIVE_CHUNK_BYTES = 64 << 20


def wire_bytes(op: str, nbytes: int, world: int) -> Tuple[float, float]:
    """(sent, received) bytes per rank for collective ``op`` over ``nbytes`` on ``world`` ranks.

    ``nbytes`` is the full (unsharded) size: the reduce-scatter input, the all-gather output or
    the all-reduced tensor.
    """
    if world <= 1:
        return 0.0, 0.0
    share = (world - 1) / world * nbytes
    if op == "all_reduce":
        return 2 * share, 2 * share
    if op in ("reduce_scatter", "all_gather"):
        return share, share
    raise ValueError(f"unknown collective {op!r}")


@dataclass
class OpStats:
    """One collective's totals in this process: calls, bytes this rank sent and received (the
    algorithm's, not the backend's), and seconds spent in it."""
    calls: int = 0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    seconds: float = 0.0


class CommStats:
    """Counters for one process: per collective, plus the time training waited for rounds."""

    def __init__(self) -> None:
        self.ops: Dict[str, OpStats] = defaultdict(OpStats)
        #: the training thread blocked on the host for a round (a synchronous round: all of its time)
        self.host_wait_seconds = 0.0
        #: the training stream held by a round still running on the side stream (CUDA only; timed
        #: by events around the stream's wait, counted once they have completed)
        self.device_wait_seconds = 0.0
        self.round_seconds = 0.0
        self.rounds = 0
        #: round verdicts the host read before their copy had landed: on a GPU each is a host
        #: wait for the device (a synchronous step's one read of its norm)
        self.verdict_waits = 0

    def record(self, op: str, sent: float, received: float, seconds: float) -> None:
        """Add one call of collective ``op`` to its totals."""
        s = self.ops[op]
        s.calls += 1
        s.bytes_sent += sent
        s.bytes_received += received
        s.seconds += seconds

    @property
    def exposed_comm_seconds(self) -> float:
        """Communication training waited for: on the host and on the device."""
        return self.host_wait_seconds + self.device_wait_seconds

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank sent, over every collective."""
        return sum(s.bytes_sent for s in self.ops.values())

    @property
    def bytes_received(self) -> float:
        """Bytes this rank received, over every collective."""
        return sum(s.bytes_received for s in self.ops.values())

    def as_dict(self) -> dict:
        """A JSON-ready copy: totals, rounds, time waited and per-collective counters."""
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "rounds": self.rounds, "round_seconds": self.round_seconds, "verdict_waits": self.verdict_waits,
                "exposed_comm_seconds": self.exposed_comm_seconds,
                "host_wait_seconds": self.host_wait_seconds, "device_wait_seconds": self.device_wait_seconds,
                "ops": {name: asdict(s) for name, s in sorted(self.ops.items())}}


def destroy_group(group) -> None:
    """Destroy ``group`` if torch still has it: not after ``destroy_process_group()`` destroyed
    every group, nor after the world was initialised again, nor a second time. No communication
    on gloo; NCCL's shutdown of a communicator is collective in some NCCL versions, so every
    member calls this at the same point."""
    # torch 2.13 keeps the live groups in a private registry; destroying one it no longer holds
    # raises "Invalid process group specified".
    if group is not None and dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
        dist.destroy_process_group(group)


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank died, stalled or disagrees on shapes."""


class Collectives:
    """Collectives on one process group, counted in ``stats``.

    Blocking calls; the caller decides which thread they run on. A failure (a dead peer closes its
    sockets; a stalled one trips the group's timeout) is re-raised as :class:`CollectiveError`
    naming the rank, the collective and the timeout, so the job exits instead of hanging.

    Two branches, chosen by the group's backend (:attr:`native`): on gloo, chunked all-to-alls
    and sums computed here; on every other backend (NCCL) the backend's own collectives, each
    issued asynchronously and waited for inside the call, so that a failure the backend reports
    at the wait is a :class:`CollectiveError` too. What that covers on NCCL: an error at enqueue
    (a communicator already aborted), and with ``TORCH_NCCL_BLOCKING_WAIT=1`` a timeout or NCCL
    error (torch 2.13's ``WorkNCCL::wait`` then blocks this thread until the collective
    completes, aborts the communicator on a timeout and raises). By default NCCL's wait only
    makes the current stream wait: a peer that dies later is found by torch's watchdog thread,
    which takes the process down itself (docs/gpu.md).
    """

    def __init__(self, group, stats: CommStats, timeout_s: float, name: str) -> None:
        self.group = group
        self.stats = stats
        self.timeout_s = timeout_s
        self.name = name
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        #: the global rank of each member, by rank in the group
        self.ranks = dist.get_process_group_ranks(group)
        #: whether this group takes the native branch (the backend's own reduce-scatter,
        #: all-gather, reduce and broadcast: NCCL's) rather than the gloo one. gloo (torch 2.13)
        #: implements reduce-scatter as a full all-reduce on the wire: 2x the bytes of a ring
        #: reduce-scatter (measured at the link); an all-to-all of the W shards plus a local sum
        #: moves exactly (W-1)/W of the input per rank, like NCCL's reduce-scatter. Tests set it
        #: on a gloo group to run the native branch with real results (tests/test_nccl_branch.py).
        self.native = dist.get_backend(group) != "gloo"

    def _run(self, op: str, nbytes: int, fn, *args, counted: Optional[Tuple[float, float]] = None):
        """``fn(*args, group=...)``, timed and counted as collective ``op`` over ``nbytes`` (by
        :func:`wire_bytes`, or ``counted`` = (sent, received)); any failure inside it, at enqueue
        or at a wait, is raised as :class:`CollectiveError`."""
        t0 = time.perf_counter()
        try:
            fn(*args, group=self.group)
        except Exception as err:  # gloo raises RuntimeError, NCCL DistBackendError
            raise self._failed(op, nbytes, t0, err) from err
        sent, received = counted if counted is not None else wire_bytes(op, nbytes, self.world)
        # Keyed by group too: what crosses the slow replica links is reported on its own.
        self.stats.record(f"{self.name}.{op}", sent, received, time.perf_counter() - t0)

    def _call(self, fn, *args, group, **kwargs) -> None:
        """One torch.distributed collective ``fn`` on ``group``. On the native branch it is
        issued with ``async_op=True`` and its work waited for here, inside :meth:`_run`'s
        ``try``: torch 2.13's NCCL returns no work at all for a synchronous collective (it runs
        on the current stream), so an error NCCL reports at the wait could not reach us
        otherwise. The wait orders the current stream after NCCL's (the next kernel on it, a
        chunk buffer's refill included, runs after the collective) and, without
        ``TORCH_NCCL_BLOCKING_WAIT``, does not block this thread. On gloo a synchronous call
        (torch waits for gloo's work itself)."""
        if not self.native:
            fn(*args, group=group, **kwargs)
            return
        work = fn(*args, group=group, async_op=True, **kwargs)
        if work is not None:  # None: a backend that completed it synchronously
            work.wait()

    def _failed(self, op: str, nbytes: int, t0: float, err: Exception) -> CollectiveError:
        return CollectiveError(
            f"ds_lowcomm: {op} of {nbytes} bytes on the {self.name} group failed on global rank "
            f"{dist.get_rank()} after {time.perf_counter() - t0:.1f}s "
            f"(collective_timeout_s={self.timeout_s:g}): {err}. Another rank probably died or "
            f"stalled; its log says why.")

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       wire_dtype: Optional[torch.dtype] = None) -> None:
        """Sum ``inp`` (W equal shards, flat) over the group; this rank's shard lands in ``out``.

        ``wire_dtype`` (default ``inp``'s): what is sent, ``inp`` converted to it. Cost:
        (W-1)/W · inp's numel · wire bytes sent and received. On gloo the conversion and the
        exchange go chunk by chunk (transients of ``CHUNK_BYTES``) and the sum is in fp32, in
        rank order (deterministic, the same on every rank). On NCCL the backend sums, in the wire
        dtype and its ring's order (what stock DeepSpeed gets too); a conversion goes chunk by
        chunk (transients of ``NATIVE_CHUNK_BYTES``).
        """
        wire_dtype = wire_dtype or inp.dtype
        nbytes = inp.numel() * torch.empty((), dtype=wire_dtype).element_size()
        if not self.native:
            self._run("reduce_scatter", nbytes, self._reduce_scatter_by_chunks, out, inp, wire_dtype)
        elif inp.dtype == wire_dtype == out.dtype:  # in place too (NCCL: out == inp + rank·count)
            self._run("reduce_scatter", nbytes, self._call, _reduce_scatter, out, inp)
        else:
            self._run("reduce_scatter", nbytes, self._reduce_scatter_converting, out, inp, wire_dtype)

    def _reduce_scatter_converting(self, out: torch.Tensor, inp: torch.Tensor,
                                   wire_dtype: torch.dtype, group) -> None:
        """The native reduce-scatter when ``inp`` or ``out`` is not in the wire dtype: one call
        per chunk of the shard, converted into a ``NATIVE_CHUNK_BYTES`` buffer; the same bytes."""
        rows = inp.view(self.world, -1)
        n = rows.shape[1]
        step = max(1, NATIVE_CHUNK_BYTES // (self.world * torch.empty((), dtype=wire_dtype).element_size()))
        send_buf = temporary(self.world * min(step, n), wire_dtype, inp.device)
        recv_buf = temporary(min(step, n), wire_dtype, inp.device)
        for a in range(0, n, step):
            part = rows[:, a:a + step]
            send = send_buf[:part.numel()].view(part.shape).copy_(part)  # rank r's columns in row r
            recv = recv_buf[:part.shape[1]]
            self._call(_reduce_scatter, recv, send.view(-1), group=group)
            out[a:a + recv.numel()].copy_(recv)

    def _reduce_scatter_by_chunks(self, out: torch.Tensor, inp: torch.Tensor,
                                  wire_dtype: torch.dtype, group) -> None:
        """One all-to-all per chunk of the shard: transients of ``CHUNK_BYTES`` instead of a converted
        copy of ``inp``, its exchanged copy and a shard-sized sum; the same bytes."""
        rows = inp.view(self.world, -1)
        step = max(1, memory.CHUNK_BYTES // (self.world * torch.empty((), dtype=wire_dtype).element_size()))
        send_buf = temporary(self.world * min(step, rows.shape[1]), wire_dtype, inp.device)
        recv_buf = temporary(send_buf.numel(), wire_dtype, inp.device)
        for a in range(0, rows.shape[1], step):
            part = rows[:, a:a + step]
            send = send_buf[:part.numel()].view(part.shape).copy_(part)
            recv = recv_buf[:part.numel()].view(part.shape)
            dist.all_to_all_single(recv, send, group=group)
            _sum_rows(recv, out[a:a + recv.shape[1]])

    def reduce_scatter_range(self, out: torch.Tensor, inp: torch.Tensor, start: int, end: int,
                             wire_dtype: Optional[torch.dtype] = None) -> None:
        """:meth:`reduce_scatter` of the elements ``[start, end)`` of ``inp`` alone: each rank
        receives the sums of the part of the range that lies in its own shard, into the same
        place of ``out`` (this rank's shard), untouched elsewhere. Over ranges that tile ``inp``
        it is :meth:`reduce_scatter`, with the same bytes in all ((W-1)/W · inp's bytes sent and
        received per rank; counted per range as an all-to-all moves them: each rank sends the
        part of it other ranks own and receives W-1 copies of its own part).

        On gloo one all-to-all with uneven splits, and the same fp32 sums as
        :meth:`reduce_scatter` bit for bit. On the native branch one reduce per shard the range
        touches, to that shard's owner, in the wire dtype, in rank order (the same calls on every
        rank). Not NCCL's all-to-all: its send/recv pairs open point-to-point connections (and
        buffers) to every peer at the first bucket, and a bucket inside one shard would land as
        W-1 copies on its owner's link, where a ring reduce delivers one. Not a reduce-scatter of
        a (W, n) layout either: a bucket lies mostly in one shard, so its rows would be padded
        to the largest part, up to W times the bytes.
        """
        wire_dtype = wire_dtype or inp.dtype
        size, w, me = inp.numel() // self.world, self.world, self.rank
        splits = [max(0, min(end, (r + 1) * size) - max(start, r * size)) for r in range(w)]
        mine = splits[me]
        elem = torch.empty((), dtype=wire_dtype).element_size()
        counted = ((end - start - mine) * elem, (w - 1) * mine * elem)
        self._run("reduce_scatter", (end - start) * elem, self._reduce_scatter_range, out, inp, start, end,
                  splits, wire_dtype, counted=counted)

    def _reduce_scatter_range(self, out: torch.Tensor, inp: torch.Tensor, start: int, end: int,
                              splits, wire_dtype: torch.dtype, group) -> None:
        size, w, me = inp.numel() // self.world, self.world, self.rank
        mine = splits[me]
        lo = max(start, me * size) - me * size  # where this rank's part of the range is in out
        send = temporary(end - start, wire_dtype, inp.device).copy_(inp[start:end])
        if not self.native:
            recv = temporary(w * mine, wire_dtype, inp.device)
            dist.all_to_all_single(recv, send, [mine] * w, splits, group=group)
            if mine:
                _sum_rows(recv.view(w, mine), out[lo:lo + mine])
            return
        at = 0
        for r, n in enumerate(splits):
            if n:
                part = send[at:at + n]  # the range's part in shard r, summed onto rank r in place
                self._call(dist.reduce, part, group_dst=r, group=group)
                if r == me:
                    out[lo:lo + n].copy_(part)
                at += n

    def all_gather_range(self, out: torch.Tensor, inp: torch.Tensor, start: int, end: int) -> None:
        """:meth:`all_gather` of the elements ``[start, end)`` of ``out`` alone: each rank
        contributes the part of the range that lies in its own shard, from the same place of
        ``inp`` (this rank's shard). Over ranges that tile ``out`` it is :meth:`all_gather`, with
        the same bytes in all ((W-1)/W · out's bytes sent and received per rank; counted per
        range as an all-to-all moves them: each rank sends W-1 copies of its own part and
        receives the rest). ``inp`` may be of another dtype than ``out`` (its part is converted:
        a range's worth, never the shard).

        On gloo one all-to-all with uneven splits, received in place. On the native branch one
        broadcast per shard the range touches, from that shard's owner, in place in ``out`` (no
        temporary; NCCL's ring broadcast, no point-to-point connections: see
        :meth:`reduce_scatter_range`).
        """
        size, w, me = out.numel() // self.world, self.world, self.rank
        splits = [max(0, min(end, (r + 1) * size) - max(start, r * size)) for r in range(w)]
        mine = splits[me]
        elem = out.element_size()
        counted = ((w - 1) * mine * elem, (end - start - mine) * elem)
        self._run("all_gather", (end - start) * elem, self._all_gather_range, out, inp, start, end, splits,
                  counted=counted)

    def _all_gather_range(self, out: torch.Tensor, inp: torch.Tensor, start: int, end: int, splits,
                          group) -> None:
        size, w, me = out.numel() // self.world, self.world, self.rank
        mine = splits[me]
        lo = max(start, me * size) - me * size
        if not self.native:
            send = inp[lo:lo + mine].to(out.dtype).repeat(w)
            dist.all_to_all_single(out[start:end], send, splits, [mine] * w, group=group)
            return
        at = start
        for r, n in enumerate(splits):
            if n:
                part = out[at:at + n]
                if r == me:
                    part.copy_(inp[lo:lo + n])
                self._call(dist.broadcast, part, group_src=r, group=group)
                at += n

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Concatenate every rank's ``inp``, in ``out``'s dtype, into ``out`` (W × inp). Cost:
        (W-1)/W · out bytes."""
        nbytes = out.numel() * out.element_size()
        if not self.native:
            self._run("all_gather", nbytes, self._all_gather_by_chunks, out, inp, memory.CHUNK_BYTES)
        elif inp.dtype == out.dtype:
            self._run("all_gather", nbytes, self._call, _all_gather, out, inp)
        else:  # no converted copy of the shard (2/W bytes per parameter for an fp32 master)
            self._run("all_gather", nbytes, self._all_gather_by_chunks, out, inp, NATIVE_CHUNK_BYTES)

    def _all_gather_by_chunks(self, out: torch.Tensor, inp: torch.Tensor, chunk_bytes: int, group) -> None:
        """Gather chunk by chunk, ``chunk_bytes`` at a time, converting ``inp`` to ``out``'s dtype
        chunk by chunk (gloo stages a whole all-gather's output in a temporary: 4 bytes per
        parameter in fp32); the same bytes."""
        rows = out.view(self.world, -1)
        step = max(1, chunk_bytes // (self.world * out.element_size()))
        stage_buf = temporary(self.world * min(step, inp.numel()), out.dtype, out.device)
        part_buf = temporary(min(step, inp.numel()), out.dtype, out.device) if inp.dtype != out.dtype else None
        for a in range(0, inp.numel(), step):
            part = inp[a:a + step]
            if part_buf is not None:
                part = part_buf[:part.numel()].copy_(part)
            stage = stage_buf[:self.world * part.numel()]
            self._call(_all_gather, stage, part, group=group)
            rows[:, a:a + part.numel()].copy_(stage.view(self.world, -1))

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` in place over the group. Cost: 2(W-1)/W · t bytes."""
        self._run("all_reduce", t.numel() * t.element_size(), self._call, dist.all_reduce, t)

    def asynchronous(self) -> "AsyncCollectives":
        """This group's all-reduce and all-gather issued without waiting, on the calling thread
        (Megatron's ``start_*``), waited for at once later (``finish_*``): :class:`AsyncCollectives`."""
        return AsyncCollectives(self)

    def counted_in(self, stats: CommStats) -> "Collectives":
        """The same group, counting into ``stats`` (e.g. checkpoint traffic kept out of training)."""
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__, stats=stats)
        return other


class AsyncCollectives:
    """Collectives on a :class:`Collectives`' group issued with ``async_op`` from the calling
    thread, so that one thread can keep two groups' work in flight in an order it fixes (desloc's
    streamed sync beside its shard group's step): :meth:`all_reduce` and :meth:`all_gather`
    return at once, counted in the group's stats as :class:`Collectives` counts them (the same
    bytes); :meth:`wait` waits for all of them, the time the host blocks there (gloo; on CUDA the
    current stream waits instead, the host does not) counted as waited for. A failure, at the
    issue or the wait, is raised as :class:`CollectiveError`. Whole tensors, no chunking: for the
    small and replica-sized buffers a sync sends."""

    def __init__(self, comm: Collectives) -> None:
        if comm.group is None:
            raise ValueError("a group of one rank has no collectives to issue asynchronously")
        self.comm, self.world = comm, comm.world
        self.works: list = []  # (op, bytes, work)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` in place over the group (complete after :meth:`wait`). Cost: 2(W−1)/W · t bytes."""
        self._issue("all_reduce", t.numel() * t.element_size(), dist.all_reduce, t)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Every rank's ``inp`` (the same dtype) into ``out``, in rank order (complete after
        :meth:`wait`). Cost: (W−1)/W · out bytes."""
        self._issue("all_gather", out.numel() * out.element_size(), _all_gather, out, inp)

    def _issue(self, op: str, nbytes: int, fn, *args) -> None:
        comm, t0 = self.comm, time.perf_counter()
        try:
            work = fn(*args, group=comm.group, async_op=True)
        except Exception as err:  # gloo raises RuntimeError, NCCL DistBackendError
            raise comm._failed(op, nbytes, t0, err) from err
        comm.stats.record(f"{comm.name}.{op}", *wire_bytes(op, nbytes, comm.world), time.perf_counter() - t0)
        self.works.append((op, nbytes, work))

    def wait(self) -> None:
        """Wait for every collective issued, in order."""
        t0 = time.perf_counter()
        works, self.works = self.works, []
        for op, nbytes, work in works:
            try:
                if work is not None:
                    work.wait()
            except Exception as err:
                raise self.comm._failed(op, nbytes, t0, err) from err
        self.comm.stats.host_wait_seconds += time.perf_counter() - t0


class GroupOfOne(Collectives):
    """:class:`Collectives` over this rank alone (``shard_group_size: 1``), with no process group.

    Each private group on a GPU is an NCCL communicator, and DeepSpeed 0.19.8 initialises the
    process group with ``device_id``, which makes torch create every ``new_group`` eagerly: a
    group of one would cost a communicator (its init and buffers) for collectives that move
    nothing. Every collective here is a local copy with the group's semantics (a sum of one
    rank's values, converted to the wire dtype and back as the wire would), counted with zero
    bytes; conversions go chunk by chunk (transients of ``CHUNK_BYTES``). Cost: none on any link.
    """

    def __init__(self, stats: CommStats, timeout_s: float, name: str) -> None:
        self.group = None
        self.stats = stats
        self.timeout_s = timeout_s
        self.name = name
        self.world, self.rank = 1, 0
        self.ranks = [dist.get_rank()]
        self.native = True

    def _copy(self, op: str, out: torch.Tensor, inp: torch.Tensor, via: torch.dtype) -> None:
        t0 = time.perf_counter()
        if inp.dtype == via or out.dtype == via:  # one conversion at most: no rounding is lost
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
        else:
            step = max(1, memory.CHUNK_BYTES // torch.empty((), dtype=via).element_size())
            buf = temporary(min(step, inp.numel()), via, inp.device)
            for a in range(0, inp.numel(), step):
                part = inp[a:a + step]
                out[a:a + part.numel()].copy_(buf[:part.numel()].copy_(part))
        self.stats.record(f"{self.name}.{op}", 0.0, 0.0, time.perf_counter() - t0)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       wire_dtype: Optional[torch.dtype] = None) -> None:
        """``out`` = ``inp`` through the wire dtype (the sum over one rank)."""
        self._copy("reduce_scatter", out, inp, wire_dtype or inp.dtype)

    def reduce_scatter_range(self, out: torch.Tensor, inp: torch.Tensor, start: int, end: int,
                             wire_dtype: Optional[torch.dtype] = None) -> None:
        """``out[start:end]`` = ``inp[start:end]`` through the wire dtype."""
        self._copy("reduce_scatter", out[start:end], inp[start:end], wire_dtype or inp.dtype)

    def all_gather_range(self, out: torch.Tensor, inp: torch.Tensor, start: int, end: int) -> None:
        """``out[start:end]`` = ``inp[start:end]``, in ``out``'s dtype."""
        self._copy("all_gather", out[start:end], inp[start:end], out.dtype)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` = ``inp``, in ``out``'s dtype."""
        self._copy("all_gather", out, inp, out.dtype)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Nothing to add: ``t`` is already the sum."""
        self.stats.record(f"{self.name}.all_reduce", 0.0, 0.0, 0.0)


def _sum_rows(rows: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst`` = the sum of ``rows`` (one per rank) in rank order, in fp32 for low-precision
    inputs: deterministic, the same on every rank, and the same however the shard is chunked."""
    if dst.dtype == torch.float32:
        torch.sum(rows, 0, dtype=torch.float32, out=dst)
    else:
        total = temporary(rows.shape[1], torch.float32, rows.device)
        torch.sum(rows, 0, dtype=torch.float32, out=total)
        dst.copy_(total)


def deepspeed_logged_bytes(comms_dict: dict, world: int) -> Tuple[float, float]:
    """(sent, received) bytes per rank from DeepSpeed's comms logger, by the table above.

    ``comms_dict`` is ``deepspeed.comm.comm.comms_logger.comms_dict``
    (``{op name: {message bytes: [count, ...]}}``). DeepSpeed 0.19.8 logs the argument named
    ``tensor``: the full tensor for all-reduce and reduce-scatter, but the per-rank *input* for
    ``all_gather_into_tensor``, whose output is W times larger. Collectives that are not part of
    training steps (broadcast, barrier) are left out.
    """
    sent = received = 0.0
    for name, sizes in comms_dict.items():
        op = next((o for o in ("all_reduce", "all_gather", "reduce_scatter") if o in name), None)
        if op is None:
            continue
        for nbytes, record in sizes.items():
            s, r = wire_bytes(op, nbytes * world if op == "all_gather" else nbytes, world)
            sent += record[0] * s
            received += record[0] * r
    return sent, received
