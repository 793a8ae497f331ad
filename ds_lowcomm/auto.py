"""``"lowcomm": {"mode": "automatic"}``: the mode, and its options, for the compute and links measured.

At the end of the run's first training micro-batch, before any gradient leaves a rank, every rank
has timed that micro-batch (its forward and backward pass); the ranks then time probe all-reduces
on the whole world (and, when the world's link is slow and the launcher says how many ranks share
a node, inside a node), agree on the numbers, and :func:`choose` reads them:

* ``r``: one fp32 gradient all-reduce over the world (what DDP sends per step), predicted from the
  probes, over the compute of one optimizer step (the micro-batch's time × accumulation steps);
* ``uneven``: the slowest rank's step over the fastest's.

==============================================  ===========================================
measured                                        chosen
==============================================  ===========================================
``r`` < ``FAST``, even ranks                    ``zero1``
``r`` < ``SLOW``, uneven ranks or ``r`` ≥ FAST  ``acco`` (else ``zero1`` with ``overlap``)
``r`` ≥ ``SLOW``, nodes whose inside link is    ``desloc``, ``shard_group_size`` = ranks per
fast (``r`` inside a node < ``FAST``)           node, Kx the power of two ≥ 6·r in [16, 256],
                                                each sync streamed behind Kx/4 local steps
``r`` ≥ ``SLOW``, the user's ``desloc``         ``desloc`` (a replica layout in the order
``inner_optimizer`` is ``"muon"``               above, demo's last), the same picks
``r`` ≥ ``SLOW``, otherwise                     ``demo``, every rank its own replica, the
                                                slow-link settings (top-256 of 64×64, sign)
==============================================  ===========================================

The optimizer is the user's: "automatic" never changes it. Muon is a local step that only
``desloc`` runs, so a user who asked for it gets ``desloc`` where a local mode wins, not ``demo``,
whose step is a sign of its own compressed momentum.

A replica layout whose optimizer state (the mode's own count with the user's options,
:meth:`~ds_lowcomm.modes.base.Mode.state_bytes`) would not fit in the device memory free after the
first micro-batch (CUDA) is passed over: ``desloc`` on a node's ranks next, else the sharded row;
desloc's syncs stream only where the state they add fits too, else they are synchronous.

(the bench's measurements behind each row: docs/automatic.md). A user's own keys in a mode's
sub-object win over the picks, a ``shard_group_size`` limits the choice to the modes of that layout,
and a candidate its ``check_config`` refuses (``acco`` with an odd accumulation count) is skipped.
The verdict is one log line. Every ``recheck_every`` steps the compute per step is measured again
from the run's own step times (the first micro-batch's includes warm-up), the table read again,
and a different verdict logged: the optimizer state of one mode does not carry over to another, so
the mode changes only at a restart with it set.

Spelt ``"automatic"``, not ``"auto"``: the Hugging Face Trainer and accelerate take every ``"auto"``
value of a DeepSpeed JSON for one of theirs to fill, and stop on one they cannot (accelerate 1.x,
``DeepSpeedPlugin.fill_match``).
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from ds_lowcomm.config import LowCommConfigError

#: ``r`` below which communication is a small share of a step (the fast regime: zero1 is at DDP's pace)
FAST = 0.25
#: ``r`` from which the local modes win over the synchronous ones (the bench's slow regime is
#: r = 10; where each stands at which r: docs/automatic.md)
SLOW = 3.0
#: the slowest rank's step over the fastest's from which ranks count as uneven (pace.TRIGGER)
UNEVEN = 1.5
#: the first probe all-reduce: 64 KiB, about 40 ms at 25 Mbit/s
FIRST_PROBE_BYTES = 64 << 10
#: the probes double from the first up to this size, until one spends longer than PROBE_SECONDS
#: beyond the latency; one more, sized to spend about PROBE_SECONDS at the rate that one read, counts
PROBE_BYTES = 1 << 20
PROBE_SECONDS = 0.05

#: the share of the free device memory a replica layout's state may take
MEMORY_SHARE = 0.8

#: what each choice sets in its mode's sub-object (the user's own keys win)
DEMO_SLOW_LINK = {"beta": 0.999, "chunk": 64, "topk": 256, "values": "sign", "tiling": "matrix"}


@dataclass(frozen=True)
class Measured:
    """What :func:`choose` reads, the same on every rank."""
    world_size: int
    #: ranks per node (consecutive ranks), from the launcher; 1 when unknown
    ranks_per_node: int
    #: each rank's compute per optimizer step, seconds
    step_s: Sequence[float]
    #: one fp32 gradient all-reduce over the world, predicted, seconds
    world_sync_s: float
    #: the same inside one node (None: not measured)
    node_sync_s: Optional[float] = None
    #: the user's ``shard_group_size`` (None: auto's to choose)
    shard_group_size: Optional[int] = None
    #: trainable parameters, and the device memory free after the first micro-batch (None: not
    #: checked, as on CPU, where the host's memory is not the limit this guards)
    numel: int = 0
    free_bytes: Optional[float] = None
    #: the user's ``desloc.inner_optimizer`` is "muon": on a slow link desloc comes before demo
    muon: bool = False
    #: ``(mode, shard_group_size, streamed)`` → bytes per parameter of one rank's optimizer state
    #: with the user's options (:meth:`~ds_lowcomm.modes.base.Mode.state_bytes`; ``streamed``:
    #: desloc's syncs streamed); needed where ``free_bytes`` is set
    state_bytes: Optional[Callable[[str, int, bool], float]] = None

    def fits(self, mode: str, shard_group_size: int, streamed: bool = False) -> bool:
        """Whether ``mode``'s optimizer state on shards of ``shard_group_size`` ranks takes at
        most ``MEMORY_SHARE`` of the free memory."""
        if self.free_bytes is None:
            return True
        return self.numel * self.state_bytes(mode, shard_group_size, streamed) <= MEMORY_SHARE * self.free_bytes

    @property
    def compute_s(self) -> float:
        """The median rank's compute per step."""
        return float(statistics.median(self.step_s))

    @property
    def ratio(self) -> float:
        """``r``: a DDP sync over the world in steps of compute."""
        return self.world_sync_s / max(self.compute_s, 1e-9)

    @property
    def node_ratio(self) -> Optional[float]:
        return None if self.node_sync_s is None else self.node_sync_s / max(self.compute_s, 1e-9)

    @property
    def uneven(self) -> float:
        """The slowest rank's compute per step over the fastest's."""
        return max(self.step_s) / max(min(self.step_s), 1e-9)

    def needs_node_probe(self) -> bool:
        """Whether the choice hangs on the link inside a node (slow world, several nodes)."""
        return (self.shard_group_size is None and self.ratio >= SLOW
                and 1 < self.ranks_per_node < self.world_size and self.node_sync_s is None)


@dataclass(frozen=True)
class Choice:
    """A mode, its layout (``shard_group_size`` None: the whole world), auto's picks for its
    sub-object and why, in words."""
    mode: str
    shard_group_size: Optional[int]
    options: Dict[str, object] = field(default_factory=dict)
    reason: str = ""

    def as_dict(self) -> dict:
        return {"mode": self.mode, "shard_group_size": self.shard_group_size, "options": dict(self.options),
                "reason": self.reason}


def describe(choice: Choice) -> str:
    """``desloc (shard_group_size 2, param_sync_every 64, ...)``: the choice in one phrase."""
    settings = ([] if choice.shard_group_size is None else [f"shard_group_size {choice.shard_group_size}"]) + \
        [f"{k} {v}" for k, v in choice.options.items()]
    return choice.mode + (f" ({', '.join(settings)})" if settings else "")


def desloc_picks(ratio: float, streamed: bool = True) -> Dict[str, int]:
    """Kx the power of two at or above 6·r, within [16, 256], and the moments at 3·Kx and 6·Kx (the
    shipped periods): a parameter sync then costs about a sixth of its Kx steps' compute. With
    ``streamed``, each sync's all-reduce runs behind :func:`desloc_delay` local steps (Streaming
    DiLoCo's overlap, arXiv 2501.18512): Kx/4 ≥ 1.5·r steps of compute hide a parameter sync up to
    r ≈ 43 (Kx's cap), one that carries a moment too only in part."""
    kx = 2 ** max(4, min(8, math.ceil(math.log2(max(6 * ratio, 1.0)))))
    periods = {"param_sync_every": kx, "momentum_sync_every": 3 * kx, "variance_sync_every": 6 * kx}
    return {**periods, "param_sync_delay": desloc_delay(kx)} if streamed else periods


def desloc_delay(param_sync_every: int, moment_sync_topk: int = 0) -> int:
    """The ``param_sync_delay`` "automatic" streams desloc's syncs by: a quarter of the parameter
    period that runs (the user's own, where set); 0 (synchronous) with compressed moment syncs,
    which cannot stream."""
    return 0 if moment_sync_topk else param_sync_every // 4


def choose(m: Measured, usable: Sequence[str]) -> Choice:
    """The table in this module's docstring. ``usable``: the modes that can run here. Pure: no
    communication."""
    r, w, per_node = m.ratio, m.world_size, m.ranks_per_node
    numbers = f"a DDP gradient sync over {w} ranks = {r:.2f} steps of compute"
    if m.uneven >= UNEVEN:
        numbers += f", slowest rank {m.uneven:.2f}x the fastest"
    fixed = m.shard_group_size
    sharded = fixed is None or fixed == w
    too_big = []
    if (fixed is None or fixed < w) and (r >= SLOW or not sharded):
        node_fast = m.node_ratio is not None and m.node_ratio < FAST
        if node_fast:
            numbers += f", inside a node {m.node_ratio:.2f}"
        nodes = 1 < per_node < w
        if fixed is not None:
            layouts = [("desloc", fixed), ("demo", fixed)] if fixed > 1 else [("demo", 1), ("desloc", 1)]
        else:  # a node's fast link shards the state; else every rank its own replica; a node if that does not fit
            layouts = ([("desloc", per_node)] if nodes and node_fast else []) + [("demo", 1), ("desloc", 1)] + \
                ([("desloc", per_node)] if nodes and not node_fast else [])
        if m.muon:  # the user's local step is Muon, which only desloc runs: demo last
            layouts = [lay for lay in layouts if lay[0] == "desloc"] + [lay for lay in layouts if lay[0] == "demo"]
        for mode, size in layouts:
            if mode not in usable:
                continue
            if not m.fits(mode, size):
                too_big.append(f"{mode} with replicas of {size} rank(s) would not fit in memory")
                continue
            replicas = "every rank its own replica" if size == 1 else f"replicas of {size} ranks"
            numbers += "".join(f"; {why}" for why in too_big)
            if mode == "demo":
                return Choice("demo", size, dict(DEMO_SLOW_LINK), f"{numbers}: compressed momentum, {replicas}")
            streamed = m.fits(mode, size, streamed=True)
            how = "" if streamed else " (no streaming picked: its buffers would not fit in memory)"
            muon = ", Muon as the local step (desloc.inner_optimizer)" if m.muon else ""
            return Choice("desloc", size, desloc_picks(r, streamed),
                          f"{numbers}: {replicas} sync every few dozen steps{how}{muon}")
        if not sharded:
            raise LowCommConfigError(
                f"lowcomm.mode: 'automatic' found no mode to run with lowcomm.shard_group_size {fixed} "
                f"({'; '.join(too_big) or 'demo and desloc refused'}); remove shard_group_size or set lowcomm.mode")
    numbers += "".join(f"; {why}" for why in too_big)
    if r < FAST and m.uneven < UNEVEN:
        return Choice("zero1", None, {}, f"{numbers}: communication is a small part of a step")
    if "acco" in usable:
        why = "uneven ranks keep computing" if m.uneven >= UNEVEN else "its rounds hide behind computation"
        return Choice("acco", None, {}, f"{numbers}: {why}")
    return Choice("zero1", None, {"overlap": True}, f"{numbers}: the overlapped ZeRO-1 (acco cannot run here)")


def ranks_per_node(world_size: int, control) -> int:
    """The launcher's ``LOCAL_WORLD_SIZE`` (torchrun, the DeepSpeed launcher) when every rank reads
    the same divisor of the world, else 1. Collective over ``control`` (a gloo group): 16 bytes."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    both = torch.tensor([local, -local], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=control)
    agreed = int(both[0]) == -int(both[1])
    return local if agreed and local >= 1 and world_size % local == 0 else 1


def _timed_all_reduce(group, numel: int, device: torch.device, repeats: int = 2) -> float:
    """The least seconds of ``repeats`` fp32 all-reduces of ``numel`` elements on ``group``."""
    t = torch.zeros(numel, dtype=torch.float32, device=device)
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def predict_sync_s(group, model_numel: int, device: torch.device, control) -> float:
    """One fp32 all-reduce of ``model_numel`` elements on ``group``, predicted from timed probes and
    extrapolated linearly in bytes: tiny ones (latency; the first also opens a lazily created
    communicator), then probes from ``FIRST_PROBE_BYTES`` doubling up to ``PROBE_BYTES`` (or the
    model) until one spends more than ``PROBE_SECONDS`` beyond the tiny one's time on some rank
    (the ranks agree on each time over ``control``, a gloo group, so that every rank issues the
    same collectives); latency alone never stops them. Only after such a slow probe, one more runs
    back to back, sized to spend about ``PROBE_SECONDS`` at the rate that one read (a quarter of
    its size at least), and its time counts: a link shaped by a token bucket lets its burst
    through at once, and the probe that outran the burst still rode on part of it, which reads the
    link faster than it is, by however much of the burst it rode; the next finds the bucket empty,
    and spends longer than it was sized for. Stopping at the burst's edge, rather than doubling
    past it, keeps the probes cheap. Where that last probe spends under a quarter of
    ``PROBE_SECONDS`` (a hiccup made the one before it read slow), the doubling goes on (and the
    largest probe, read slow so, runs once more): on a fast link a probe that small would time
    noise. A burst larger than all the probes (about 4 MiB sent per rank) reads as the link's rate.
    Each probe is timed once: a link whose latency jitters by a large share of ``PROBE_SECONDS``
    (tens of milliseconds) can stop the doubling early and read slower than it is.
    Collective over ``group``: at most about 2·2 MiB sent per rank on a fast link (2·3.25 MiB after
    a hiccup on the largest probe); on a steady slow one the probes take under 5·``PROBE_SECONDS``
    beyond their latencies (twice the first probe's time where that one alone takes longer); the
    device is synchronized around each probe (once per run, before training's first gradient
    leaves the rank)."""
    _timed_all_reduce(group, 1, device, repeats=1)  # warm-up
    small = _timed_all_reduce(group, 16, device)
    cap = max(16, min(model_numel, PROBE_BYTES // 4))
    numel = min(cap, FIRST_PROBE_BYTES // 4)

    def predicted(seconds, numel):  # linear in the bytes, past the latency
        return small + max(seconds - small, 0.0) / numel * model_numel

    while True:  # each probe twice the last, until its bytes (its time less latency) are timed
        seconds = _timed_all_reduce(group, numel, device, repeats=1)
        spent = agree([seconds - small], control, op=dist.ReduceOp.MAX)[0]
        if spent > PROBE_SECONDS:  # one more, of the size that spends about PROBE_SECONDS at its rate
            # a quarter at least: a reading far over PROBE_SECONDS (a first probe on a very slow
            # link, or one a hiccup slowed) would otherwise size the last probe down to noise
            last = max(16, numel // 4, int(numel * PROBE_SECONDS / spent))
            seconds = _timed_all_reduce(group, last, device, repeats=1)
            if agree([seconds - small], control, op=dist.ReduceOp.MAX)[0] >= PROBE_SECONDS / 4:
                return predicted(seconds, last)
            if numel == cap:  # the largest probe read slow on a hiccup: it runs once more
                return predicted(_timed_all_reduce(group, cap, device, repeats=1), cap)
        elif numel == cap:
            return predicted(seconds, cap)
        numel = min(2 * numel, cap)


def agree(values: Sequence[float], control, op=dist.ReduceOp.SUM) -> list:
    """``values`` reduced element-wise over ``control`` (a gloo group) by ``op``: with SUM each rank
    puts its own in its slots and zeros elsewhere (MIN: infinity elsewhere). 8 bytes per value."""
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=op, group=control)
    return t.tolist()
