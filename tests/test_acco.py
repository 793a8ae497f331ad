"""ACCO against a single-process simulation of its schedule; estimate without trace (exact resume: test_resume.py)."""
import copy
import time

import pytest
import torch

import workers
from dist import run_ranks

GAS = 4
STEPS = 10


def acco_config(variant="acco", wait=False, gas=GAS, balance=None, estimate_dtype="fp32",
                real_gather_dtype="fp32"):
    options = {"variant": variant, "accumulate_while_waiting": wait}
    if balance is not None:  # (balance: true without waiting is refused)
        options["balance"] = balance
    if variant == "acco" and estimate_dtype is not None:  # None: the default
        options["estimate_dtype"] = estimate_dtype
    if real_gather_dtype is not None:  # None: the default
        options["real_gather_dtype"] = real_gather_dtype
    cfg = workers.config("acco", acco=options)
    cfg["gradient_accumulation_steps"] = gas
    return cfg


def _train_acco(rank, world, variant, wait, slow_rank, step_every, balance, estimate_dtype, real_gather_dtype):
    engine = workers.build_engine(acco_config(variant, wait, balance=balance, estimate_dtype=estimate_dtype,
                                              real_gather_dtype=real_gather_dtype))
    j = 0
    while engine.global_steps < STEPS:
        x = workers.batch(j, 0, rank)  # this rank's j-th micro-batch
        t0 = time.perf_counter()
        engine.backward(engine(x, labels=x).loss)
        if (j + 1) % step_every == 0:  # HF/accelerate call engine.step() only at their boundaries
            engine.step()
        j += 1
        if rank == slow_rank:
            time.sleep(3 * (time.perf_counter() - t0) + 0.01)
    opt = engine.optimizer
    opt.settle()  # the last round has run
    ops = engine.comm_stats()["ops"]  # the rounds' collectives (before master_weights gathers)
    live = opt.flat.unpadded(opt.flat.buffer).clone()
    master = opt.master_weights()
    # What installing the pending round gives: its result, or the model plus its change.
    rnd, n = opt.mode.inflight.round, live.numel()
    pending = live + rnd.delta[:n].float() if rnd.delta is not None else opt.mode.gathered[:n].clone()
    opt.flush()  # the model now holds the latest real update, whatever was in flight
    flushed = torch.equal(opt.flat.unpadded(opt.flat.buffer), master)
    opt.mode.inflight.install()  # the round stayed pending: a change is re-taken from the master
    installed = opt.flat.unpadded(opt.flat.buffer).clone()
    return dict(blocks=list(opt.mode.block_sizes), counts=list(opt.mode.round_counts),
                master=master, live=live, micro_batches=j, steps=opt.steps, flushed=flushed,
                pending=pending, installed=installed, padded=opt.flat.layout.padded, ops=ops)


def simulate(blocks, variant, cfg, estimate_dtype="fp32", real_gather_dtype="fp32"):
    """ACCO / DPU from the paper's equations: W simulated workers, one model, torch.optim.AdamW.

    ``blocks[i][b]``: micro-batches worker i computed between switch b-1 and switch b. With
    ``estimate_dtype`` bf16 the estimate takes each worker's gradient sum rounded to bf16, and the
    model gets its parameters plus the estimate's change from them rounded to bf16; with
    ``real_gather_dtype`` bf16 the same for the real round's result (its gradient exact).
    """
    torch.set_num_threads(1)
    world = len(blocks)
    hp = cfg["optimizer"]["params"]
    clip = cfg["gradient_clipping"]
    model = workers.tiny_gpt2(0)
    params = [p for p in model.parameters()]
    live = torch.nn.utils.parameters_to_vector(params).detach().clone()
    master = torch.nn.Parameter(live.clone())
    opt = torch.optim.AdamW([master], lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"])
    accum = [torch.zeros_like(live) for _ in range(world)]
    counts = [0] * world
    seen = [0] * world
    pending, estimate = None, variant == "acco"
    for b in range(len(blocks[0])):
        for i in range(world):  # compute on the parameters installed at the previous switch
            for _ in range(blocks[i][b]):
                torch.nn.utils.vector_to_parameters(live, params)
                model.zero_grad()
                x = workers.batch(seen[i], 0, i)
                (model(x, labels=x).loss / GAS).backward()
                accum[i] += torch.cat([p.grad.flatten() for p in params])
                counts[i] += 1
                seen[i] += 1
        finished_estimate = None
        if pending is not None:
            live, finished_estimate = pending
        cheap = estimate and estimate_dtype == "bf16"
        g = sum(a.bfloat16().float() if cheap else a for a in accum) * (GAS / sum(counts))
        factor = (g.double().norm().item() + 1e-6) / clip
        if factor > 1:
            g = g * (1.0 / factor)
        if estimate:  # θ̃ = Opt(θ, S; g) on a copy: the real state is untouched
            shadow = copy.deepcopy(opt)
            shadow.param_groups[0]["params"][0].grad = g
            shadow.step()
            result = shadow.param_groups[0]["params"][0].detach().clone()
            if cheap:
                result = live + (result - live).bfloat16().float()
        else:
            master.grad = g
            opt.step()
            result = master.detach().clone()
            if real_gather_dtype == "bf16":
                result = live + (result - live).bfloat16().float()
        pending = (result, estimate)
        if variant == "dpu" or finished_estimate:
            accum = [torch.zeros_like(live) for _ in range(world)]
            counts = [0] * world
        estimate = variant == "acco" and not estimate
    return master.detach(), live


@pytest.mark.parametrize("variant,wait,slow_rank,step_every,balance,estimate_dtype,real_gather_dtype", [
    # the paper's rounds (both in fp32): the nominal schedule, GAS/2 micro-batches per round on
    # every rank
    ("acco", False, None, 1, None, "fp32", "fp32"),
    ("acco", False, None, GAS, None, "fp32", "fp32"),  # the same, engine.step() only every GAS micro-batches (HF loop)
    # uneven: rank 1 is 4x slower, rank 0 keeps computing while it waits; balanced, rank 1
    # launches its rounds after one micro-batch once the paces are known, so rank 0 sets the pace
    ("acco", True, 1, 1, True, "fp32", "fp32"),
    ("acco", True, 1, 1, False, "fp32", "fp32"),  # unbalanced: rank 1 computes GAS/2 per round, rank 0 waits on it
    ("acco", False, None, 1, None, "bf16", "fp32"),  # the estimate round in bf16, half its bytes
    ("acco", False, None, 1, None, "bf16", "bf16"),  # and the real round's all-gather a bf16 change
    ("dpu", False, None, 1, None, None, "fp32"),
    ("dpu", False, None, 1, None, None, "bf16"),
], ids=["acco", "acco-hf-loop", "acco-uneven", "acco-uneven-unbalanced", "acco-bf16-estimate",
        "acco-bf16-gathers", "dpu", "dpu-bf16-gather"])
@pytest.mark.integration
def test_matches_simulation(variant, wait, slow_rank, step_every, balance, estimate_dtype, real_gather_dtype):
    r = run_ranks(_train_acco, 2, variant, wait, slow_rank, step_every, balance, estimate_dtype,
                  real_gather_dtype)
    blocks = [x["blocks"] for x in r]
    assert r[0]["steps"] == STEPS and len(blocks[0]) == len(blocks[1])
    if slow_rank is None:
        assert all(b == (GAS // 2 if variant == "acco" else GAS) for b in blocks[0] + blocks[1])
    else:
        # The fast rank contributed more micro-batches than the slow one.
        assert r[0]["micro_batches"] > r[1]["micro_batches"], (r[0]["counts"], r[1]["counts"])
        slow_blocks = blocks[slow_rank]
        if balance:
            # The first rounds go before any pace is known (GAS/2 each); from the fourth round
            # on rank 1 knows it is ~4x slower and stops at one micro-batch.
            assert slow_blocks[:2] == [GAS // 2] * 2 and set(slow_blocks[4:]) == {1}, slow_blocks
        else:
            assert min(slow_blocks) >= GAS // 2, slow_blocks
    assert torch.equal(r[0]["master"], r[1]["master"]) and torch.equal(r[0]["live"], r[1]["live"])
    assert r[0]["flushed"] and r[1]["flushed"]
    estimate_dtype = estimate_dtype or "fp32"  # (dpu has no estimate round)
    # Bytes sent per rank (W = 2: (W-1)/W = 1/2 of the padded buffer): a real round
    # reduce-scatters in fp32 and all-gathers in fp32 or, as a change, bf16; an estimate round
    # both in fp32 or both in bf16.
    real, estimates = STEPS, len(r[0]["counts"]) - STEPS
    est = 2 if estimate_dtype == "bf16" else 4
    for op, elem in (("reduce_scatter", 4), ("all_gather", 2 if real_gather_dtype == "bf16" else 4)):
        sent = sum(v["bytes_sent"] for k, v in r[0]["ops"].items() if k.endswith(op))
        assert sent == r[0]["padded"] / 2 * (elem * real + est * estimates), op
    master, live = simulate(blocks, variant, acco_config(variant, wait), estimate_dtype, real_gather_dtype)
    torch.testing.assert_close(r[0]["master"], master, rtol=1e-5, atol=1e-5)
    # A bf16 change rounds to 2^-9 of itself (about 1e-5 of a 3e-3 step): one rounding that
    # falls the other way between the fused AdamW and torch's moves the model by that much.
    # (Copying the change instead of adding it would be off by the weights themselves.)
    rounded = "bf16" in (estimate_dtype, real_gather_dtype)
    torch.testing.assert_close(r[0]["live"], live, rtol=1e-5, atol=4e-5 if rounded else 1e-5)
    # The flush left the round pending: its install gives what it would have given (a change
    # re-taken from the master, rounded once more), not the master plus the old change.
    torch.testing.assert_close(r[0]["installed"], r[0]["pending"], rtol=0, atol=1e-5 if rounded else 0)
    # A step counts when its real round is launched: the loop stopped at step STEPS with that
    # round in flight (the model holding the estimate under acco, θ(STEPS−1) under DPU), and the
    # master includes it once settled.
    assert not torch.equal(r[0]["live"], r[0]["master"])


def _monitored(rank, world, monitor_dir):
    cfg = acco_config()
    cfg["csv_monitor"] = {"enabled": True, "output_path": monitor_dir, "job_name": "acco"}
    engine = workers.build_engine(cfg)
    workers.train(engine, 3, rank=rank)
    return engine.global_steps


@pytest.mark.integration
def test_metrics_reach_deepspeeds_monitor(tmp_path):
    """Per-step metrics reach DeepSpeed's monitor (here its CSV writer). (That
    an estimate round leaves AdamW's state untouched: tests/test_modes.py.)"""
    steps = run_ranks(_monitored, 2, str(tmp_path))
    logged = {p.name: p.read_text().splitlines() for p in tmp_path.rglob("*.csv")}
    sent = next(v for k, v in logged.items() if "bytes_sent_per_step" in k)
    assert steps[0] == 3 and len(sent) >= 3 and float(sent[-1].split(",")[1]) > 0
    assert any("micro_batches_per_round" in k for k in logged)


@pytest.mark.parametrize("per_round,paces,quotas", [
    (2, [0.1, 0.3], [2, 1]),                 # 3x slower: 2/3 rounds to 1
    (4, [0.1, 0.2, 0.12, 0.5], [4, 2, 3, 1]),  # 4/2 = 2, 4/1.2 = 3.33 -> 3, 4/5 -> at least 1
    (4, [0.1, 0.11], [4, 4]),                # 10% slower: 3.64 rounds to 4 (noise changes nothing)
    (2, [0.2, 0.2], [2, 2]),
])
@pytest.mark.unit
def test_balanced_quota(per_round, paces, quotas):
    from ds_lowcomm.modes.acco import balanced_quota

    assert [balanced_quota(per_round, paces, r) for r in range(len(paces))] == quotas


def _bf16_model(rank, world, estimate_dtype):
    cfg = acco_config(estimate_dtype=estimate_dtype)
    cfg["bf16"] = {"enabled": True}
    engine = workers.build_engine(cfg)
    losses = workers.micro_batches(engine, 0, 3 * GAS, rank)
    engine.optimizer.settle()
    return losses, workers.params_digest(engine)


@pytest.mark.integration
def test_bf16_model_sends_the_estimate_like_the_paper():
    """A bf16 model's rounds already travel in 2 bytes: the default estimate_dtype leaves its
    training bit-identical to estimate_dtype fp32 (adding a bf16 change to bf16 weights could
    lose it)."""
    default = run_ranks(_bf16_model, 2, None)
    paper = run_ranks(_bf16_model, 2, "fp32")
    assert default == paper
