"""desloc: DES-LOC — Desynced Low-Communication Adam (Iacob et al., arXiv 2505.22549).

Each replica (a shard group: ZeRO-1 inside it as usual) runs AdamW on its own data; across replica
groups, each rank averages its own shard with the ranks of the same index in the other replicas:
the fp32 master every ``param_sync_every`` (Kx) steps, the first moment every
``momentum_sync_every`` (Ku, default 3·Kx), the second moment every ``variance_sync_every`` (Kv,
default 6·Kx). v is averaged (not √v) and the step count never is. Optionally the parameter
average feeds an outer Nesterov optimizer (DiLoCo-style: pseudo-gradient = parameters at the last
sync − average; ``outer_lr``, ``outer_momentum``). The averages due in the same
step travel one all-reduce per state, in place, after the local update and before the all-gather
inside the shard group. Local Adam is the special case Kx = Ku = Kv; Kx = Ku = Kv = 1 is *not* DDP (averaging Adam
updates is not Adam on the averaged gradient).

Bytes per rank per step across replica groups, R replicas, N shard elements in fp32:
2(R−1)/R · 4·N · (1/Kx + 1/Ku + 1/Kv) — with R = 2, one shard per period. (Memory costs below are
per parameter, S the shard group size: a buffer of the shard's size is 4/S bytes per parameter.)

``sync_topk`` > 0 compresses the parameter syncs (SparseLoCo-style, :mod:`ds_lowcomm.modes.sparse`):
each replica sends the ``sync_topk`` largest entries of each ``sync_chunk``-element chunk of its
pseudo-gradient (anchor − master, plus what earlier syncs did not send: error feedback), in bf16,
int8 or int2, in one all-gather; every replica applies the same mean and keeps the rest in its error
buffer. The parameter term above becomes (R−1) · P / Kx, P the payload (``ChunkTopK``), about
N·k/C·3 bytes in bf16 with C ≤ 256. It costs two more fp32 buffers per shard element (the anchor
and the error buffer: 8/S bytes per parameter).
``moment_sync_topk`` > 0 compresses the moment syncs (:class:`MomentSync`), each moment s on its
own period: replica r sends the top-k of each chunk of its change since the last sync,
d_r = s_r − a (a, the anchor: what the replicas agreed on then), rounded to
``moment_sync_values`` (d̂_r); then
s_r ← s_r + mean(d̂) − d̂_r and a ← a + mean(d̂). Sent whole, that is the dense average; what a
replica did not send stays in its own moment, and its next sync carries it (no error buffer; a
moment is never reset to a value it did not reach). v keeps s_r ≥ s_r,old / R, the least a dense
average leaves: a rounded mean could cross 0, and a v far below m² makes Adam's step explode.
With Muon the second moment's sync packs the AdamW ranges only. Its term above becomes
(R−1) · P_s / K_s; 4/S bytes per parameter per moment (the anchor). Synchronous only: refused
with ``param_sync_delay``, whose flight carries the moments dense.
``param_sync_delay`` D > 0 streams the parameter syncs (Streaming DiLoCo's overlap, arXiv
2501.18512): at a sync the master is copied and its all-reduce (and the outer step) runs while
the next D local steps compute; after step t + D's update the result x̄ replaces
the master with the local progress since kept, θ ← x̄ + (θ_{t+D} − θ_t). Nothing computed is
discarded (Streaming DiLoCo instead mixes θ ← α·θ_{t+D} + (1 − α)·x̄). D = 0 is the synchronous
sync above; compressed syncs stream too (encoded at the launch, all-gathered in the flight). A
moment due at the launch goes in the same flight and is applied with it as
m ← m_{t+D} + β^n·(m̄_t − m_t), n the replica's Adam steps since the launch, β the moment's decay
(``ShardAdamW.decay``): an EMA's m_{t+D} = β^n·m_t + the new gradients' terms, so this is the
moment it would hold had it restarted from the mean at t (the parameters' additive correction
would keep (1 − β^n)·m_t of its own and could make v negative). The local steps stay on the
training thread and never wait for a sync in flight, so D steps of compute can hide one. Every
rank issues all of its collectives in an order the steps fix, never two communicators from two
host threads at once (NCCL can deadlock then, "Using multiple NCCL communicators concurrently";
tests/test_collective_order.py records it): with one rank per replica (``shard_group_size`` 1) the
local step has no collective and the comm worker runs the sync's, blocking there; with shard
groups of more than one rank the training thread issues the sync's collectives itself, as
asynchronous work (``async_op``) inside the launching step, between its update and its
all-gather, and waits for them inside step t + D at the same point, before applying the result
(the shard group's collectives of the D steps between run beside them, issued from the same
thread). It costs
the master at the launch (4/S bytes per parameter), for dense syncs the buffer sent (4/S more),
and 8/S per moment ever averaged (at the launch, and its wire); a save with a sync in flight waits
for it and keeps its results and what was launched, so a resume applies it at the same step.
``inner_optimizer`` "muon" makes the local step Muon (:mod:`ds_lowcomm.shard.muon`) on the hidden
matrices, AdamW on the rest; its momentum is ``exp_avg`` and is averaged on Ku like Adam's (the
matrices' ``exp_avg_sq`` stays zero and is not sent: a second-moment sync carries the AdamW part
of the shard only, 2(R−1)/R · 4 bytes per element of it). A matrix cut by a shard boundary costs
one all-reduce of it per step inside the shard group.
Replicas differ between syncs: each rank saves its replica's shards of θ, m and v, and a resume
with the same layout gives every replica its own; at another world size or ``shard_group_size``
every replica starts from the average of the saved replicas (a sync of all three).

Non-finite gradients are judged per replica (the norm all-reduce inside the shard group): a
replica whose gradient is non-finite skips its local update and keeps its state from before the
step, so what it brings to an average is always finite. The periods count rounds, which every
replica runs whatever its verdicts, so replicas always meet at the same steps; a replica that
skipped has made one Adam step fewer (its own bias correction and, as in stock DeepSpeed, its
learning-rate schedule wait one step).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch

from ds_lowcomm.checkpoint import CheckpointError, ShardReader
from ds_lowcomm.comm.collectives import AsyncCollectives
from ds_lowcomm.comm.round import Round
from ds_lowcomm.comm.worker import CommWorker, Ticket
from ds_lowcomm.config import LowCommConfigError, option
from ds_lowcomm.shard.flat import gather_full
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.modes.base import Mode, ModeState, require_shard_group_size
from ds_lowcomm.shard.adamw import ShardAdamW
from ds_lowcomm.shard.muon import ShardMuon, muon_matrices
from ds_lowcomm.memory import CHUNK_BYTES, temporary
from ds_lowcomm.modes.sparse import INT2_MAX_CHUNK, MAX_CHUNK, VALUES, ChunkTopK
from ds_lowcomm.shard.step import ShardedStepRound, step_now

NEVER = 0  # the internal value of "never"
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class DeslocOptions:
    """``lowcomm.desloc``: DES-LOC's options (docs/configuration.md lists them)."""

    param_sync_every: int = option(16, "Kx: steps between averages of the fp32 master", minimum=1)
    momentum_sync_every: Optional[int] = option(None, "Ku: steps between averages of the first moment; "
                                                "null = 3·Kx, 0 = never (explicit opt-in)", minimum=0)
    variance_sync_every: Optional[int] = option(None, "Kv: steps between averages of the second moment; "
                                                "null = 6·Kx, 0 = never (explicit opt-in)", minimum=0)
    outer_lr: float = option(1.0, "outer optimizer learning rate on the parameter average "
                             "(DiLoCo-style; 1 with outer_momentum 0 = plain averaging)", minimum=0,
                             exclusive_minimum=True)
    outer_momentum: float = option(0.0, "outer Nesterov momentum; 0 = off (plain averaging)", minimum=0,
                                   below=1)
    sync_topk: int = option(0, "compressed parameter syncs: entries of each sync_chunk sent per replica "
                            "(the largest of the pseudo-gradient plus the error feedback; the rest "
                            "stays in a per-rank error buffer); 0 = dense average", minimum=0)
    moment_sync_topk: int = option(0, "compressed moment syncs: entries of each sync_chunk of a moment's change "
                                   "since its last sync sent per replica (what is not sent stays in the "
                                   "replica's moment for the next sync); 0 = dense averages", minimum=0)
    sync_chunk: int = option(64, "elements per chunk of a compressed sync (indices travel in "
                             "1 byte up to 256, else 2)", minimum=1)
    sync_values: str = option("bf16", "values of a compressed parameter sync: 'bf16' (2 bytes), 'int8' "
                              "(1 byte, one fp32 scale per chunk) or 'int2' (sign and one of two "
                              "magnitudes, in the index's byte; sync_chunk <= 64)", choices=VALUES)
    moment_sync_values: str = option("bf16", "values of a compressed moment sync, as sync_values", choices=VALUES)
    param_sync_delay: int = option(0, "streamed parameter syncs: local steps a sync's all-reduce runs behind "
                                   "(on the comm worker) before its average replaces the master, the local "
                                   "progress since kept; 0 = synchronous, at most param_sync_every - 1",
                                   minimum=0)
    inner_optimizer: str = option("adamw", "the local step: 'adamw', or 'muon' (hidden matrices orthogonalised, "
                                  "the rest AdamW)", choices=("adamw", "muon"))


class ParamAverage(Round):
    """A streamed parameter sync, launched by :meth:`ReplicaSyncs.start_param_sync`: dense,
    ``wire`` (this replica's master, or with the outer optimizer its pseudo-gradient anchor −
    master) all-reduced over the replica group, 4·N bytes (N the shard's elements) of which
    2(R−1)/R sent; compressed, the payload encoded at the launch all-gathered, (R−1) payloads
    sent. Then each moment launched with it (:attr:`ReplicaSyncs.in_flight`): its wire averaged
    in place, one all-reduce of its informative ranges (2(R−1)/R · 4 bytes per element), as a
    synchronous sync would. It leaves the sync's result, the parameters every replica agrees on,
    in :attr:`ReplicaSyncs.result` (the mean, or the anchor moved by the mean or the outer step).

    Its collectives (:meth:`issue`) and the arithmetic on what they return (:meth:`complete`) run
    on one of two threads (module doc): :meth:`run` both, on the comm worker, where the local step
    issues no collective (one rank per replica); or :meth:`start` issues them on the training
    thread as asynchronous work when it is launched, and :meth:`wait` waits for them and completes
    the sync there when it is applied (or settled)."""

    def __init__(self, syncs: "ReplicaSyncs", replica) -> None:
        self.syncs, self.replica = syncs, replica
        self.moments = list(syncs.in_flight)  # (fixed at the launch: the collectives it issues)
        self.gathered: Optional[torch.Tensor] = None  # compressed: every replica's payload
        self.summed: Dict[str, Optional[torch.Tensor]] = {}  # by moment: what its all-reduce sums
        self.pending: Optional[AsyncCollectives] = None  # started: the work not waited for yet

    def pack(self) -> None:
        """Nothing: :meth:`ReplicaSyncs.start_param_sync` fills the wire before submitting."""

    def run(self) -> None:
        """On the comm worker: the sync's collectives (the class docstring's bytes), blocking,
        then their results applied."""
        self.issue(self.replica)
        self.complete()

    def start(self) -> None:
        """On the training thread: issue the sync's collectives as asynchronous work (the same
        calls and bytes as :meth:`run`); never waits for them."""
        self.pending = self.replica.asynchronous()
        self.issue(self.pending)

    def wait(self) -> None:
        """After :meth:`start`, on the training thread: wait for its collectives and complete the
        sync (its result in :attr:`ReplicaSyncs.result`). Nothing once done, or never started
        (a sync restored from a checkpoint has its result already)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()
            self.complete()

    def issue(self, comm) -> None:
        """The collectives over ``comm`` (the replica group's :class:`Collectives`, blocking, or
        an :class:`AsyncCollectives` on it): the payloads' all-gather or the wire's all-reduce,
        then each moment's all-reduce."""
        syncs = self.syncs
        if syncs.codec is not None:
            self.gathered = syncs.payload.new_empty(comm.world * syncs.codec.payload_bytes)
            comm.all_gather(self.gathered, syncs.payload)
        else:
            comm.all_reduce(syncs.wire)
        for key in self.moments:
            self.summed[key] = sum_ranges(comm, syncs.moment_wire[key], syncs.moment_ranges[key])

    def complete(self) -> None:
        """What :meth:`issue`'s collectives returned, applied (no communication): the mean (or
        the outer step, or the compressed payloads' means moving the anchor) and each moment's
        mean in its wire. The anchor and outer momentum are the sync's until it is applied."""
        syncs, world = self.syncs, self.replica.world
        if syncs.codec is not None:
            for mean, a, b in payload_means(syncs.codec, self.gathered, world):
                syncs.outer_step(mean, slice(a, b))
            self.gathered = None
        else:
            syncs.wire.mul_(1.0 / world)
            if syncs.outer:
                syncs.outer_step(syncs.wire, slice(None))
        for key in self.moments:
            mean_ranges(world, syncs.moment_wire[key], syncs.moment_ranges[key], self.summed.pop(key))

    def install(self) -> None:
        """Nothing: :meth:`ReplicaSyncs.finish_param_sync` applies the result."""


def sync_periods(options: DeslocOptions) -> Dict[str, int]:
    """Steps between averages of the master (Kx) and of each moment (Ku, Kv; NEVER: never), the
    moments' defaults 3·Kx and 6·Kx."""
    kx = options.param_sync_every
    return {"master": kx,
            "exp_avg": 3 * kx if options.momentum_sync_every is None else options.momentum_sync_every,
            "exp_avg_sq": 6 * kx if options.variance_sync_every is None else options.variance_sync_every}


def takes_outer_step(options: DeslocOptions) -> bool:
    """Whether a parameter sync takes DiLoCo's outer Nesterov step (else it plainly averages)."""
    return options.outer_lr != 1.0 or options.outer_momentum != 0.0


class ReplicaSyncs:
    """DES-LOC's averages across replica groups: the periods, the rounds run (equal on every
    replica, whatever their verdicts: it paces the syncs), with the outer Nesterov optimizer or
    compressed parameter syncs the anchor (the parameters at the last sync; the outer momentum,
    the error buffer), shards like the master's, and the compressed moment syncs
    (:class:`MomentSync`, one per moment)."""

    def __init__(self, options: DeslocOptions, adamw: ShardAdamW, worker: Optional[CommWorker] = None) -> None:
        """The anchor (the parameters at the last sync) exists with the outer optimizer or
        compressed syncs; the error buffer with compressed syncs; with ``moment_sync_topk`` a
        :class:`MomentSync` per moment ever averaged; with ``param_sync_delay`` the streamed sync's
        two buffers (and two per moment ever averaged) and ``worker``: the comm worker its
        collectives run on, or None to issue them on the training thread as asynchronous work
        (where the local step has collectives of its own: module doc)."""
        master = adamw.master
        self.periods = sync_periods(options)
        self.rounds = 0
        self.outer_lr, self.outer_momentum = options.outer_lr, options.outer_momentum
        # DiLoCo-style outer Nesterov: the pseudo-gradient is anchor − average. Off (plain
        # averaging) unless configured.
        self.outer = takes_outer_step(options)
        self.codec = (ChunkTopK(master.numel(), options.sync_chunk, options.sync_topk, options.sync_values)
                      if options.sync_topk else None)
        self.anchored = self.outer or self.codec is not None
        if self.anchored:
            self.restart(master)
        #: compressed moment syncs, by moment (each over the ranges the inner optimizer fills)
        self.moment_syncs: Dict[str, MomentSync] = {}
        if options.moment_sync_topk:
            for key in MOMENTS:
                if self.periods[key] != NEVER:
                    ranges = adamw.informative_ranges(key)
                    if ranges is None:  # the shard's parameters: its padding is never picked or sent
                        ranges = [(seg.start, seg.end) for seg in adamw.segments]
                    self.moment_syncs[key] = MomentSync(options, getattr(adamw, key), ranges,
                                                        nonnegative=key == "exp_avg_sq")
        self.delay, self.worker = options.param_sync_delay, worker
        #: the streamed sync in flight (or run and not yet applied): the worker's ticket for it, or
        #: the sync itself where the training thread issued it; and the round it is applied at
        self.ticket: Optional[Union[Ticket, ParamAverage]] = None
        self.finish_at: Optional[int] = None
        #: the moments launched with it, and the inner optimizer's step count at the launch
        self.in_flight: List[str] = []
        self.launch_step = 0
        self.moment_launched: Dict[str, torch.Tensor] = {}
        self.moment_wire: Dict[str, torch.Tensor] = {}
        self.moment_ranges: Dict[str, Optional[list]] = {}
        if self.delay:
            self.launched = torch.zeros_like(master)  # this replica's master at the launch
            if self.codec is None:  # what the all-reduce sends (compressed syncs send the payload)
                self.wire = torch.zeros_like(master)
            for key in MOMENTS:  # a moment at its launch, and its wire (then its mean)
                if self.periods[key] != NEVER:
                    self.moment_launched[key] = torch.zeros_like(master)
                    self.moment_wire[key] = torch.zeros_like(master)

    @property
    def result(self) -> torch.Tensor:
        """Where a streamed sync leaves its result: the anchor where there is one, else the wire."""
        return self.anchor if self.anchored else self.wire

    def restart(self, master: torch.Tensor) -> None:
        """The anchor at ``master``; no outer momentum, an empty error buffer."""
        self.anchor = master.clone()
        if self.outer:
            self.outer_buf = torch.zeros_like(master)
        if self.codec is not None:
            self.error = torch.zeros(self.codec.padded, dtype=master.dtype, device=master.device)
            self.payload = torch.zeros(self.codec.payload_bytes, dtype=torch.uint8, device=master.device)

    def average_due(self, adamw: ShardAdamW, replica, param_groups) -> None:
        """After the local update (or its skip), before the all-gather: average over ``replica``
        (the replica group, None with one replica) the states due this round, each in place in
        one all-reduce of 4 bytes per element it carries (the shard's N, or Muon's second moment's
        AdamW ranges; one concatenated call would hold a copy of them all), a compressed sync in
        one all-gather of its payload. With ``param_sync_delay``, first apply the streamed sync due this round (``param_groups``: the
        betas its moments decay by), then launch the parameter sync, and the moments due with it,
        instead of running them (their bytes the same, sent in the flight: :meth:`start_param_sync`)."""
        self.rounds += 1
        if self.finish_at == self.rounds:
            self.finish_param_sync(adamw, param_groups)
        due = [k for k, every in self.periods.items() if every != NEVER and self.rounds % every == 0]
        if replica is None or not due:
            return
        launch = self.delay and "master" in due
        if launch:
            self.start_param_sync(adamw, replica, [k for k in due if k != "master"], param_groups)
            return
        if self.ticket is not None:
            # One collective at a time on the replica group, in the same order on every rank: a
            # sync still in flight completes first (with periods that are multiples of Kx, none is).
            # A moment averaged now needs no correction from it any more: the replicas' mean of
            # the corrected moments is the mean of the uncorrected ones.
            self.settle()
            self.in_flight = [k for k in self.in_flight if k not in due]
        if self.codec is not None and "master" in due:
            due.remove("master")
            self.sync_compressed(adamw.master, replica)
        for k in due:  # (Muon's second moment: zero on its matrices, not sent)
            if k in self.moment_syncs:
                self.moment_syncs[k].sync(getattr(adamw, k), replica)
            else:
                average_ranges(replica, getattr(adamw, k), adamw.informative_ranges(k))
        if self.outer and "master" in due:
            delta = self.anchor - adamw.master  # identical on every replica: from averages
            self.outer_step(delta, slice(None))
            adamw.master.copy_(self.anchor)

    def start_param_sync(self, adamw: ShardAdamW, replica, moments: List[str], param_groups) -> None:
        """Launch a streamed parameter sync (module doc) with the ``moments`` due in the same
        round, to be applied after the update of round ``rounds + delay``: dense, the wire filled
        here; compressed, the payload encoded here (on the training thread/stream, from the
        master now); each moment copied to its wire. Then its collectives: submitted to the comm
        worker, or, without one, issued here as asynchronous work (:meth:`ParamAverage.start`).
        Never blocks (a sync still pending is applied first: only after a change of periods)."""
        if self.ticket is not None:
            self.finish_param_sync(adamw, param_groups)
        master = adamw.master
        self.launched.copy_(master)
        if self.codec is not None:
            self.encode_compressed(master)
        elif self.outer:
            torch.sub(self.anchor, master, out=self.wire)
        else:
            self.wire.copy_(master)
        for key in moments:
            state = getattr(adamw, key)
            self.moment_launched[key].copy_(state)
            self.moment_wire[key].copy_(state)
            self.moment_ranges[key] = adamw.informative_ranges(key)
        self.in_flight, self.launch_step = moments, adamw.step_count
        sync = ParamAverage(self, replica)
        if self.worker is not None:
            self.ticket = self.worker.submit(sync)
        else:
            sync.start()
            self.ticket = sync
        self.finish_at = self.rounds + self.delay

    def finish_param_sync(self, adamw: ShardAdamW, param_groups) -> None:
        """Wait for the streamed sync and apply it: master ← result + (master − launched); each
        moment launched with it s ← s + β^n·(s̄ − s_launched), n the updates since the launch and
        β its decay (``adamw.decay``, from ``param_groups``' betas): exactly the moment an EMA
        would hold had it started from the mean at the launch (module doc)."""
        self.settle()
        # (master − launched) + result, in this order: exactly the result where nothing moved
        # since the launch (a flush right after it), so the replicas then agree bit for bit
        adamw.master.sub_(self.launched).add_(self.result)
        for key in self.in_flight:
            apply_moment(adamw, key, self.moment_wire[key], self.moment_launched[key],
                         adamw.step_count - self.launch_step, param_groups)
        self.in_flight = []
        self.ticket = self.finish_at = None

    def settle(self) -> None:
        """Wait until the streamed sync in flight, if any, has run (its result in :attr:`result`):
        for the comm worker's ticket, or for the training thread's asynchronous work (then
        completing the sync here)."""
        if isinstance(self.ticket, ParamAverage):
            self.ticket.wait()
        elif self.ticket is not None:
            self.worker.wait(self.ticket)

    def restored(self, replica) -> Union[Ticket, ParamAverage]:
        """A streamed sync restored from a checkpoint, its result already in :attr:`result`: as
        :attr:`ticket` holds one that has run."""
        sync = ParamAverage(self, replica)
        return sync if self.worker is None else Ticket.completed(sync)

    def outer_step(self, delta: torch.Tensor, sl: slice) -> None:
        """The anchor's elements ``sl`` moved by the pseudo-gradient ``delta`` (consumed): plain
        (anchor − delta) or outer Nesterov."""
        if not self.outer:
            self.anchor[sl].sub_(delta)
            return
        self.outer_buf[sl].mul_(self.outer_momentum).add_(delta)
        self.anchor[sl].sub_(delta.add_(self.outer_buf[sl], alpha=self.outer_momentum), alpha=self.outer_lr)

    def sync_compressed(self, master: torch.Tensor, replica) -> None:
        """A compressed parameter sync (module doc): :meth:`encode_compressed`, then
        :meth:`apply_compressed`, and every replica takes the anchor as its master. Cost:
        (R−1)/R · R · payload bytes sent per rank."""
        self.encode_compressed(master)
        self.apply_compressed(replica)
        master.copy_(self.anchor)

    def encode_compressed(self, master: torch.Tensor) -> None:
        """u = e + (anchor − master) in the error buffer; the top-k of each chunk of u into the
        payload, the rest kept in the error buffer. No communication."""
        n = master.numel()
        step = max(1, CHUNK_BYTES // 4)
        for a in range(0, n, step):  # u, in the error buffer (no shard-sized temporary)
            b = min(n, a + step)
            self.error[a:b].add_(self.anchor[a:b] - master[a:b])
        self.codec.encode(self.error, self.payload)
        # The padding of the last chunk is no parameter: what a rounding left there (int2 sends a
        # picked zero as ±lo) would take top-k slots later and is not saved; drop it.
        self.error[n:].zero_()

    def apply_compressed(self, replica) -> None:
        """Every replica's payload in one all-gather of :attr:`ChunkTopK.payload_bytes` each; the
        anchor moved by their mean (or the outer step on it), the same on every replica."""
        for mean, a, b in gathered_means(self.codec, replica, self.payload):
            self.outer_step(mean, slice(a, b))


class MomentSync:
    """A moment's compressed syncs (``moment_sync_topk``; module doc) over ``ranges`` of the shard
    (``(start, end)`` pairs: where the moment can differ from zero, never the padding): the anchor, the moment as every
    replica agreed on it at the last sync plus the means sent since. What a replica has not sent
    stays in its moment (its change from the anchor), so it has no error buffer of its own.
    ``nonnegative`` (the second moment): a sync never takes an element below 1/R of its value."""

    def __init__(self, options: DeslocOptions, state: torch.Tensor, ranges, nonnegative: bool) -> None:
        """Anchored at ``state``: one fp32 buffer of the shard's size (4/S bytes per parameter)
        and the payload."""
        self.ranges, self.nonnegative = ranges, nonnegative
        count = sum(b - a for a, b in ranges)
        # No codec where the shard carries none of this moment (padding, or Muon's matrices alone):
        # the replicas of a shard share its layout, so they agree on skipping the all-gather.
        self.codec = (ChunkTopK(count, options.sync_chunk, options.moment_sync_topk, options.moment_sync_values)
                      if count else None)
        self.payload = torch.zeros(self.codec.payload_bytes if count else 0, dtype=torch.uint8, device=state.device)
        self.anchor = state.clone()

    def sync(self, state: torch.Tensor, replica) -> None:
        """Each replica sends the top-k of each chunk of its change d_r = s_r − anchor, rounded
        (d̂_r); then s_r ← s_r + mean(d̂) − d̂_r and anchor ← anchor + mean(d̂), the same on every
        replica. Sent whole, this is the dense average; what a replica did not send, d_r − d̂_r,
        stays in s_r − anchor, so its next sync carries it (CHOCO-SGD's compressed differences
        to a public copy, arXiv 1902.00340, with one copy the replicas share). The second moment
        keeps s_r ≥ s_r,old / R, the least a dense average can leave (the mean of R values ≥ 0
        is at least each one's R-th part): a rounded mean could cross 0, and a v far below m²
        would make the Adam step m/√v explode. Cost: one all-gather, (R−1)/R · R ·
        :attr:`ChunkTopK.payload_bytes` sent per rank; temporaries of a block of chunks."""
        codec = self.codec
        if codec is None:
            return
        view = codec.views(self.payload)
        for r0, r1 in codec.row_blocks():  # d_r, packed, a block of chunks at a time
            d = temporary((r1 - r0) * codec.chunk, torch.float32, self.anchor.device)
            d.zero_()  # (the padding of the last chunk stays zero: never picked over a real element)
            for at, lo, hi in packed_pieces(self.ranges, r0 * codec.chunk, r1 * codec.chunk):
                torch.sub(state[lo:hi], self.anchor[lo:hi], out=d[at - r0 * codec.chunk:][:hi - lo])
            codec.encode_rows(d.view(r1 - r0, codec.chunk), view, r0, r1)
        for mean, a, b in gathered_means(codec, replica, self.payload):
            r0, r1 = a // codec.chunk, -(-b // codec.chunk)
            own = temporary((r1 - r0) * codec.chunk, torch.float32, mean.device)
            codec.mean_into([self.payload], r0, r1, own.view(r1 - r0, codec.chunk))  # d̂_r
            own = own[: b - a].neg_().add_(mean)  # mean(d̂) − d̂_r
            for at, lo, hi in packed_pieces(self.ranges, a, b):
                i = at - a
                s = state[lo:hi]
                if self.nonnegative:
                    torch.maximum(s + own[i:i + hi - lo], s / replica.world, out=s)
                else:
                    s.add_(own[i:i + hi - lo])
                self.anchor[lo:hi].add_(mean[i:i + hi - lo])


def packed_pieces(ranges, a: int, b: int):
    """The packed elements ``[a, b)`` of ``ranges`` (``(start, end)`` shard pairs, packed in
    order) as ``(packed start, shard start, shard end)`` pieces; ``b`` may run past the packed
    elements (a codec's padding)."""
    at = 0
    for lo, hi in ranges:
        start, end = max(a, at), min(b, at + hi - lo)
        if start < end:
            yield start, lo + start - at, lo + end - at
        at += hi - lo


def gathered_means(codec: ChunkTopK, replica, payload: torch.Tensor):
    """Every replica's ``payload`` in one all-gather (``codec.payload_bytes`` each; (R−1)/R of the
    R payloads sent per rank); returns :func:`payload_means` of them. The same bits on every
    replica."""
    gathered = payload.new_empty(replica.world * codec.payload_bytes)
    replica.all_gather(gathered, payload)
    return payload_means(codec, gathered, replica.world)


def payload_means(codec: ChunkTopK, gathered: torch.Tensor, world: int):
    """The mean of the ``world`` payloads ``gathered`` (concatenated in rank order) a block of
    chunks at a time, as ``(mean, a, b)``: elements ``[a, b)`` of the encoded vector (``mean``,
    b − a of them, is a temporary: use it before taking the next). No communication."""
    payloads = list(gathered.chunk(world))
    for r0, r1 in codec.row_blocks():
        a, b = r0 * codec.chunk, min(codec.numel, r1 * codec.chunk)
        mean = temporary((r1 - r0) * codec.chunk, torch.float32, gathered.device).view(r1 - r0, codec.chunk)
        codec.mean_into(payloads, r0, r1, mean)
        yield mean.view(-1)[: b - a], a, b


def average_ranges(replica, state: torch.Tensor, ranges) -> None:
    """Average the elements ``ranges`` (``(start, end)`` pairs, the same on every rank of
    ``replica``; None: all of ``state``, in place) of ``state`` over the replica group, packed
    into one all-reduce of 4 bytes per element; the rest of ``state`` is left as it is."""
    mean_ranges(replica.world, state, ranges, sum_ranges(replica, state, ranges))


def sum_ranges(comm, state: torch.Tensor, ranges) -> Optional[torch.Tensor]:
    """The first half of :func:`average_ranges`: the sum over ``comm`` of ``state``'s elements
    ``ranges`` (None: ``state`` itself, in place), packed into a buffer of their own; returns
    what the all-reduce sums (``state``, the packed buffer, or None where ``ranges`` are
    empty and nothing is sent). With an :class:`AsyncCollectives`, summed once it is waited for."""
    if ranges is None:
        comm.all_reduce(state)
        return state
    total = sum(b - a for a, b in ranges)
    if total == 0:
        return None
    packed = temporary(total, state.dtype, state.device)
    for at, lo, hi in packed_pieces(ranges, 0, total):
        packed[at:at + hi - lo].copy_(state[lo:hi])
    comm.all_reduce(packed)
    return packed


def mean_ranges(world: int, state: torch.Tensor, ranges, summed: Optional[torch.Tensor]) -> None:
    """The second half of :func:`average_ranges`: ``summed`` (what :func:`sum_ranges` returned,
    summed over ``world`` ranks) divided by them, into ``state``'s elements ``ranges``. No
    communication."""
    if summed is None:
        return
    summed.mul_(1.0 / world)
    if ranges is not None:
        for at, lo, hi in packed_pieces(ranges, 0, summed.numel()):
            state[lo:hi].copy_(summed[at:at + hi - lo])


def saved_sync_result(keys) -> str:
    """The key of a saved streamed sync's result: the anchor where the run had one."""
    return "anchor" if "anchor" in keys else "sync_result"


def apply_moment(adamw: ShardAdamW, key: str, mean: torch.Tensor, launched: torch.Tensor, updates: int,
                 param_groups) -> None:
    """A moment streamed with a parameter sync, applied: s ← s + β^n·(s̄ − s_launched), n =
    ``updates`` since the launch (module doc). ``mean`` (s̄) and ``launched`` are consumed.
    Computed as (s − β^n·s_launched) + β^n·s̄: exactly s̄ where the replica made no update since
    the launch (a flush right after it), so the replicas then agree bit for bit."""
    adamw.decay(key, launched, updates, param_groups)
    adamw.decay(key, mean, updates, param_groups)
    getattr(adamw, key).sub_(launched).add_(mean)


def apply_saved_sync(keys, master: torch.Tensor, params: torch.Tensor, read, full) -> None:
    """Apply a streamed sync saved in flight at a load: ``master`` (this rank's shard) and
    ``params`` (the full parameters) += result − the master at its launch, ``read``/``full``
    reading a key's shard or whole vector."""
    result = saved_sync_result(keys)
    master.sub_(read("sync_launched")).add_(read(result))  # (as finish_param_sync's order)
    params.sub_(full("sync_launched")).add_(full(result))


class DeslocRound(ShardedStepRound):
    """A replica's local AdamW step (ZeRO-1 inside its shard group), with the averages due this
    round between the update and the all-gather, so the all-gather spreads the average."""

    def __init__(self, ctx: ModeContext, adamw: ShardAdamW, syncs: ReplicaSyncs) -> None:
        super().__init__(ctx, adamw, ctx.grads.buffer, ctx.flat.buffer, scale=1.0 / ctx.topology.shard.world)
        self.syncs = syncs

    def update(self, grad: torch.Tensor, factor: float) -> torch.Tensor:
        """The local step, then :meth:`ReplicaSyncs.average_due` (across the replica group: the
        syncs due this round, the module's bytes; nothing on most rounds)."""
        out = super().update(grad, factor)
        self.syncs.average_due(self.adamw, self.ctx.topology.replica, self.hyper)
        return out


class Desloc(Mode):
    """Local AdamW per replica, with independent averaging periods for θ, m and v."""

    name = "desloc"
    Options = DeslocOptions

    @classmethod
    def is_asynchronous(cls, options: DeslocOptions) -> bool:
        return options.param_sync_delay > 0

    @classmethod
    def state_bytes(cls, options: DeslocOptions, shard_group_size: int) -> float:
        """docs/benchmarks.md's "Memory per GPU", per parameter, sharded, fp32: the master, both
        moments and the gradient shard (16 bytes; the last only with fp32 gradient sums, counted
        always); the anchor with the outer step or compressed parameter syncs (4), the outer
        momentum (4), the error buffer (4); a compressed moment sync's anchor per moment averaged
        (4 each); with ``param_sync_delay`` the master at the launch and the wire (8; 4 with
        compressed syncs, which send the payload) and two copies of each moment averaged (8
        each). Payloads (under 1 byte per parameter unless a top-k keeps most of its chunk) and
        chunked temporaries are left out. No communication."""
        periods = sync_periods(options)
        moments = sum(periods[key] != NEVER for key in MOMENTS)
        outer, compressed = takes_outer_step(options), bool(options.sync_topk)
        per = 16 + 4 * (outer or compressed) + 4 * outer + 4 * compressed
        per += 4 * moments if options.moment_sync_topk else 0
        per += (8 - 4 * compressed + 8 * moments) if options.param_sync_delay else 0
        return per / shard_group_size

    @classmethod
    def check_config(cls, ds: dict, cfg) -> None:
        require_shard_group_size(cfg, cls.name, "averages state between shard groups")
        o, section = cfg.mode_options, ds.get("lowcomm", {}).get("desloc", {})
        if o.param_sync_delay >= o.param_sync_every:
            raise LowCommConfigError(f"lowcomm.desloc.param_sync_delay: got {o.param_sync_delay}; at most "
                                     f"param_sync_every - 1 ({o.param_sync_every - 1}): one parameter sync "
                                     f"in flight at a time")
        if o.moment_sync_topk:
            ku, kv = o.momentum_sync_every, o.variance_sync_every
            if ku == NEVER and kv == NEVER:
                raise LowCommConfigError("lowcomm.desloc.moment_sync_topk: applies to moment syncs, and "
                                         "momentum_sync_every and variance_sync_every are both 0 (never); "
                                         "set one of them, or leave moment_sync_topk out")
            if o.param_sync_delay:
                raise LowCommConfigError(f"lowcomm.desloc.moment_sync_topk: compressed moment syncs are "
                                         f"synchronous, and param_sync_delay {o.param_sync_delay} streams the "
                                         f"moments with the parameters; set param_sync_delay to 0, or "
                                         f"moment_sync_topk to 0")
        pairs = (("sync_topk", "sync_values"), ("moment_sync_topk", "moment_sync_values"))
        compressed = [(topk, values) for topk, values in pairs if getattr(o, topk)]
        for topk, values in pairs:
            if values in section and not getattr(o, topk):
                # sync_values is the parameter syncs' own: the moments' values are moment_sync_values
                moments = (" (the compressed moment syncs' values are moment_sync_values)"
                           if values == "sync_values" and o.moment_sync_topk else "")
                raise LowCommConfigError(f"lowcomm.desloc.{values}: applies to the syncs {topk} compresses; set "
                                         f"lowcomm.desloc.{topk} (e.g. 1), or leave {values} out{moments}")
        if not compressed:
            if "sync_chunk" in section:
                raise LowCommConfigError("lowcomm.desloc.sync_chunk: applies to compressed syncs; set "
                                         "lowcomm.desloc.sync_topk or moment_sync_topk (e.g. 1), or leave "
                                         "sync_chunk out")
            return
        if o.sync_chunk > MAX_CHUNK:
            raise LowCommConfigError(f"lowcomm.desloc.sync_chunk: got {o.sync_chunk}; at most {MAX_CHUNK}")
        for topk, values in compressed:
            if getattr(o, values) == "int2" and o.sync_chunk > INT2_MAX_CHUNK:
                raise LowCommConfigError(f"lowcomm.desloc.sync_chunk: got {o.sync_chunk} with {values} 'int2', "
                                         f"which packs a 6-bit index into each value's byte; set sync_chunk to "
                                         f"at most {INT2_MAX_CHUNK}, or {values} to 'int8' or 'bf16'")
            if getattr(o, topk) > o.sync_chunk:
                raise LowCommConfigError(f"lowcomm.desloc.{topk}: got {getattr(o, topk)}; at most sync_chunk "
                                         f"({o.sync_chunk}): it counts the entries sent per chunk")

    def __init__(self, ctx: ModeContext, options: DeslocOptions) -> None:
        super().__init__(ctx, options)
        if options.inner_optimizer == "muon":
            self.adamw = ShardMuon(ctx.flat.layout, ctx.flat.buffer, muon_matrices(ctx.flat, ctx.modules),
                                   ctx.topology.shard)
        else:
            self.adamw = ShardAdamW(ctx.flat.layout, ctx.flat.buffer)
        # The local step runs on the training thread, so a sync in flight never queues a step
        # behind it. A streamed sync's collectives (param_sync_delay > 0) run on the comm worker
        # only where the local step has none (one rank per replica); with shard groups of more
        # than one rank the training thread issues them too, as asynchronous work: every
        # collective of a rank from one thread, in the order the steps fix (module doc).
        streams_on_worker = ctx.topology.shard.world == 1
        self.syncs = ReplicaSyncs(options, self.adamw, ctx.worker if streams_on_worker else None)
        self.local_ctx = dataclasses.replace(ctx, worker=None)

    def step(self) -> None:
        """The local step (a ZeRO-1 round inside the shard group), then the averages due across
        replicas (their bytes above; nothing on most steps)."""
        step_now(self.local_ctx, DeslocRound(self.local_ctx, self.adamw, self.syncs))

    def metrics(self) -> dict:
        return {"sync_periods": dict(self.syncs.periods)}

    def settle(self) -> None:
        """A streamed sync in flight has run (its result waits for its round to be applied)."""
        self.syncs.settle()

    def flush(self) -> None:
        """Before the final export: where a streamed sync is in flight, apply it now (its round
        may never come) and gather the master into the model (an all-gather inside the shard
        group, (S−1)/S · P · 4 bytes sent per rank); otherwise nothing.
        Checkpoints keep it in flight instead (:meth:`state`)."""
        if self.syncs.ticket is not None:
            self.syncs.finish_param_sync(self.adamw, self.ctx.param_groups)
            self.ctx.set_params(self.master_weights())

    # -- state: replicas differ between syncs; each rank saves its replica's shards ---------------

    def master_weights(self) -> torch.Tensor:
        """This replica's full master (collective over the shard group; after a streamed sync's
        collective, so the two never run at once)."""
        self.syncs.settle()
        return gather_full(self.ctx.checkpoint_comm, self.ctx.flat.layout, self.adamw.master)

    def state(self) -> ModeState:
        """This replica's shards of the master and moments, and of the outer optimizer's anchor
        and momentum (the same on every replica; weights-only loads and the export take replica
        0's master); per rank, this replica's Adam step count (it lags where it skipped a step)."""
        a, syncs = self.adamw, self.syncs
        sharded = {"master": a.master, "exp_avg": a.exp_avg, "exp_avg_sq": a.exp_avg_sq}
        if syncs.anchored:
            sharded["anchor"] = syncs.anchor
        if syncs.outer:
            sharded["outer_buf"] = syncs.outer_buf
        if syncs.codec is not None:  # this replica's own: what its syncs have not sent yet
            sharded["sync_error"] = syncs.error[: a.master.numel()]
        for key, moment in syncs.moment_syncs.items():  # (what is not sent yet: in the moment itself)
            sharded[f"anchor_{key}"] = moment.anchor
        meta = {"rounds": syncs.rounds, "inner_optimizer": self.options.inner_optimizer}
        rank = {"step": a.step_count}
        if syncs.ticket is not None:  # a streamed sync run (settle) and not yet applied
            sharded["sync_launched"] = syncs.launched
            if not syncs.anchored:  # (else the result is the anchor, saved above)
                sharded["sync_result"] = syncs.wire
            for key in syncs.in_flight:  # its moments: at the launch, and their means
                sharded[f"sync_launched_{key}"] = syncs.moment_launched[key]
                sharded[f"sync_result_{key}"] = syncs.moment_wire[key]
            meta["sync_finish_at"] = syncs.finish_at
            rank["sync_launch_step"] = syncs.launch_step
        return ModeState(meta=meta, sharded=sharded, rank=rank)

    def check_saved(self, meta: dict) -> None:
        """The inner optimizer must be the one the checkpoint was written with: Muon's momentum is
        not Adam's first moment, and its matrices have no second moment (Adam would divide by zero)."""
        saved = meta.get("inner_optimizer", "adamw")  # (not recorded before Muon existed)
        if saved != self.options.inner_optimizer:
            raise CheckpointError(f"this desloc checkpoint was written with inner_optimizer {saved!r}, whose state "
                                  f"{self.options.inner_optimizer!r} cannot continue; set "
                                  f"lowcomm.desloc.inner_optimizer to {saved!r}, or load with "
                                  f"load_optimizer_states=False to keep the weights")

    def restore(self, meta: Optional[dict], shards: ShardReader, rank: Optional[dict]) -> None:
        """Saved with this layout: each replica its own state. At another world size or
        ``shard_group_size``: every replica the average of the saved replicas' master and moments,
        what a sync of θ, m and v at the save step would have made, with saved replica 0's Adam
        step count. Weights only: replica 0's master for every replica; moments, steps and the
        outer optimizer restart. The model gets the master, read from the files.

        A saved error buffer (compressed syncs) is kept where this run compresses too with the
        same layout; anywhere else it is folded into the master (master − error: the progress the
        syncs had not sent yet, which the next sync then carries), so no progress is lost. A run
        that compresses a checkpoint saved without it anchors at the replicas' mean master. A
        compressed moment sync's anchor is kept with the same layout; anywhere else, or saved
        without one, it is the replicas' mean moment (what a dense sync would have agreed on).
        What its syncs had not sent is in the moments themselves, so nothing is folded.

        A streamed sync saved in flight is restored in flight where this run streams too with the
        same layout (applied at the same round, as if never interrupted); anywhere else it is
        applied at the load (master + result − launched, each moment launched with it
        s + β^n·(s̄ − s_launched)). At another layout the moments launched with it are left out:
        the replicas' mean moments loaded there are what applying it would give (the mean of
        s_r + β^n·(s̄ − s_r,launched) over the replicas is the mean of the s_r, where no replica
        skipped a step since the launch)."""
        a, syncs, topo, layout = self.adamw, self.syncs, self.ctx.topology, self.ctx.flat.layout
        syncs.ticket = syncs.finish_at = None  # (settled) a sync of the state this load replaces
        syncs.in_flight = []
        if meta is None:
            a.load_shards(shards, None)
            params = shards.full("master", a.master)
            if "sync_launched" in shards.keys():  # replica 0's streamed sync in flight
                apply_saved_sync(shards.keys(), a.master, params, lambda key: shards.shard(key, layout, a.master),
                                 lambda key: shards.full(key, a.master))
            syncs.rounds = 0
            if syncs.anchored:
                syncs.restart(a.master)
            for key, moment in syncs.moment_syncs.items():  # (the moments restart at zero)
                moment.anchor = getattr(a, key).clone()
            self.ctx.set_params(params)
            return
        keys = shards.keys()
        if syncs.outer and "anchor" not in keys:
            raise CheckpointError("this desloc checkpoint has no outer-optimizer state (saved with "
                                  "outer_lr 1 and outer_momentum 0); resume with those settings")
        mean = lambda key: shards.replica_mean(key, layout.shard_start, layout.shard_size, a.master)  # noqa: E731
        if rank is not None:
            mine = shards.of_replica(topo.rank // topo.shard_group_size)
            read = lambda key: mine.shard(key, layout, a.master)  # noqa: E731
            full = lambda key: mine.full(key, a.master)  # noqa: E731
            step = rank["step"]
        else:
            read = mean
            full = lambda key: shards.replica_mean(key, 0, shards.meta["numel"], a.master)  # noqa: E731
            step = shards.rank_state(0)["step"]
        a.master, a.exp_avg, a.exp_avg_sq = (read(key) for key in ("master", "exp_avg", "exp_avg_sq"))
        params = full("master")
        a.step_count = int(step)
        syncs.rounds = int(meta["rounds"])
        keep_error = syncs.codec is not None and rank is not None and "sync_error" in keys
        if "sync_error" in keys and not keep_error:
            a.master.sub_(read("sync_error"))
            params.sub_(full("sync_error"))
        if syncs.anchored:
            syncs.anchor = read("anchor") if "anchor" in keys else mean("master")
        if syncs.outer:
            syncs.outer_buf = read("outer_buf")
        if syncs.codec is not None:
            syncs.error.zero_()
            if keep_error:
                syncs.error[: a.master.numel()].copy_(read("sync_error"))
        for key, moment in syncs.moment_syncs.items():  # compressed moment syncs (this method's doc)
            keep = rank is not None and f"anchor_{key}" in keys
            moment.anchor = read(f"anchor_{key}") if keep else mean(key)
        if "sync_launched" in keys:  # a streamed sync in flight at the save
            moments = [k for k in MOMENTS if f"sync_launched_{k}" in keys] if rank is not None else []
            launch_step = int(rank["sync_launch_step"]) if moments else 0
            if syncs.delay and rank is not None and ("anchor" in keys) == syncs.anchored \
                    and all(k in syncs.moment_wire for k in moments):
                syncs.result.copy_(read(saved_sync_result(keys)))
                syncs.launched.copy_(read("sync_launched"))
                for k in moments:
                    syncs.moment_wire[k].copy_(read(f"sync_result_{k}"))
                    syncs.moment_launched[k].copy_(read(f"sync_launched_{k}"))
                syncs.in_flight, syncs.launch_step = moments, launch_step
                syncs.ticket = syncs.restored(topo.replica)
                syncs.finish_at = int(meta["sync_finish_at"])
            else:
                apply_saved_sync(keys, a.master, params, read, full)
                for k in moments:
                    apply_moment(a, k, read(f"sync_result_{k}"), read(f"sync_launched_{k}"),
                                 a.step_count - launch_step, self.ctx.param_groups)
        self.ctx.set_params(params)  # (the model file holds replica 0's parameters)
