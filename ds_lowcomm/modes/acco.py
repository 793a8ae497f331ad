"""acco: ACCO — Accumulate While You Communicate (Nabli et al., arXiv 2406.02613).

Each optimizer step t is two rounds of ZeRO-1 communication, each overlapped with half a batch of
gradient computation on the training thread::

    round E(t)  worker: θ̃(t+1) = AdamW(θ(t), S(t); mean of the first-half grads), state untouched
                compute meanwhile: second-half grads on θ(t)             (exact params, no delay)
    round R(t)  worker: θ(t+1), S(t+1) = AdamW(θ(t), S(t); mean of first + second half)
                compute meanwhile: next first-half grads on θ̃(t+1)      (the estimate)

At every switch (a rank has computed its quota of micro-batches since the last one, GAS/2 unless
``balance`` lowers it, and the round in flight is done): install the round's all-gathered result as the model's parameters
(or add it, a bf16 change), hand the
accumulator (and its micro-batch count) to the next round, and zero the accumulator only after
launching a real round. A real round therefore gets both halves, an estimate round only the
first; zeroing after an estimate too would degrade ACCO to DPU. When the loop ends a step early
(accelerate and the Trainer mark each step's last micro-batch; the Trainer's last step of an
epoch can be short) and ``accumulate_while_waiting`` is off, the step's real round is launched
there, without an estimate if none was launched yet, so the loop's steps and ours stay equal.

``accumulate_while_waiting`` (default where DeepSpeed counts the micro-batches, ``engine.step()``
after each; off, and refused when set, where the loop marks its own accumulation boundaries, see
:meth:`Acco.bind_loop`): a rank whose round is still in flight at a switch keeps computing
micro-batches instead of waiting; the counts are all-reduced in the round and the sum is divided
by the global count, so every micro-batch weighs the same whoever computed it. Without it the
:class:`~ds_lowcomm.shard.pace.Pacer` lets the fastest rank set the pace: a slower rank runs the rest of
each round's micro-batches forward only, and the round weights the sum by what was computed.

``balance`` (default, with ``accumulate_while_waiting``): on uneven hardware the slowest rank would
still set the pace, since a round cannot start before every rank has its GAS/2 micro-batches.
Instead each rank measures its seconds per micro-batch (the median of its recent ones, waits
excluded) and shares it in the round's count all-reduce; a rank k times slower than the fastest
launches its rounds after round(GAS/2 / k) micro-batches, at least one. The fastest rank then sets
the pace and the global count still weights the sum.

``variant: "dpu"``: one real round per step of GAS micro-batches, installed one step late
(θ(t+1) = θ(t) − AdamW(g(θ(t−1)))), for comparison; no estimate.

``estimate_dtype: "bf16"`` (default; fp32 models): the estimate round reduce-scatters its
half-batch gradient in bf16 and all-gathers only the estimate's change from the parameters each
rank holds, in bf16, which each rank adds to them: half the estimate round's bytes, the fp32
parameters never rounded to bf16 (only the small change is). ``"fp32"`` (and any bf16/fp16 model,
whose rounds already travel in 2 bytes) sends the estimate round like the real one, as the paper
does. ``real_gather_dtype: "bf16"`` (default; fp32 models) does the same for the real round's
all-gather only: its gradient is reduced in full and the master stays exact AdamW, while the model
gets the master up to the rounding of one change (taken afresh from the model each round, so it
never accumulates); ``"fp32"`` gathers the parameters whole.

Cost per optimizer step in fp32, against zero1's 8 bytes per parameter (times (W−1)/W): a real
round of 6 (gradient in fp32, change in bf16) and an estimate round of 4, so 1.25 times zero1's
bytes (1.5 times with ``real_gather_dtype: "fp32"``, twice with both dtypes ``"fp32"``), hidden
when a round takes less time than half a batch of compute. Memory per parameter: 2·p (model +
gathered result) + a (accumulator, in ``grad_accum_dtype``) + c (send buffer in ``comm_dtype``) +
12/W (master, moments) + 4/W (an fp32 gradient shard; none when c = 2: the send buffer is reduced
in place).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional

import torch

from ds_lowcomm.checkpoint import CheckpointError, ShardReader
from ds_lowcomm.config import LowCommConfigError, option
from ds_lowcomm.shard.flat import gather_full
from ds_lowcomm.comm.inflight import InFlight
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.modes.base import Mode, ModeState, require_one_shard_group
from ds_lowcomm.shard.pace import device_clock
from ds_lowcomm.shard.adamw import ShardAdamW
from ds_lowcomm.shard.step import Counts, ShardedStepRound, reduce_gradient


@dataclass(frozen=True)
class AccoOptions:
    """``lowcomm.acco``: ACCO's options (docs/configuration.md lists them)."""

    variant: str = option("acco", "'acco' (estimate + real round) or 'dpu' (delayed update)",
                          choices=("acco", "dpu"))
    accumulate_while_waiting: Optional[bool] = option(
        None, "keep computing micro-batches while a round is in flight instead of waiting for it; "
        "null = follow the loop: on where DeepSpeed counts the micro-batches (engine.step() after "
        "each), off where the loop marks its own accumulation boundaries (the Trainer, accelerate, "
        "TRL), which could not count the steps otherwise")
    estimate_dtype: str = option("bf16", "'bf16': the estimate round reduce-scatters its gradient and "
                                 "all-gathers its parameter change in bf16 (half its bytes); 'fp32': "
                                 "in comm_dtype and the model dtype, as the paper", choices=("fp32", "bf16"))
    real_gather_dtype: str = option("bf16", "'bf16': the real round all-gathers the parameters' change "
                                    "from the model's in bf16 (its gradient stays exact; the model then "
                                    "differs from the master by that change's rounding); 'fp32': the "
                                    "parameters themselves, in the model dtype", choices=("fp32", "bf16"))
    balance: Optional[bool] = option(None, "with accumulate_while_waiting: a rank slower than the fastest "
                                     "launches its rounds after fewer micro-batches (in proportion to its "
                                     "measured speed, at least one), so the fastest rank sets the pace "
                                     "instead of the slowest; null = on with accumulate_while_waiting")


def balanced_quota(per_round: int, paces: List[float], rank: int) -> int:
    """Micro-batches after which ``rank`` launches its rounds under ``balance``: ``per_round``
    scaled by how much slower it is than the fastest rank (``paces``: seconds per micro-batch),
    rounded to nearest, at least 1 and at most ``per_round``."""
    slower = paces[rank] / min(paces)
    return max(1, min(per_round, int(per_round / slower + 0.5)))


class AccoRound(ShardedStepRound):
    """One of acco's rounds: weighted by every rank's micro-batch count (:class:`Counts`), an
    ``estimate`` (the step's result written to the gathered buffer, AdamW's state untouched:
    :meth:`ShardAdamW.estimate`) or a real step, its gradient reduce-scattered in ``wire_dtype``.

    ``delta``: a padded flat buffer that gets the new parameters' *change* from the parameters
    the model holds (``ctx.flat.buffer``, which nothing writes while the round is in flight),
    all-gathered in ``delta``'s dtype, instead of ``target`` getting the parameters;
    :class:`~ds_lowcomm.comm.inflight.InFlight` adds it to them (bf16 ``estimate_dtype`` and
    ``real_gather_dtype``: half the all-gather's bytes, rounding only the small change, never the
    parameters; the model then differs from the result by that rounding, which the next round's
    change, taken from the model, corrects instead of accumulating).
    """

    def __init__(self, ctx: ModeContext, adamw: ShardAdamW, grads: torch.Tensor, target: torch.Tensor,
                 counts: Counts, *, estimate: bool, wire_dtype: Optional[torch.dtype] = None,
                 delta: Optional[torch.Tensor] = None) -> None:
        if delta is not None and target.dtype != torch.float32:
            raise ValueError(f"delta: a change is added to fp32 parameters only (these are {target.dtype}: "
                             "a change below half a ulp of a 2-byte weight would be lost); gather them whole")
        super().__init__(ctx, adamw, grads, target, counts=counts)
        self.estimate, self.delta = estimate, delta
        self.wire_dtype = wire_dtype or ctx.comm_dtype

    def reduce(self):
        """Phase 2 in ``wire_dtype`` (bf16 for an estimate by default): (W−1)/W · P · wire bytes."""
        return reduce_gradient(self.ctx, self.grads, self.wire_dtype)

    @property
    def records_step(self) -> bool:
        """An estimate's norm is of half a step's gradient: not the step's (its counts are read)."""
        return not self.estimate

    def update(self, grad: torch.Tensor, factor) -> torch.Tensor:
        """Phase 4: the estimate (AdamW's result, the state untouched: the master itself where
        the verdict skips it) or the real step; with ``delta``, its change from the parameters
        the model holds, in ``delta``'s dtype. Local."""
        if self.estimate:
            out = torch.empty_like(self.adamw.master, dtype=self.target.dtype)  # the formula's p/W
            if self.host_verdict and self.skipped:
                out.copy_(self.adamw.master)
            else:
                self.adamw.estimate(grad, self.hyper, out, factor, None if self.host_verdict else self.found_inf)
        else:
            out = super().update(grad, factor)
        if self.delta is not None:
            # The change from what the model holds (not from the master: the two differ by the
            # previous change's rounding), computed in fp32 and rounded once.
            out = (out - self.ctx.flat.layout.shard(self.ctx.flat.buffer)).to(self.delta.dtype)
        return out

    def gather(self, out: torch.Tensor) -> None:
        """Phase 5: the parameters, or with ``delta`` their change, all-gathered: (W−1)/W · P ·
        (param or delta) bytes."""
        self.ctx.topology.shard.all_gather(self.target if self.delta is None else self.delta, out)



class Acco(Mode):
    """ACCO (or DPU): sharded AdamW rounds on the CommWorker, overlapped with backward passes."""

    name = "acco"
    Options = AccoOptions
    drives_steps = True
    paces = True

    @classmethod
    def pace_block(cls, options: AccoOptions, gradient_accumulation_steps: int) -> int:
        return gradient_accumulation_steps // 2 if options.variant == "acco" else gradient_accumulation_steps

    @classmethod
    def is_asynchronous(cls, options: AccoOptions) -> bool:
        return True

    @classmethod
    def check_config(cls, ds: dict, cfg) -> None:
        gas = ds.get("gradient_accumulation_steps", 1)
        if cfg.mode_options.variant == "acco" and isinstance(gas, int) and gas % 2:
            raise LowCommConfigError(
                f"gradient_accumulation_steps: got {gas}; lowcomm.mode 'acco' splits each step into two "
                f"rounds of gradient_accumulation_steps/2 micro-batches, use an even number (e.g. {gas + 1})")
        section = ds.get("lowcomm", {}).get("acco", {})
        if cfg.mode_options.variant == "dpu" and "estimate_dtype" in section:
            raise LowCommConfigError(
                f"lowcomm.acco.estimate_dtype: {cfg.mode_options.estimate_dtype!r} applies to the estimate "
                "round of variant 'acco'; variant 'dpu' has none: leave estimate_dtype out")
        if section.get("balance") is True and cfg.mode_options.accumulate_while_waiting is False:
            raise LowCommConfigError(
                "lowcomm.acco.balance: true needs accumulate_while_waiting (a rank that waits for "
                "every round computes gradient_accumulation_steps/2 micro-batches per round whatever "
                "its pace); set accumulate_while_waiting to true, or leave balance out")

    def __init__(self, ctx: ModeContext, options: AccoOptions) -> None:
        super().__init__(ctx, options)
        require_one_shard_group(ctx, self.name)
        gas = ctx.gradient_accumulation_steps
        self.two_rounds = options.variant == "acco"
        self.per_round = gas // 2 if self.two_rounds else gas
        # Micro-batches after which this rank may launch its next round: per_round, or fewer on a
        # slower rank under ``balance`` (set from every rank's pace as each round is installed).
        self.quota = self.per_round
        self.bind_loop(marks_boundaries=False)  # the engine binds the real loop before its first backward
        self.micro_batch_seconds: Deque[float] = deque(maxlen=8)  # this rank's latest, waits excluded
        # Timed on the device's clock (balance only): on a GPU the host's clock would time the
        # queueing of kernels; marks are read once both have completed, never waiting for them.
        self._clock = device_clock(ctx.flat.device)
        self._timed: Deque[tuple] = deque()  # (start, end) marks not read yet
        self._compute_since = None
        layout = ctx.flat.layout
        self.adamw = ShardAdamW(layout, ctx.flat.buffer)
        self.send = torch.zeros(layout.padded, dtype=ctx.comm_dtype, device=ctx.flat.device)
        self.gathered = torch.zeros_like(ctx.flat.buffer)
        # bf16 estimate_dtype / real_gather_dtype: a round's change from the model's parameters,
        # gathered into the first bytes of ``gathered`` (a round's result and a change are never
        # in flight at once). fp32 models only: a bf16/fp16 model's rounds already travel in 2
        # bytes, and a change smaller than half a ulp of a 2-byte weight would be lost when added.
        fp32_model = ctx.flat.buffer.dtype == torch.float32
        change = self.gathered.view(torch.bfloat16)[:layout.padded] if fp32_model else None
        self.estimate_delta = change if options.estimate_dtype == "bf16" and self.two_rounds else None
        self.real_delta = change if options.real_gather_dtype == "bf16" else None
        self.inflight = InFlight(ctx.worker, ctx.flat.buffer, self.gathered)
        self.next_estimate = self.two_rounds
        self.since_switch = 0
        self.launched = 0  # rounds launched since the start or the last load (equal on all ranks then)
        # This rank's recent history: micro-batches computed between switches, and summed into
        # each launched round (bounded: metrics and tests read the tail).
        self.block_sizes: Deque[int] = deque(maxlen=4096)
        self.round_counts: Deque[int] = deque(maxlen=4096)
        self.rank_round_counts: Deque[List[int]] = deque(maxlen=16)  # every rank's, per round

    # -- schedule ---------------------------------------------------------------------------------

    def bind_loop(self, marks_boundaries: bool) -> None:
        """``accumulate_while_waiting`` follows the loop unless set: a loop that marks its own
        boundaries counts one step per GAS micro-batches it hands out, so a rank that computed the
        next step's micro-batches into this one would leave that loop's step N with fewer than N
        updates (and its LR schedule off them); there, refused when set. Without it, the
        :class:`~ds_lowcomm.shard.pace.Pacer` lets the fastest rank set the pace; with it, ``balance``."""
        self.check_loop(self.options, marks_boundaries)
        aww = self.options.accumulate_while_waiting
        self.aww = (not marks_boundaries) if aww is None else aww
        self.balance = self.aww and self.options.balance is not False

    @classmethod
    def check_loop(cls, options: AccoOptions, marks_boundaries: bool) -> None:
        """``accumulate_while_waiting`` or ``balance`` set true under a loop that marks its own
        boundaries: refused (see :meth:`bind_loop`)."""
        o = options
        aww = (not marks_boundaries) if o.accumulate_while_waiting is None else o.accumulate_while_waiting
        if aww and marks_boundaries:
            raise LowCommConfigError(
                "lowcomm.acco.accumulate_while_waiting: true cannot run under this loop: it marks its own "
                "accumulation boundaries (the Trainer, accelerate, TRL) and counts a step per "
                "gradient_accumulation_steps micro-batches, which a rank computing while it waits would "
                "put into earlier steps; remove the key (its default follows the loop)")
        if o.balance and not aww:
            raise LowCommConfigError(
                "lowcomm.acco.balance: true needs accumulate_while_waiting, which this loop cannot use (it "
                "marks its own accumulation boundaries); remove the key: lowcomm.pace lets the fastest "
                "rank set the pace here")

    def paces_in_loop(self) -> bool:
        """Not while computing while waiting: the fast ranks compute more there (``balance``)."""
        return not self.aww

    def on_micro_batch_end(self, boundary: bool) -> None:
        """``boundary``: the loop said this micro-batch ends its step (accelerate and the Trainer
        say so before every backward); a DeepSpeed loop that calls ``engine.step()`` every
        micro-batch says nothing, and acco keeps its own count."""
        if self.balance and self._compute_since is not None:
            self._timed.append((self._compute_since, self._clock.mark()))
        self.since_switch += 1
        if self.since_switch >= self.quota and (not self.aww or self.inflight.ready()):
            self._switch()  # else: compute another micro-batch while the round runs
        pending = self.inflight.round
        step_open = self.since_switch or (pending is not None and pending.estimate)
        if boundary and step_open and not self.aww:
            # The loop's step ended early (the Trainer's shorter last step of an epoch): take the
            # step now, so the loop's step count and ours stay equal; if its estimate round was
            # not launched yet, the step gets only its real round.
            self.next_estimate = False
            self._switch()
        # From here to the next call is this rank's compute (the switch's wait is not).
        self._compute_since = self._clock.mark() if self.balance else None

    def _switch(self) -> None:
        """Install the finished round (if any) and launch the next one."""
        self._install()
        self._launch()

    def _align(self) -> None:
        """Make every rank have launched the same rounds (collective, training thread).

        With ``accumulate_while_waiting`` a rank may have launched one round more than another
        when a loop it does not control stops or checkpoints (the Hugging Face Trainer runs the
        same micro-batches on every rank and saves at its own step count): the ranks behind
        launch it now, with what they have accumulated, instead of leaving its peers waiting.
        """
        counts = torch.zeros(self.ctx.topology.world_size, dtype=torch.float64)  # the control group: CPU
        counts[self.ctx.topology.rank] = self.launched
        self.ctx.topology.control.all_reduce(counts)
        behind = int(counts.max().item()) - self.launched
        if behind > 1:
            raise RuntimeError(f"acco: rank {self.ctx.topology.rank} is {behind} rounds behind its peers")
        if behind == 1:
            self._switch()

    def _install(self) -> None:
        """Make the finished round's result (if any) the model's parameters; its verdict and
        counts follow once they have reached the host (:meth:`_after_verdict`: at once under
        ``accumulate_while_waiting``, which installs only rounds the device has finished)."""
        self.inflight.install()

    def _after_verdict(self, rnd: AccoRound) -> None:
        """A round's counts on the host: every rank's micro-batches, and the paces that set this
        rank's quota (``balance``) or the pacer's next blocks."""
        counts = rnd.counts
        if counts.rank_counts is not None:
            self.rank_round_counts.append(counts.rank_counts)
        if counts.rank_paces is None:
            return
        if self.balance:
            paces = [p[0] for p in counts.rank_paces]
            if min(paces) > 0:
                self.quota = balanced_quota(self.per_round, paces, self.ctx.topology.shard.rank)
        elif self.ctx.pacer is not None:
            self.ctx.pacer.after_round(counts.rank_paces, None if rnd.estimate else counts.rank_weights)

    def _launch(self) -> None:
        grads = self.ctx.grads
        self.send.copy_(grads.buffer)
        count = grads.micro_batches
        pacer = self.ctx.pacer if self.ctx.pacer is not None and self.ctx.pacer.active else None
        counts = Counts(count)
        if pacer is not None:
            # Weights of the sums (cumulative over the step: an estimate's are its first half's)
            # against what a rank is handed when nothing is dropped; the paces plan the next blocks.
            gas = self.ctx.gradient_accumulation_steps
            counts = Counts(count, grads.weights.clone(), block=self.per_round if self.next_estimate else gas,
                            paces=pacer.local_paces())
            pacer.end_block()
        if not self.next_estimate:
            # A real round takes the whole step's sum (both halves); the estimate before it only
            # the first half, so the accumulator is cleared after real rounds only (clearing it
            # after estimates too would degrade ACCO to DPU).
            grads.zero_()
        if self.balance:  # 0: not measured yet (the quota stays as it is)
            while self._timed and (seconds := self._clock.seconds(*self._timed[0])) is not None:
                self._timed.popleft()
                self.micro_batch_seconds.append(seconds)
            pace = statistics.median(self.micro_batch_seconds) if len(self.micro_batch_seconds) >= 3 else 0.0
            counts = Counts(count, paces=[pace])
        cheap = self.next_estimate and self.estimate_delta is not None
        rnd = AccoRound(self.ctx, self.adamw, self.send, self.gathered, counts, estimate=self.next_estimate,
                        wire_dtype=torch.bfloat16 if cheap else None,
                        delta=self.estimate_delta if self.next_estimate else self.real_delta)
        rnd.on_verdict = self._after_verdict
        rnd.pack()
        self.inflight.launch(rnd)
        self.round_counts.append(count)
        self.block_sizes.append(self.since_switch)
        self.next_estimate = self.two_rounds and not self.next_estimate
        self.since_switch = 0
        self.launched += 1
        if not rnd.estimate:
            # The step is taken: its gradient is final and its update in flight (it reaches the
            # model at the next switch). After pack(), so the scheduler step this triggers
            # gives the next round, not this one, the next learning rate.
            self.ctx.step_taken()

    def step(self) -> None:
        """Unused: ACCO's steps are driven from the backward passes (``drives_steps``)."""

    def settle(self) -> None:
        """Align the ranks' rounds, then wait for the round in flight (without installing it): the
        optimizer state is then stable. Collective: an all-reduce of W float64 launch counts on
        the control group, and on a rank one round behind, that round (reduce-scatter, norm,
        all-gather: a ZeRO-1 round, as above)."""
        self._align()
        self.inflight.settle()

    def flush(self) -> None:
        """Give the model the latest real parameters θ (the master), e.g. before a final export.

        The pending round, if any, stays pending; training may go on after a flush. Collective:
        :meth:`settle`, then an all-gather of the master, (W−1)/W · P · 4 bytes sent per rank.
        """
        self.inflight.rebase(self.master_weights())  # settles; a pending change stays right

    # -- state --------------------------------------------------------------------------------

    def master_weights(self) -> torch.Tensor:
        """:meth:`settle`, then an all-gather of the master, (W−1)/W · P · 4 bytes sent per rank."""
        self.settle()
        return gather_full(self.ctx.checkpoint_comm, self.ctx.flat.layout, self.adamw.master)

    def metrics(self) -> dict:
        recent = list(self.round_counts)[-16:]
        by_rank = [sum(c) / len(c) for c in zip(*self.rank_round_counts)]
        return {"micro_batches_per_round": sum(recent) / len(recent) if recent else 0.0,
                "micro_batches_per_round_by_rank": by_rank}

    def state(self) -> ModeState:
        """Master and moments; with a round finished and not installed, its verdict and this rank's
        slice of its result (an estimate's parameters are nowhere else); per rank, the gradients
        accumulated mid-step (the buffer itself: nothing writes it while the checkpoint is
        written), their micro-batch count and weights, and this rank's schedule position."""
        rnd, layout, grads = self.inflight.round, self.ctx.flat.layout, self.ctx.grads
        pending = self.inflight.verdict()
        sharded = self.adamw.sharded_state()
        if rnd is not None:
            pending["estimate"] = rnd.estimate
            # The parameters the install would give, so a resume (at any layout) copies them:
            # the model's parameters now plus the change, as InFlight.install adds them.
            sharded["pending_params"] = (layout.shard(self.ctx.flat.buffer) + layout.shard(rnd.delta)
                                         if rnd.delta is not None else layout.shard(self.gathered).clone())
        meta = {"step": self.adamw.step_count,
                "acco": {"variant": self.options.variant, "next_estimate": self.next_estimate, "pending": pending}}
        rank = {"accumulator": grads.buffer, "micro_batches": grads.micro_batches, "weights": grads.weights.tolist(),
                "since_switch": self.since_switch, "round_counts": list(self.round_counts),
                "block_sizes": list(self.block_sizes)}
        return ModeState(meta, sharded, rank)

    def restore(self, meta: Optional[dict], shards: ShardReader, rank: Optional[dict]) -> None:
        """Weights only: the schedule starts afresh from the master. Saved at another world size:
        the gradients the saved ranks had accumulated mid-step go, summed, into new rank 0's
        accumulator with their micro-batch counts and weights, and every other rank starts its
        half-step empty (a round sums over ranks and divides by the global count, so where the
        sums sit does not change the step they make)."""
        if meta is not None and meta["acco"]["variant"] != self.options.variant:
            raise CheckpointError(f"checkpoint was written with lowcomm.acco.variant {meta['acco']['variant']!r}, "
                                  f"this run uses {self.options.variant!r}")
        grads = self.ctx.grads
        self.inflight.drop()
        self.launched = 0
        self.quota = self.per_round  # re-measured from the next round on
        self.adamw.load_shards(shards, None if meta is None else meta["step"])
        self.round_counts.clear()
        self.block_sizes.clear()
        grads.zero_()
        self.since_switch = 0
        if meta is None:
            self.next_estimate = self.two_rounds
            self.ctx.set_params(shards.full("master", self.adamw.master))
            return
        self.next_estimate = meta["acco"]["next_estimate"]
        pending = meta["acco"]["pending"]
        if pending is not None:
            # Re-create the finished, not yet installed round: the next switch installs it.
            rnd = AccoRound(self.ctx, self.adamw, self.send, self.gathered, Counts(0), estimate=pending["estimate"])
            self.inflight.restore(rnd, pending, shards.full("pending_params", self.gathered))
        if rank is not None:  # this rank's own, as it was
            grads.buffer.copy_(rank["accumulator"])
            grads.micro_batches = int(rank["micro_batches"])
            grads.weights.copy_(torch.tensor(rank["weights"], dtype=torch.float64))
            self.since_switch = rank["since_switch"]
            self.round_counts.extend(rank["round_counts"])
            self.block_sizes.extend(rank["block_sizes"])
        elif self.ctx.topology.rank == 0:
            numel = self.ctx.flat.layout.numel  # (the padding depends on the world size)
            for r in range(shards.meta["world_size"]):
                part = shards.rank_state(r)
                grads.buffer[:numel].add_(part["accumulator"][:numel].to(grads.buffer.device))
                grads.micro_batches += int(part["micro_batches"])
                grads.weights.add_(torch.tensor(part["weights"], dtype=torch.float64, device=grads.weights.device))
