"""lowcomm.pace: a slower rank runs some micro-batches forward only and the gradient is weighted by
what was really computed.

- the plan (``pace_quota``) and the token count (against transformers' own count);
- the CUDA clock never waits for an event (a recording fake: CPU has no CUDA events);
- with rank 1 made to compute only the first micro-batch of each block (zero1: of its four per
  step; acco: of each round's two), AdamW's first moment after a step is (1 - beta1) times the
  mean gradient of the micro-batches computed, from torch alone, weighted by micro-batches or,
  with ``num_items_in_batch``, by label tokens;
- with even ranks pacing changes nothing: losses and weights bit-equal to ``"pace": "slowest"``.
"""
import copy

import pytest
import torch

import workers
from dist import run_ranks

GAS = 4


@pytest.mark.unit
def test_pace_quota():
    from ds_lowcomm.shard.pace import pace_quota

    assert pace_quota(4, 0.0, 0.0, 1.0) == 4  # this rank's pace not measured yet
    assert pace_quota(4, 1.2, 0.4, 1.0) == 4  # under 1.5x slower: everything computed
    assert pace_quota(4, 1.6, 0.1, 1.0) == 3  # over it: planned to 1.25x the fastest's block
    assert pace_quota(4, 3.0, 1.0, 1.0) == 0  # 3x slower: forward only keeps up with the fastest
    assert pace_quota(4, 2.0, 2 / 3, 1.0) == 1  # 1·2 + 3·2/3 = 4 <= 5
    assert pace_quota(4, 2.0, 0.0, 1.0) == 1  # forward assumed a third of the micro-batch
    assert pace_quota(4, 2.0, 2.0, 1.0) == 4  # forward only saves nothing: compute it all


@pytest.mark.unit
def test_token_weight_counts_what_transformers_counts():
    import transformers

    from ds_lowcomm.shard.pace import token_weight

    labels = torch.tensor([[5, 6, -100, 7], [-100, 1, 2, -100]])
    trainer = object.__new__(transformers.Trainer)  # only its counting method, on plain state
    trainer.args = type("A", (), {"average_tokens_across_devices": False, "n_gpu": 1})()
    trainer.model_accepts_loss_kwargs, trainer.compute_loss_func = True, None
    trainer.get_tp_size = trainer.get_cp_size = trainer.get_sp_size = lambda: 1
    for shifts in (True, False):
        trainer._loss_shifts_labels = shifts
        expected = trainer._get_num_items_in_batch([{"labels": labels}], torch.device("cpu"))
        got = token_weight({"labels": labels, "num_items_in_batch": 99}, encoder_decoder=not shifts)
        assert got.item() == expected.item()
    assert token_weight({"labels": labels}, False) is None  # a mean loss per micro-batch: weight 1
    assert token_weight({"labels": labels, "num_items_in_batch": 9, "shift_labels": labels}, False).item() == 5


class _Event:
    """A recording fake of torch.cuda.Event: completes when the test says so."""
    done = False

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = len(_Event.log)
        _Event.log.append(self)

    def query(self):
        return _Event.done

    def elapsed_time(self, end):
        return 1000.0 * (end.t - self.t)  # ms

    def synchronize(self):  # never called: reading a pace must not stall the host
        raise AssertionError("the pacer waited for an event")


@pytest.mark.unit
def test_cuda_clock_reads_events_only_once_completed(monkeypatch):
    from ds_lowcomm.shard.pace import Pacer

    _Event.log, _Event.done = [], False
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    waited = [0.0]
    pacer = Pacer(4, 0, device=torch.device("cuda", 0), host_wait_seconds=lambda: waited[0])
    for i in range(2 + 8):  # (the first two are not timed)
        assert pacer.begin_micro_batch()
        pacer.end_micro_batch()
        if i % 4 == 3:
            pacer.end_block()
    assert pacer.local_paces() == [0.0, 0.0]  # nothing completed: nothing read, nothing waited for
    _Event.done = True
    assert pacer.local_paces() == [1.0, 0.0]  # eight micro-batches of one "second" each, read now


def _forced(rank, world, cfg, tokens, keep):
    """One step of a Trainer-like loop (the boundary set before every backward); rank 1's pacer
    plans ``keep`` of each block's micro-batches, whatever the paces. Returns AdamW's first moment
    after it, (1 - beta1) times the reduced gradient, by parameter name, and the computed shares."""
    from ds_lowcomm.shard.flat import gather_full

    engine = workers.build_engine(cfg)
    pacer = engine.optimizer.pacer
    if rank == 1:
        pacer.quota = keep
        pacer.update = lambda paces: None  # the plan stays forced
    for micro in range(GAS):
        x, labels = _micro_batch(micro, rank)
        kw = {}
        if tokens:  # the step's label tokens over both ranks, as the Trainer passes them (transformers 5)
            kw["num_items_in_batch"] = sum(_tokens(m) for r in range(world) for m in range(GAS))
        engine.set_gradient_accumulation_boundary(micro == GAS - 1)
        loss = engine(x, labels=labels, **kw).loss
        if tokens:
            loss = loss * world  # the Trainer's average_tokens_across_devices
        engine.backward(loss, scale_wrt_gas=not tokens)
        engine.step()
    opt = engine.optimizer
    opt.settle()  # (acco: the step's real round has run)
    full = gather_full(opt.checkpoint_comm, opt.flat.layout, opt.mode.adamw.exp_avg)
    moments = {names[0]: full[opt.flat.offsets[id(p)]: opt.flat.offsets[id(p)] + p.numel()].view_as(p)
               for names, p in zip(opt.param_names, opt.flat.params)}
    return dict(exp_avg=moments, shares=engine.comm_stats()["computed_share_by_rank"])


def _micro_batch(micro, rank):
    x = workers.batch(0, micro, rank, 2)
    labels = x.clone()
    labels[:, : 4 + micro] = -100  # micro-batches of different token counts
    return x, labels


def _tokens(micro):
    return 2 * (32 - 1 - (4 + micro - 1))  # labels[..., 1:] not -100, over the 2 rows


def _reference_gradient(tokens, keep, block, world=2):
    """Single process, torch alone, in float64: the mean gradient of the micro-batches computed
    (rank 0's four and rank 1's first ``keep`` of each ``block``), by micro-batch or by label token."""
    model = workers.tiny_gpt2(0).double()
    computed = [(r, m) for r in range(world) for m in range(GAS) if r == 0 or m % block < keep]
    total = sum(_tokens(m) for _, m in computed) if tokens else len(computed)
    for r, m in computed:
        x, labels = _micro_batch(m, r)
        (model(x, labels=labels).loss * (_tokens(m) if tokens else 1) / total).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["zero1", "acco"])
@pytest.mark.parametrize("tokens", [False, True], ids=["by-micro-batch", "by-token"])
def test_the_gradient_is_weighted_by_what_was_computed(mode, tokens):
    # acco: the step's first micro-batches are computed on the weights the second half is too
    # (the estimate is installed after the real round is launched), so the same reference holds.
    keep, block = 1, GAS if mode == "zero1" else GAS // 2
    cfg = workers.config(mode)
    cfg["gradient_accumulation_steps"] = GAS
    cfg["gradient_clipping"] = 0.0
    r0, r1 = run_ranks(_forced, 2, cfg, tokens, keep, timeout=300)
    reference = _reference_gradient(tokens, keep, block)
    assert r0["exp_avg"].keys() == r1["exp_avg"].keys() and set(r0["exp_avg"]) <= set(reference)
    for name, moment in r0["exp_avg"].items():
        assert torch.equal(moment, r1["exp_avg"][name])
        expected = 0.1 * reference[name]  # beta1 0.9
        # fp32 sums in another order than the float64 reference: rounding of the order of 1e-7 of
        # the tensor's largest entry (a wrong weighting is off by several percent of every entry)
        torch.testing.assert_close(moment.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    kept = [m for m in range(GAS) if m % block < keep]
    share = sum(map(_tokens, kept)) / sum(map(_tokens, range(GAS))) if tokens else len(kept) / GAS
    if mode == "zero1":  # (acco's are recorded when the round is installed, during the next step)
        assert r0["shares"] == [1.0, share]


def _even(rank, world, cfg):
    """Trainer-like loop with even ranks: the losses of every micro-batch and the final weights.
    (A model big enough that a micro-batch takes tens of milliseconds: the pace of a smaller one is
    the scheduler's jitter, as on no real accelerator.)"""
    engine = workers.build_engine(cfg, model=workers.tiny_gpt2(0, n_layer=2, n_embd=256))
    losses = []
    for step in range(8):
        for micro in range(GAS):
            x = workers.batch(step, micro, rank, 4)
            engine.set_gradient_accumulation_boundary(micro == GAS - 1)
            loss = engine(x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return dict(losses=losses, digest=workers.params_digest(engine),
                shares=engine.comm_stats().get("computed_share_by_rank"))


@pytest.mark.integration
def test_even_ranks_train_as_without_pacing():
    cfg = workers.config("zero1")
    cfg["gradient_accumulation_steps"] = GAS
    slowest = copy.deepcopy(cfg)
    slowest["lowcomm"]["pace"] = "slowest"  # every micro-batch computed, the scale 1/W: as before pacing
    paced = run_ranks(_even, 2, cfg, timeout=300)
    plain = run_ranks(_even, 2, slowest, timeout=300)
    assert paced[0]["shares"] == [1.0, 1.0] and plain[0]["shares"] is None
    for a, b in zip(paced, plain):
        assert a["losses"] == b["losses"]  # bit for bit, every micro-batch
        assert a["digest"] == b["digest"]
