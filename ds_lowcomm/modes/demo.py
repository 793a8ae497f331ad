"""demo: DeMo — Decoupled Momentum Optimization (Peng, Quesnelle, Kingma; arXiv 2411.19870).

Ranks exchange only the top-k DCT coefficients of their momentum. Sharded: inside a shard group
(``shard_group_size`` ranks, a node) gradients are reduce-scattered and parameters all-gathered as
in ZeRO-1, each rank keeping the fp32 master and the momentum δ of its shard only; across the
replica group (the ranks holding the same shard in the other nodes: the slow links) only the
packed payload travels. Per optimizer step, on each rank's shard::

    g  = mean over the shard group of the gradient shard (clipped by its global norm)
    δ ← β·δ + lr·g                              lr folded into the momentum
    C  = top-k DCT coefficients of δ per tile    (ds_lowcomm.modes.dct, as they will be sent)
    δ ← δ − IDCT(C)                             error feedback
    Q  = IDCT(mean over the replica group of the gathered coefficients, per index)
    θ ← θ·(1 − lr·wd) − lr·sign(Q)

Tiles (``tiling``, see ds_lowcomm.modes.dct): by default each weight matrix's whole rows in the shard are
tiled on the matrix's own rows and columns (the reference DeMo's 2-D tiling), the rest flat;
``"flat"`` tiles the flat shard whatever the parameter boundaries (as torchtitan-lowcomms does).
Matrix tiling is the default because it gave the lower loss in every setting measured, for a
slightly larger payload (docs/modes/demo.md). Either way any parameter shape works and the shard split is free.

Bytes across replica groups per rank and step: (R−1)·payload sent and received, payload =
``DctTopK.payload_bytes`` (about 1/256 of fp32 ZeRO-1's bytes with chunk 64, top 32, bf16
values). δ differs per replica: each rank saves its replica's shard of it; a resume at another
world size or ``shard_group_size`` gives every replica the saved replicas' average.

``overlap: true``: the whole step above runs as a round on the CommWorker (thread / side stream)
while the next step's micro-batches compute, and its result becomes the model's parameters at the
next boundary: the update is applied one step late, as torchtitan-lowcomms and Psyche do. Costs
one more copy of the parameters (the gathered result) and of the gradients (the send buffer).
``lookahead`` (with overlap; on by default) compensates the delay as they do: while step t's
global update is in flight, step t+1's gradients are taken at θ_t − lr·sign(β·δ + lr·g_t), this
rank's own momentum step, which the global result replaces at the next boundary. It needs the
whole momentum on the rank (``shard_group_size: 1``) and one fp32 parameter-sized temporary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch

from ds_lowcomm.checkpoint import ShardReader
from ds_lowcomm.memory import step_chunk_bytes, temporary
from ds_lowcomm.config import LowCommConfigError, option
from ds_lowcomm.modes.dct import VALUE_FORMATS, DctTopK
from ds_lowcomm.shard.flat import gather_full
from ds_lowcomm.comm.inflight import InFlight
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.modes.base import Mode, ModeState, require_shard_group_size
from ds_lowcomm.comm.round import StepRound
from ds_lowcomm.shard.step import clip_scale_tensor, finite_flag, judge, nonfinite, step_now

if TYPE_CHECKING:
    from ds_lowcomm.config import LowCommConfig


@dataclass(frozen=True)
class DemoOptions:
    """``lowcomm.demo``: DeMo's options (docs/configuration.md lists them)."""

    beta: float = option(0.999, "momentum decay (the reference's compression_decay)", minimum=0, below=1)
    chunk: int = option(64, "DCT tile edge: tiles of chunk × chunk elements", minimum=2)
    topk: int = option(32, "coefficients kept per tile", minimum=1)
    values: str = option("bf16", "wire format of the kept coefficients: 'bf16', or 'sign' (1 bit "
                         "plus one bf16 scale per tile)", choices=VALUE_FORMATS)
    tiling: str = option("matrix", "'matrix': chunk × chunk blocks of each weight matrix's rows and "
                         "columns; 'flat': tiles of consecutive elements of the flat shard",
                         choices=("matrix", "flat"))
    overlap: bool = option(False, "run each step's communication while the next step computes; "
                           "its update reaches the model one step late")
    lookahead: bool = option(True, "with overlap: take the next step's gradients at the parameters "
                             "moved by this rank's own momentum step while the global one is in "
                             "flight (needs shard_group_size 1)")


class DemoShard:
    """This rank's shard of DeMo's state, beside what :class:`ShardAdamW` is to AdamW: the fp32
    master, the momentum δ (error-feedback residual included) and the updates applied. Only the
    round in flight writes it; the mode reads it once the round has run."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self.momentum = torch.zeros_like(master)
        #: updates applied, as each round's verdict is read on the host
        self.step_count = 0


class DemoRound(StepRound):
    """One DeMo step on this rank's shard (the module docstring's equations).

    Reads the padded flat gradient sums ``grads``; updates ``shard`` (δ and the master); writes
    the new parameters, all-gathered over the shard group, into ``target``. Communication per
    round: shard group of W ranks: reduce-scatter (W−1)/W·P·comm bytes, an all-reduce of the
    norm and W finite flags (2(W−1)/W · 4(W+1) bytes), all-gather (W−1)/W·P·param bytes; replica group of R: all-gather (R−1)·payload.

    Non-finite guard: a shard group whose gradient norm is NaN/inf (or whose new δ is) sends NaN
    values, so the decoded mean update is non-finite on every replica; then nobody commits δ or
    touches the master, and the all-gather hands back the unchanged weights. The verdicts stay
    on the device (the host reads a landed copy once the round is installed); the new δ is built
    beside the old one until then: one more shard-sized fp32 buffer while the round runs.
    """

    def __init__(self, ctx: ModeContext, shard: DemoShard, codec: DctTopK, beta: float,
                 grads: torch.Tensor, target: torch.Tensor) -> None:
        super().__init__()
        self.ctx, self.shard, self.codec, self.beta = ctx, shard, codec, beta
        self.grads, self.target = grads, target
        self.segments = ctx.flat.layout.segments()

    def pack(self) -> None:
        # Hyperparameters in force now (a scheduler may change them while the round runs).
        self.hyper: List[dict] = [{k: g[k] for k in ("lr", "weight_decay")} for g in self.ctx.param_groups]
        self.capture_step(self.ctx.loss_scale, self.ctx.steps)

    def run(self) -> None:
        """The round (the class docstring): a reduce-scatter and a norm inside the shard group,
        one all-gather of the payloads across replica groups, an all-gather of the parameters."""
        ctx, hyper, state, codec = self.ctx, self.hyper, self.shard, self.codec
        shard, replica = ctx.topology.shard, ctx.topology.replica

        own_nonfinite = nonfinite(self.grads.sum(dtype=torch.float64))
        grad = temporary(ctx.flat.layout.shard_size, torch.float32, self.grads.device)
        shard.reduce_scatter(grad, self.grads, wire_dtype=ctx.comm_dtype)
        grad.mul_(1.0 / (shard.world * self.loss_scale))
        # The verdicts stay on the device (no host read inside the round): the shard group's
        # norm, clipped in place, and which of its ranks' own sums were not finite.
        norm, _, flags = judge(shard, grad, 1.0, ctx.gradient_clipping, own_nonfinite)

        # δ is updated into a new tensor and committed only once every replica's verdict is in.
        momentum = state.momentum * self.beta
        for seg in self.segments:
            sl = slice(seg.start, seg.end)
            momentum[sl].add_(grad[sl], alpha=hyper[seg.group]["lr"])
        del grad  # freed before the codec's buffers: the step's peak stays at Demo.state_bytes
        local_ok = nonfinite(norm).logical_not() & finite_flag(momentum)  # one verdict per shard group
        idx, vals = codec.encode(momentum)
        # The verdict rides in the payload: NaN values make every replica's decoded update
        # non-finite, so every replica skips this step with us.
        vals = torch.where(local_ok, vals, torch.full_like(vals, float("nan")))
        payload = codec.pack(idx, vals)
        if replica is None:
            payloads = [payload]
        else:
            gathered = payload.new_empty(replica.world * payload.numel())
            replica.all_gather(gathered, payload)
            payloads = list(gathered.chunk(replica.world))
        update = codec.decode_mean(payloads)
        # Checked before sign(): sign(NaN) hides it. Where it skips, δ and the master stay.
        skip = nonfinite(update.sum(dtype=torch.float64))
        keep = skip.logical_not().double()
        momentum.sub_(codec.dense(idx, vals))  # error feedback
        state.momentum = torch.where(skip, state.momentum, momentum, out=momentum)
        update.sign_().nan_to_num_(0.0).mul_(keep)
        for seg in self.segments:
            sl, hp = slice(seg.start, seg.end), hyper[seg.group]
            state.master[sl].mul_(1 - keep * (hp["lr"] * hp["weight_decay"])).add_(update[sl], alpha=-hp["lr"])
        shard.all_gather(self.target, state.master)  # converted chunk by chunk
        self.stage(torch.cat([norm.reshape(1), skip.double().reshape(1), flags.double()]))

    def apply_verdict(self, values: List[float]) -> None:
        """The shard group's norm, the global skip, and (after a non-finite norm) the ranks whose
        own sums were not finite; the host's step count follows."""
        comm = self.ctx.topology.shard
        self.grad_norm, self.skipped = values[0], bool(values[1])
        if not math.isfinite(self.grad_norm):
            self.nonfinite_ranks = [comm.ranks[i] for i, bad in enumerate(values[2:2 + comm.world]) if bad]
        if not self.skipped:
            self.shard.step_count += 1

    def install(self) -> None:
        self.ctx.land_verdict(self)


class Demo(Mode):
    """Sharded DeMo: ZeRO-1 inside a shard group, compressed momentum across replica groups."""

    name = "demo"
    Options = DemoOptions

    @classmethod
    def is_asynchronous(cls, options: DemoOptions) -> bool:
        return options.overlap

    @classmethod
    def state_bytes(cls, options: DemoOptions, shard_group_size: int) -> float:
        """docs/benchmarks.md's "Memory per GPU": the master, δ and a step's gradient shard, and in
        a step up to as much again for the codec (its tiled shard, decoded sums and their counts):
        24 bytes per parameter, sharded; with ``overlap`` the send buffer and the gathered
        parameters, whole (at most 8). No communication."""
        return 24 / shard_group_size + (8 if options.overlap else 0)

    @classmethod
    def check_config(cls, ds: dict, cfg: "LowCommConfig") -> None:
        o = cfg.mode_options
        if o.topk > o.chunk * o.chunk:
            raise LowCommConfigError(f"lowcomm.demo.topk: got {o.topk}; must be <= chunk² = {o.chunk ** 2}")
        require_shard_group_size(cfg, cls.name, "exchanges compressed momentum between shard groups "
                                                "(1 = DeMo as in its paper)")
        if o.overlap and o.lookahead and cfg.shard_group_size != 1:
            raise LowCommConfigError(
                "lowcomm.demo.lookahead: the look-ahead of demo.overlap needs the whole momentum on "
                f"each rank (shard_group_size 1, got {cfg.shard_group_size}); set demo.lookahead "
                "to false to overlap without it (the one-step-delayed update then costs loss, see "
                "docs/modes/demo.md)")

    def __init__(self, ctx: ModeContext, options: DemoOptions) -> None:
        super().__init__(ctx, options)
        layout = ctx.flat.layout
        self.shard = DemoShard(layout.shard(ctx.flat.buffer).to(torch.float32, copy=True))
        matrices = tuple(ctx.flat.matrix_rows_in_shard()) if options.tiling == "matrix" else ()
        self.codec = DctTopK(layout.shard_size, options.chunk, options.topk, options.values, matrices)
        self.segments = layout.segments()
        # overlap: the round in flight (or done, not installed), its send buffer and result
        self.inflight = self.send = self.gathered = None
        if options.overlap:
            self.send = torch.zeros(layout.padded, dtype=ctx.comm_dtype, device=ctx.flat.device)
            self.gathered = torch.zeros_like(ctx.flat.buffer)
            self.inflight = InFlight(ctx.worker, ctx.flat.buffer, self.gathered)

    def _round(self, grads: torch.Tensor, target: torch.Tensor) -> DemoRound:
        return DemoRound(self.ctx, self.shard, self.codec, self.options.beta, grads, target)

    @torch.no_grad()
    def step(self) -> None:
        """One DeMo round (its bytes above): on the training thread, or with overlap this step's
        round packed and launched on the comm worker and the previous one's result installed."""
        ctx = self.ctx
        if self.inflight is None:
            step_now(ctx, self._round(ctx.grads.buffer, ctx.flat.buffer))
            return
        self.inflight.install()  # also frees ``send`` for this step's gradients
        self.send.copy_(ctx.grads.buffer)
        ctx.grads.zero_()
        rnd = self._round(self.send, self.gathered)
        rnd.pack()
        if self.options.lookahead:
            self._look_ahead(rnd.hyper)
        self.inflight.launch(rnd)
        ctx.step_taken()  # its update reaches the model at the next boundary (or flush)

    def _look_ahead(self, hyper: List[dict]) -> None:
        """Move the model by this rank's own momentum step, sign(β·δ + lr·clipped g): the local
        estimate of the global update in flight (torchtitan-lowcomms, Psyche). Runs before the
        round is submitted, while δ is stable; the round's result overwrites the model."""
        # All on the device, no host read (a .item() here would stall the host every step and
        # cost the overlap): the norm, its clip scale and its finiteness stay tensors.
        ctx, send, loss_scale, momentum = self.ctx, self.send, self.ctx.loss_scale, self.shard.momentum
        norm = torch.linalg.vector_norm(send, dtype=torch.float64) / loss_scale
        scale = clip_scale_tensor(norm, ctx.gradient_clipping)
        # A non-finite gradient: the round will skip this step, and the model stays where it is
        # (computing at a non-finite point would spread it): the step becomes zero.
        finite = torch.isfinite(norm)
        chunk = step_chunk_bytes(momentum.device) // 4  # the step chunk by chunk: no shard-sized temporary
        scratch = temporary(min(chunk, momentum.numel()), torch.float32, momentum.device)
        for seg in self.segments:
            lr = hyper[seg.group]["lr"]
            for a in range(seg.start, seg.end, chunk):
                b = min(a + chunk, seg.end)
                step = torch.mul(momentum[a:b], self.options.beta, out=scratch[:b - a])
                step.addcmul_(send[a:b], scale * lr / loss_scale).sign_().nan_to_num_(0.0).mul_(finite)
                ctx.flat.buffer[a:b].sub_(step, alpha=lr)

    def flush(self) -> None:
        """Overlap: install the update in flight, so the model holds the latest parameters."""
        if self.inflight is not None:
            self.inflight.install()

    def settle(self) -> None:
        """Wait for the round in flight (without installing it): δ and the master are then stable."""
        if self.inflight is not None:
            self.inflight.settle()

    def metrics(self) -> dict:
        r = self.ctx.topology.num_replicas
        return {"payload_bytes": self.codec.payload_bytes,
                "replica_bytes_sent_per_step": (r - 1) * self.codec.payload_bytes}

    # -- state --------------------------------------------------------------------------------

    def master_weights(self) -> torch.Tensor:
        """An all-gather of the master over the shard group, (S−1)/S · P · 4 bytes sent per rank."""
        self.settle()
        return gather_full(self.ctx.checkpoint_comm, self.ctx.flat.layout, self.shard.master)

    def state(self) -> ModeState:
        """The master (every replica holds the same) and this replica's momentum δ, sharded over
        the shard group; ``pending``: the master includes an update that has not reached the model
        yet (the model's weights are saved by DeepSpeed), and with a look-ahead in force each rank
        keeps its model parameters, its own look-ahead point (DeepSpeed saves rank 0's)."""
        pending = None if self.inflight is None else self.inflight.verdict()
        rank = None
        if pending is not None and self.options.lookahead:
            rank = {"lookahead_params": self.ctx.flat.buffer.clone()}
        return ModeState(meta={"step": self.shard.step_count, "pending": pending},
                         sharded={"master": self.shard.master, "momentum": self.shard.momentum}, rank=rank)

    def restore(self, meta: Optional[dict], shards: ShardReader, rank: Optional[dict]) -> None:
        """Saved with this layout: each replica its own δ. At another world size or
        ``shard_group_size``: every replica the average of the saved replicas' δ (error feedback
        residuals of the same momentum; their mean keeps what was not yet sent, on average), and
        a look-ahead point is not carried over (every rank keeps the model weights DeepSpeed
        loaded, rank 0's, until the round in flight is installed). Weights only: momentum and
        step restart from the master."""
        state, topo, layout = self.shard, self.ctx.topology, self.ctx.flat.layout
        if self.inflight is not None:
            self.inflight.drop()
        state.master = shards.shard("master", layout, state.master)
        if meta is None:
            state.step_count = 0
            state.momentum.zero_()
            self.ctx.set_params(shards.full("master", state.master))
            return
        if rank is not None:
            mine = shards.of_replica(topo.rank // topo.shard_group_size)
            state.momentum = mine.shard("momentum", layout, state.momentum)
        else:
            state.momentum = shards.replica_mean("momentum", layout.shard_start, layout.shard_size, state.momentum)
        state.step_count = int(meta["step"])
        pending = meta.get("pending")
        if pending is None:
            return  # the model file's weights are the master's last all-gather
        master = shards.full("master", state.master)
        if self.inflight is None:
            self.ctx.set_params(master)  # saved with overlap, resumed without: installed now
            return
        # Re-create the finished, not yet installed round: the next boundary installs it, so the
        # model keeps the weights DeepSpeed restored (or this rank's look-ahead point) until then.
        self.inflight.restore(self._round(self.send, self.gathered), pending, master)
        point = None if rank is None else rank.get("lookahead_params")
        if point is not None:
            self.ctx.flat.buffer.copy_(point)
