"""The mode tier: each mode built from a real ModeContext around a small torch model on real gloo
ranks (no DeepSpeed, no Hugging Face), against references written here from the papers'
equations with ``torch.optim.AdamW`` and a DCT from its formula; no library code in a reference.

Each rank trains the same model on its own data: micro-batch ``m`` of step ``t`` on rank ``r`` is
``_data(r, t, m)``; the loss of a micro-batch is divided by the accumulation steps, as DeepSpeed's
engine scales it.
"""
import math

import pytest
import torch

from dist import run_ranks

pytestmark = pytest.mark.ranks

GAS, STEPS = 2, 6
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model():
    torch.manual_seed(0)
    # 6·10 + 10 + 10·3 + 3 = 103 elements: shards end inside matrices and between them
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _data(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y) / GAS


def _train(rank, world, lowcomm, clip=0.0, record="params", hold_worker_until=None, cross_at=None,
           n_steps=STEPS):
    """``n_steps`` steps of the mode from ``lowcomm`` (a "lowcomm" JSON section) through a ModeContext
    built here as the optimizer builds it; returns, flat, after each step, the model's parameters
    (after a flush) or, ``record="master"``, the mode's fp32 master (acco: a flush would move the
    model off the estimate the next micro-batch is computed at; desloc's streamed syncs: a flush
    applies the sync in flight) or ``"local"``, desloc's master shard with ``shard_group_size`` 1
    (reading it waits for nothing); with the parameters, desloc's first moment after the flush
    (``"moments"``). ``hold_worker_until`` t: the replica collectives the comm worker runs wait
    until step t has ended on the training thread (``"held_too_long"``: they gave up
    after 20 s, so the training thread was waiting for them). ``cross_at`` t: in step t, a
    replica collective of the training thread and one of the worker are issued in opposite orders
    on ranks 0 and 1 if both are allowed to run at once (each waits up to 3 s for the other)."""
    import threading

    import workers
    from ds_lowcomm.modes import MODES
    from ds_lowcomm.modes.desloc import Desloc

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    model = _model()
    cfg, ctx, steps = workers.mode_context(lowcomm, model, GAS, HP, clip=clip)
    flat, grads, topo, worker, stats = ctx.flat, ctx.grads, ctx.topology, ctx.worker, ctx.stats
    mode_cls = MODES[cfg.mode]
    released, held_too_long = threading.Event(), []
    step_now_index = [0]
    if cross_at is not None:
        main_in, worker_in = threading.Event(), threading.Event()

        def crossed(t, _call=topo.replica.all_reduce):
            on_worker = threading.current_thread() is not threading.main_thread()
            if on_worker and rank == 0:
                main_in.wait(timeout=3)
            if not on_worker and step_now_index[0] == cross_at:
                if rank == 0:  # this rank's worker goes after it
                    try:
                        return _call(t)
                    finally:
                        main_in.set()
                worker_in.wait(timeout=3)  # this rank's main thread goes after its worker
            if on_worker:
                worker_in.set()
            return _call(t)
        topo.replica.all_reduce = crossed
    if hold_worker_until is not None:
        for name in ("all_reduce", "all_gather"):
            def held(*args, _call=getattr(topo.replica, name)):
                if threading.current_thread() is not threading.main_thread():
                    held_too_long.append(not released.wait(timeout=20))
                return _call(*args)
            setattr(topo.replica, name, held)
    mode = mode_cls(ctx, cfg.mode_options)
    mode.bind_loop(False)
    after, moments = [], []
    for t in range(n_steps):
        step_now_index[0] = t
        grads.attach()
        for m in range(GAS):
            boundary = m == GAS - 1
            mode.on_backward_start(boundary)
            _loss(model, *_data(rank, t, m)).backward()
            grads.count(True, 1.0)
            mode.on_micro_batch_end(boundary)
        mode.step()
        if t == hold_worker_until:
            released.set()
        if record == "local":  # desloc's master with one rank per replica, read without waiting
            after.append(mode.adamw.master[:flat.layout.numel].clone())
        elif record == "master":
            after.append(mode.master_weights())
        else:
            mode.flush()
            after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
            if isinstance(mode, Desloc):
                moments.append(mode.adamw.exp_avg.clone())
    if worker is not None:
        worker.close()
    torch.distributed.destroy_process_group()
    return {"after": after, "moments": moments, "steps": steps[0], "bytes": stats.as_dict()["ops"],
            "held_too_long": held_too_long}


def _grad(model, rank, t):
    """This rank's accumulated gradient of step ``t`` (the sum over its micro-batches)."""
    model.zero_grad(set_to_none=True)
    for m in range(GAS):
        _loss(model, *_data(rank, t, m)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _replica_steps(models, opts, t, ranks_per_replica=1):
    """Step ``t`` of every replica: replica r's optimizer step on the mean of the step's gradients
    of its ranks (r·S … r·S + S − 1, S = ``ranks_per_replica``)."""
    for r, (model, opt) in enumerate(zip(models, opts)):
        ranks = range(r * ranks_per_replica, (r + 1) * ranks_per_replica)
        per_rank = [_grad(model, rank, t - 1) for rank in ranks]
        for p, *gs in zip(model.parameters(), *per_rank):
            p.grad = sum(gs) / ranks_per_replica
        opt.step()


def _micro_grad(model, rank, t, m):
    """The gradient of micro-batch ``m`` of step ``t`` on ``rank`` at ``model``'s parameters."""
    model.zero_grad(set_to_none=True)
    _loss(model, *_data(rank, t, m)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_zero1_is_adamw_on_the_mean_gradient():
    """ZeRO-1 sharded over 2 ranks: AdamW on the gradient averaged over ranks, clipped to its
    global norm by DeepSpeed's rule (scale (norm + 1e-6) / clip when above 1), step by step. The
    clipping is what makes the mean's scale visible (AdamW alone hardly sees it)."""
    clip = 0.9  # between the steps' norms (0.6 to 1.2): some steps clipped, some not
    results = run_ranks(_train, 2, {"mode": "zero1"}, clip)
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    clipped = []
    for t in range(STEPS):
        per_rank = [_grad(ref, r, t) for r in range(2)]
        for p, g0, g1 in zip(ref.parameters(), *per_rank):
            p.grad = (g0 + g1) * 0.5
        norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in ref.parameters()))
        factor = (norm + 1e-6) / clip
        clipped.append(factor > 1)
        if factor > 1:
            for p in ref.parameters():
                p.grad.mul_(1.0 / factor)
        opt.step()
        for res in results:
            torch.testing.assert_close(res["after"][t], _flat(ref), rtol=1e-6, atol=1e-7)
    assert any(clipped) and not all(clipped), clipped  # both branches taken
    assert all(res["steps"] == STEPS for res in results)


def test_acco_is_adamw_with_an_estimate_step():
    """ACCO (Nabli et al., Algorithm 1) with GAS 2 on 2 ranks, waiting for each round: the first
    micro-batch of step t is computed at the estimate θ̃(t), AdamW from θ(t−1) and its state on the
    first half's gradient with the state left as it was; the second at θ(t); the real step is
    AdamW on the mean of all four micro-batches' gradients."""
    import copy

    results = run_ranks(_train, 2, {"mode": "acco", "acco": {"accumulate_while_waiting": False,
                                                             "estimate_dtype": "fp32", "real_gather_dtype": "fp32"}},
                        0.0, "master")
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    estimate = copy.deepcopy(ref)  # θ̃(0) = θ(0)
    for t in range(STEPS):
        first = [_micro_grad(estimate, r, t, 0) for r in range(2)]
        second = [_micro_grad(ref, r, t, 1) for r in range(2)]
        # the estimate: one AdamW step from θ(t) on the first half (the sum over ranks of the
        # losses / GAS: their mean per micro-batch), on a copy of the state
        estimate = copy.deepcopy(ref)
        ahead = torch.optim.AdamW(estimate.parameters(), **HP)
        ahead.load_state_dict(copy.deepcopy(opt.state_dict()))
        for p, a, b in zip(estimate.parameters(), *first):
            p.grad = a + b
        ahead.step()
        for p, a, b, c, d in zip(ref.parameters(), *first, *second):
            p.grad = (a + b + c + d) * 0.5
        opt.step()
        for res in results:
            torch.testing.assert_close(res["after"][t], _flat(ref), rtol=1e-6, atol=1e-7)
    assert not torch.equal(_flat(estimate), _flat(ref))  # the estimate is a real step ahead


def _desloc_reference(kx, ku, kv, outer_lr=1.0, outer_momentum=0.0, delay=0, steps=STEPS, ranks_per_replica=1):
    """Two replicas, each AdamW on its own ranks' data (``ranks_per_replica`` consecutive ranks: the
    mean of their gradients, as ZeRO-1 inside a replica takes it); after step t's update the parameters are
    averaged when Kx divides t (DiLoCo's outer Nesterov on the average when configured), the first
    moment when Ku does, the second when Kv does (DES-LOC, arXiv 2505.22549, Algorithm 1).
    Streamed (``delay`` D > 0): the parameter sync launched after step t is applied after step
    t + D's update, θ_r ← x̄ + (θ_r − s_r), s_r the parameters at t, x̄ their mean (or the anchor
    after the outer step); a moment due at t as well goes with it, its mean m̄ of the moments at t
    applied then as m_r ← m_r + β^D·(m̄ − m_r,t): m_r is an EMA of decay β (β1 for the first
    moment, β2 for the second), so this is the moment it would hold had it restarted from m̄ at t.
    A moment averaged again before then takes no correction (the mean of the corrected moments is
    the mean of the uncorrected ones)."""
    models = [_model(), _model()]
    opts = [torch.optim.AdamW(m.parameters(), **HP) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    buf = [torch.zeros_like(a) for a in anchor]
    decay = {"exp_avg": HP["betas"][0], "exp_avg_sq": HP["betas"][1]}
    pending = None  # (step it is applied at, [s_0, s_1], x̄, {moment: ([m_0,t, m_1,t], m̄)})
    out = []
    for t in range(1, steps + 1):
        _replica_steps(models, opts, t, ranks_per_replica)
        pairs = list(zip(models[0].parameters(), models[1].parameters()))
        if pending is not None and pending[0] == t:
            with torch.no_grad():
                for r, model in enumerate(models):
                    for p, s, x in zip(model.parameters(), pending[1][r], pending[2]):
                        p.add_(x - s)
            for key, (launched, means) in pending[3].items():
                for r, opt in enumerate(opts):
                    for i, p in enumerate(pairs):
                        opt.state[p[r]][key] += decay[key] ** delay * (means[i] - launched[r][i])
            pending = None
        launch = delay and t % kx == 0
        due = [key for key, every in (("exp_avg_sq", kv), ("exp_avg", ku)) if t % every == 0]
        streamed = {}
        for key in due:
            moments = [[opts[r].state[p[r]][key].clone() for p in pairs] for r in range(2)]
            means = [(a + b) * 0.5 for a, b in zip(*moments)]
            if launch:
                streamed[key] = (moments, means)
                continue
            if pending is not None:  # averaged now: the replicas' mean needs no correction later
                pending[3].pop(key, None)
            for r in range(2):
                for p, avg in zip(pairs, means):
                    opts[r].state[p[r]][key] = avg.clone()
        if t % kx == 0:
            launched = [[p.detach().clone() for p in m.parameters()] for m in models]
            result = []
            for i, (a, b) in enumerate(zip(*launched)):
                avg = (a + b) * 0.5
                if outer_lr != 1.0 or outer_momentum != 0.0:
                    delta = anchor[i] - avg  # the outer pseudo-gradient
                    buf[i] = outer_momentum * buf[i] + delta
                    anchor[i] = anchor[i] - outer_lr * (delta + outer_momentum * buf[i])  # Nesterov
                    avg = anchor[i]
                result.append(avg)
            if delay:
                pending = (t + delay, launched, result, streamed)
            else:
                with torch.no_grad():
                    for model in models:
                        for p, x in zip(model.parameters(), result):
                            p.copy_(x)
        out.append([_flat(m) for m in models])
    return out


@pytest.mark.parametrize("outer", [{}, {"outer_lr": 0.7, "outer_momentum": 0.9}], ids=["average", "nesterov"])
def test_desloc_is_local_adamw_with_its_averages(outer):
    """Each rank its own replica (shard_group_size 1); parameters, first and second moments
    averaged on their own periods (2, 3, 4: every combination meets within 6 steps)."""
    periods = dict(param_sync_every=2, momentum_sync_every=3, variance_sync_every=4)
    results = run_ranks(_train, 2, {"mode": "desloc", "shard_group_size": 1, "desloc": {**periods, **outer}})
    ref = _desloc_reference(2, 3, 4, **outer)
    for t in range(STEPS):
        for r, res in enumerate(results):
            torch.testing.assert_close(res["after"][t], ref[t][r], rtol=1e-6, atol=1e-7)
    assert torch.equal(results[0]["after"][1], results[1]["after"][1])  # synced at step 2
    assert not torch.equal(results[0]["after"][2], results[1]["after"][2])  # apart at step 3
    # replica bytes: the 103 fp32 elements padded to 112 (whole blocks of 16) per all-reduce,
    # 2·(R−1)/R of them per call; the syncs of 6 steps: θ at 2, 4, 6, m at 3, 6, v at 4
    ops = results[0]["bytes"]["replica.all_reduce"]
    assert ops["calls"] == 6 and ops["bytes_sent"] == 6 * 112 * 4


@pytest.mark.parametrize("kx, ku, delay, steps, outer", [
    (2, 3, 1, STEPS, {}), (3, 3, 2, STEPS, {}), (4, 2, 3, 8, {}),
    (2, 3, 1, STEPS, {"outer_lr": 0.7, "outer_momentum": 0.9})],
    ids=["average", "average-2-late", "moment-due-in-flight", "nesterov"])
def test_desloc_streamed_syncs_apply_late_with_the_local_progress(kx, ku, delay, steps, outer):
    """param_sync_delay D: each parameter sync's all-reduce runs on the comm worker during the next
    D steps and is applied after the last of them, their own progress kept on top of the average;
    the moments due at its launch go with it (Kx 4, Ku 2, D 3: the first moment launched at step 4
    is averaged again at step 6, on the training thread, before the sync is applied at step 7).
    (The master is recorded: a flush would apply the sync in flight at once.)"""
    periods = dict(param_sync_every=kx, momentum_sync_every=ku, variance_sync_every=4, param_sync_delay=delay)
    results = run_ranks(_train, 2, {"mode": "desloc", "shard_group_size": 1, "desloc": {**periods, **outer}},
                        0.0, "master", None, None, steps)
    ref = _desloc_reference(kx, ku, 4, **outer, delay=delay, steps=steps)
    for t in range(steps):
        for r, res in enumerate(results):
            torch.testing.assert_close(res["after"][t], ref[t][r], rtol=1e-6, atol=1e-7)
    # the synchronous sync would have made the replicas equal after step Kx; streamed they differ
    # by their own steps since
    assert not torch.equal(results[0]["after"][kx - 1], results[1]["after"][kx - 1])
    ops = results[0]["bytes"]["replica.all_reduce"]  # the same syncs as synchronous
    syncs = steps // kx + steps // ku + steps // 4
    assert ops["calls"] == syncs and ops["bytes_sent"] == syncs * 112 * 4


@pytest.mark.parametrize("outer", [{}, {"outer_lr": 0.7, "outer_momentum": 0.9}], ids=["average", "nesterov"])
def test_desloc_streamed_syncs_with_two_ranks_per_replica(outer):
    """Streamed syncs where each replica is a shard group of 2 ranks (4 ranks, shard_group_size 2):
    each rank streams its own shard over its replica group; the result is the two-replica
    equations on the mean gradient of each replica's ranks (Kx 4, Ku 2, D 3: a moment averaged
    again while the sync is in flight, as in the single-rank case)."""
    periods = dict(param_sync_every=4, momentum_sync_every=2, variance_sync_every=4, param_sync_delay=3)
    results = run_ranks(_train, 4, {"mode": "desloc", "shard_group_size": 2, "desloc": {**periods, **outer}},
                        0.0, "master", None, None, 8)
    ref = _desloc_reference(4, 2, 4, **outer, delay=3, steps=8, ranks_per_replica=2)
    for t in range(8):
        for rank, res in enumerate(results):
            torch.testing.assert_close(res["after"][t], ref[t][rank // 2], rtol=1e-6, atol=1e-7)
    # each rank all-reduces its own shard: the 103 elements padded to 2 shards of whole blocks of
    # 16, 64 each, 2·(R−1)/R of them per call, R = 2
    ops = results[0]["bytes"]["replica.all_reduce"]
    syncs = 8 // 4 + 8 // 2 + 8 // 4
    assert ops["calls"] == syncs and ops["bytes_sent"] == syncs * 64 * 4


def test_desloc_flush_applies_the_streamed_sync_in_flight():
    """A flush (before an export) applies the sync in flight at once: flushed after every step,
    a streamed run is the synchronous one, θ ← x̄ + (θ_t − θ_t), and right after a sync the
    replicas agree bit for bit (x̄ itself, not x̄ + θ_t − θ_t rounded), the moments launched
    with it too (Ku 2: every sync carries the first moment)."""
    periods = dict(param_sync_every=2, momentum_sync_every=2, variance_sync_every=4)
    results = run_ranks(_train, 2, {"mode": "desloc", "shard_group_size": 1,
                                    "desloc": {**periods, "param_sync_delay": 1}}, 0.0, "params")
    ref = _desloc_reference(2, 2, 4)
    for t in range(STEPS):
        for r, res in enumerate(results):
            torch.testing.assert_close(res["after"][t], ref[t][r], rtol=1e-6, atol=1e-7)
    for t in range(STEPS):
        for key in ("after", "moments"):
            assert torch.equal(results[0][key][t], results[1][key][t]) is ((t + 1) % 2 == 0), (key, t)


def test_desloc_streamed_sync_runs_while_the_steps_compute():
    """A sync launched after step 3 with D = 2: its all-reduce on the comm worker is held until step
    4 has ended on the training thread. Step 4 must not wait for it (it would, were the local
    steps queued on the same worker: then the hold gives up after 20 s); step 5 applies it."""
    sync = dict(param_sync_every=3, momentum_sync_every=0, variance_sync_every=0, param_sync_delay=2)
    results = run_ranks(_train, 2, {"mode": "desloc", "shard_group_size": 1, "desloc": sync}, 0.0, "local", 3)
    ref = _desloc_reference(3, 1 << 20, 1 << 20, delay=2)
    for r, res in enumerate(results):
        assert res["held_too_long"] == [False, False]  # the syncs of steps 3 and 6, each held
        for t in range(STEPS):
            torch.testing.assert_close(res["after"][t], ref[t][r], rtol=1e-6, atol=1e-7)


def test_desloc_streamed_sync_and_a_moment_sync_never_cross():
    """A sync launched after step 3 with D = 2 is still in flight when step 4 averages the second
    moment on the same replica group. Were both collectives allowed at once, rank 0 would issue
    the moment's first and rank 1 the sync's (``cross_at``), averaging v with θ; the moment's
    waits for the sync instead, and both follow the equations."""
    sync = dict(param_sync_every=3, momentum_sync_every=0, variance_sync_every=4, param_sync_delay=2)
    results = run_ranks(_train, 2, {"mode": "desloc", "shard_group_size": 1, "desloc": sync}, 0.0, "local", None, 3)
    ref = _desloc_reference(3, 1 << 20, 4, delay=2)
    for t in range(STEPS):
        for r, res in enumerate(results):
            torch.testing.assert_close(res["after"][t], ref[t][r], rtol=1e-6, atol=1e-7)


def _sent(u, chunk, topk, values):
    """What a replica sends of ``u`` (SparseLoCo, arXiv 2508.15706): each chunk's ``topk`` largest
    |u| rounded to bf16, or to int8 levels of the chunk's largest picked |u|, or to int2: per 16
    chunks, t = the mean picked |u|, each picked u sent as its sign times the mean of the picked |u|
    on its side of t (≥ t or below); returns that as a dense ``[chunks, chunk]`` tensor (zeros
    elsewhere) and the picked indices."""
    rows = u.view(-1, chunk)
    idx = rows.abs().topk(topk, dim=1).indices
    picked = rows.gather(1, idx)
    if values == "bf16":
        v = picked.to(torch.bfloat16).float()
    elif values == "int2":
        v = torch.empty_like(picked)
        for g in range(0, picked.shape[0], 16):
            group = picked[g:g + 16].double()
            t = group.abs().mean()
            high = group.abs() >= t
            hi = group.abs()[high].mean()
            lo = group.abs()[~high].mean() if (~high).any() else t
            sign = torch.where(group < 0, -1.0, 1.0).double()
            v[g:g + 16] = (sign * torch.where(high, hi, lo)).float()
    else:
        scale = picked.abs().amax(dim=1, keepdim=True)
        v = (picked / scale * 127).round().clamp(-127, 127) * (scale / 127)
    return torch.zeros_like(rows).scatter(1, idx, v), idx


def _desloc_compressed_reference(kx, topk, chunk, values="bf16", outer_lr=1.0, outer_momentum=0.0, delay=0):
    """Two replicas, each AdamW on its own data; every Kx steps a compressed parameter sync
    (SparseLoCo, arXiv 2508.15706, on DES-LOC's parameter average): u_r = e_r + (anchor − θ_r) over
    the flat parameters padded to 112; each chunk's ``topk`` largest |u_r| rounded to bf16 (or to
    int8 levels of the chunk's largest picked |u_r|); e_r = u_r − what was sent; the anchor moves
    by the mean of what was sent (or the outer Nesterov step on it) and every θ_r becomes it;
    streamed (``delay`` D > 0), θ_r ← anchor + (θ_r − s_r) after step t + D's update instead, s_r
    the parameters at the sync. Moments never averaged."""
    models = [_model(), _model()]
    opts = [torch.optim.AdamW(m.parameters(), **HP) for m in models]
    pad = lambda v: torch.cat([v, v.new_zeros(112 - v.numel())])  # noqa: E731
    anchor = pad(_flat(models[0]))
    buf = torch.zeros(112)
    errors = [torch.zeros(112), torch.zeros(112)]
    pending = None  # (step it is applied at, [s_0, s_1], the anchor it made)
    out = []
    for t in range(1, STEPS + 1):
        _replica_steps(models, opts, t)
        if pending is not None and pending[0] == t:
            with torch.no_grad():
                for model, launched in zip(models, pending[1]):
                    torch.nn.utils.vector_to_parameters(pending[2][:103] + (_flat(model) - launched), model.parameters())
            pending = None
        if t % kx == 0:
            sent = []
            for r, model in enumerate(models):
                u = errors[r] + (anchor - pad(_flat(model)))
                dense = _sent(u, chunk, topk, values)[0].view(-1)
                errors[r] = u - dense
                sent.append(dense)
            delta = (sent[0] + sent[1]) / 2
            if outer_lr != 1.0 or outer_momentum != 0.0:
                buf = outer_momentum * buf + delta
                anchor = anchor - outer_lr * (delta + outer_momentum * buf)
            else:
                anchor = anchor - delta
            if delay:
                pending = (t + delay, [_flat(m) for m in models], anchor.clone())
            else:
                with torch.no_grad():
                    for model in models:
                        torch.nn.utils.vector_to_parameters(anchor[:103].clone(), model.parameters())
        out.append([_flat(m) for m in models])
    return out


@pytest.mark.parametrize("variant", [{}, {"sync_values": "int8"}, {"sync_values": "int2"},
                                     {"outer_lr": 0.7, "outer_momentum": 0.9}, {"param_sync_delay": 1}],
                         ids=["bf16", "int8", "int2", "nesterov", "streamed"])
def test_desloc_compressed_syncs_follow_the_equations(variant):
    """sync_topk: each parameter sync sends 2 of every 16 elements of u per replica and keeps the
    rest in its error buffer; the replicas meet at the same parameters after every sync."""
    sync = dict(param_sync_every=2, momentum_sync_every=0, variance_sync_every=0, sync_topk=2, sync_chunk=16)
    results = run_ranks(_train, 2, {"mode": "desloc", "shard_group_size": 1, "desloc": {**sync, **variant}},
                        0.0, "master")
    values = variant.get("sync_values", "bf16")
    outer = {k: v for k, v in variant.items() if k.startswith("outer")}
    delay = variant.get("param_sync_delay", 0)
    ref = _desloc_compressed_reference(2, 2, 16, values, **outer, delay=delay)
    for t in range(STEPS):
        for r, res in enumerate(results):
            torch.testing.assert_close(res["after"][t], ref[t][r], rtol=1e-6, atol=1e-7)
    # synced at step 2 (streamed: applied after step 3, each replica's own step 3 on top)
    assert torch.equal(results[0]["after"][1], results[1]["after"][1]) is not bool(delay)
    assert not torch.equal(results[0]["after"][2], results[1]["after"][2])  # apart at step 3
    # One all-gather per sync (steps 2, 4, 6) of 7 chunks × 2 × (1-byte index + 2-byte bf16 value,
    # or 1-byte int8 value + a 4-byte scale per chunk; int2: 1 byte each + one 8-byte (lo, hi) for
    # the group of 7 chunks, padded to whole fp32 words) per replica, (R−1)/R of the 2 payloads sent.
    payload = {"bf16": 7 * 2 * 3, "int8": 7 * 2 * 2 + 7 * 4, "int2": 24}[values]
    ops = results[0]["bytes"]
    assert "replica.all_reduce" not in ops
    assert ops["replica.all_gather"]["calls"] == 3 and ops["replica.all_gather"]["bytes_sent"] == 3 * payload


def _desloc_compressed_moments_reference(kx, ku, kv, topk, chunk, values, floored, shards=((0, 103),),
                                         ranks_per_replica=1):
    """Two replicas, each AdamW on its own ranks' data (``ranks_per_replica`` consecutive ranks:
    the mean of their gradients), the parameters averaged every Kx steps; each moment s every K_s
    steps a compressed sync of its change since the last one: over the flat moment (103
    elements), d_r = s_r − a, a the moment both replicas agreed on at the last sync plus the means
    since (zero at the start); d̂_r = each chunk's ``topk`` largest |d_r|, rounded (``_sent``),
    the chunks counted within each of ``shards`` (a rank's part of the flat moment, the last chunk
    padded with zeros, which may be picked and are then dropped); s_r ← s_r + mean(d̂) − d̂_r,
    kept at least s_r / 2 for the second moment (a dense average never leaves less), and
    a ← a + mean(d̂). ``floored`` collects, per second-moment sync, how many elements the floor
    raised."""
    models = [_model(), _model()]
    opts = [torch.optim.AdamW(m.parameters(), **HP) for m in models]
    pairs = list(zip(models[0].parameters(), models[1].parameters()))
    anchors = {"exp_avg": torch.zeros(103), "exp_avg_sq": torch.zeros(103)}

    def sent_of(d):
        pieces = []
        for a, b in shards:
            padded = torch.cat([d[a:b], d.new_zeros(-(b - a) % chunk)])
            pieces.append(_sent(padded, chunk, topk, values)[0].view(-1)[:b - a])
        return torch.cat(pieces)

    out = []
    for t in range(1, STEPS + 1):
        _replica_steps(models, opts, t, ranks_per_replica)
        for key, every in (("exp_avg", ku), ("exp_avg_sq", kv)):
            if t % every:
                continue
            moments = [torch.cat([opts[r].state[p[r]][key].reshape(-1) for p in pairs]) for r in range(2)]
            sent = [sent_of(s - anchors[key]) for s in moments]
            mean = (sent[0] + sent[1]) / 2
            for r in range(2):
                s = moments[r] + (mean - sent[r])
                if key == "exp_avg_sq":
                    floored.append(int((s < moments[r] / 2).sum()))
                    s = torch.maximum(s, moments[r] / 2)
                at = 0
                for p in pairs:
                    n = p[r].numel()
                    opts[r].state[p[r]][key] = s[at:at + n].view_as(p[r]).clone()
                    at += n
            anchors[key] = anchors[key] + mean
        if t % kx == 0:
            with torch.no_grad():
                for pa, pb in pairs:
                    avg = (pa + pb) * 0.5
                    pa.copy_(avg)
                    pb.copy_(avg)
        out.append([_flat(m) for m in models])
    return out


@pytest.mark.parametrize("values,topk", [("bf16", 3), ("int8", 3), ("int2", 8)])
def test_desloc_compressed_moment_syncs_follow_the_equations(values, topk):
    """moment_sync_topk: each moment sync sends ``topk`` of every 16 elements of the moment's
    change since its last sync per replica (Ku 2, Kv 3: the second moment synced at steps 3 and 6);
    what a replica did not send stays in its moment; the parameters averaged dense every 2 steps.
    int2's top 8 picks a zero of the padding in the last chunk (7 parameters): sent as ±lo, it must
    not land in the shard's padding, or later syncs would pick it again."""
    sync = dict(param_sync_every=2, momentum_sync_every=2, variance_sync_every=3, moment_sync_topk=topk,
                sync_chunk=16, moment_sync_values=values)
    results = run_ranks(_train, 2, {"mode": "desloc", "shard_group_size": 1, "desloc": sync}, 0.0, "params")
    floored = []
    ref = _desloc_compressed_moments_reference(2, 2, 3, topk, 16, values, floored)
    for t in range(STEPS):
        for r, res in enumerate(results):
            torch.testing.assert_close(res["after"][t], ref[t][r], rtol=1e-6, atol=1e-7)
    assert all(floored)  # the second moment's floor acted in each of its syncs, on every variant
    # the parameters: one all-reduce of the 112 padded elements per sync (steps 2, 4, 6), 2(R−1)/R
    # of them sent; the moments: one all-gather of a 7-chunk payload per sync (the first moment at
    # 2, 4, 6, the second at 3, 6), (R−1)/R of the 2 payloads sent: 7 chunks × topk × (1-byte
    # index + 2-byte bf16 value, or 1-byte int8 value + a 4-byte scale per chunk; int2: 1 byte + 8
    # bytes of (lo, hi)), padded to whole elements of the widest section
    payload = {"bf16": 7 * 3 * 3 + 1, "int8": 7 * 3 * 2 + 7 * 4 + 2, "int2": 7 * 8 + 8}[values]
    ops = results[0]["bytes"]
    assert ops["replica.all_reduce"]["calls"] == 3 and ops["replica.all_reduce"]["bytes_sent"] == 3 * 112 * 4
    assert ops["replica.all_gather"]["calls"] == 5 and ops["replica.all_gather"]["bytes_sent"] == 5 * payload


def test_desloc_compressed_moment_syncs_with_two_ranks_per_replica():
    """Compressed moment syncs where each replica is a shard group of 2 ranks (4 ranks,
    shard_group_size 2): each rank syncs its own shard's part of each moment over its replica
    group, its chunks of 24 counted from the shard's start (elements 0–63 on one rank: chunks
    0–23, 24–47, 48–63; 64–102 on the other: 64–87, 88–102, not the flat vector's 72–95), as the
    two-replica equations on the mean gradient of each replica's ranks. int2: each shard's chunks
    have their own two levels (a group of 3 chunks and one of 2), and the top 8 of each shard's
    last chunk (16 and 15 elements) picks padding only where fewer than 8 are non-zero."""
    sync = dict(param_sync_every=2, momentum_sync_every=2, variance_sync_every=3, moment_sync_topk=8,
                sync_chunk=24, moment_sync_values="int2")
    results = run_ranks(_train, 4, {"mode": "desloc", "shard_group_size": 2, "desloc": sync}, 0.0, "params")
    ref = _desloc_compressed_moments_reference(2, 2, 3, 8, 24, "int2", [], shards=((0, 64), (64, 103)),
                                               ranks_per_replica=2)
    for t in range(STEPS):
        for rank, res in enumerate(results):
            torch.testing.assert_close(res["after"][t], ref[t][rank // 2], rtol=1e-6, atol=1e-7)
    # the moments' all-gathers (the first moment at 2, 4, 6, the second at 3, 6): 3 chunks × 8 ×
    # 1 byte (index and int2 value) + 8 bytes of (lo, hi) on the first shard, 2 chunks on the
    # second; (R−1)/R of the 2 payloads sent
    for rank, payload in ((0, 32), (1, 24)):
        ops = results[rank]["bytes"]["replica.all_gather"]
        assert ops["calls"] == 5 and ops["bytes_sent"] == 5 * payload, (rank, ops)


def _moment_sync_over_ranges(rank, world, ranges, block_bytes):
    """Two syncs of a 40-element 'second moment' over ``ranges`` on a real replica group: anchor
    at zero, each rank's own moment, then a second sync after a local change. ``block_bytes``:
    the codec's work a block of that many fp32 bytes at a time (None: the library's)."""
    from ds_lowcomm.comm.collectives import CommStats
    from ds_lowcomm.comm.topology import Topology
    from ds_lowcomm.modes import sparse
    from ds_lowcomm.modes.desloc import DeslocOptions, MomentSync

    if block_bytes is not None:
        sparse.CHUNK_BYTES = block_bytes
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    stats = CommStats()
    topo = Topology.build(1, 60.0, stats)
    g = torch.Generator().manual_seed(rank)
    state = torch.zeros(40)
    sync = MomentSync(DeslocOptions(moment_sync_topk=2, sync_chunk=8), state, ranges, nonnegative=True)
    out = []
    for _ in range(2):
        for a, b in ranges:
            state[a:b] += torch.rand(b - a, generator=g) * torch.rand(b - a, generator=g)
        before = state.clone()
        sync.sync(state, topo.replica)
        out.append((before, state.clone(), sync.anchor.clone()))
    torch.distributed.destroy_process_group()
    return out, stats.as_dict()["ops"]["replica.all_gather"]


@pytest.mark.parametrize("block_bytes", [None, 32], ids=["one-block", "a-block-per-chunk"])
def test_a_moment_sync_packs_the_ranges_it_carries(block_bytes):
    """Muon's second moment lives on the AdamW ranges of the shard only: a compressed sync packs
    those ranges (17 elements here: 3 chunks of 8), sends the top 2 of each packed chunk, leaves the
    rest of the shard alone, and keeps v ≥ v_old / 2; checked against the equations on the
    packed vector. In blocks of one chunk, the second range starts inside the first block and
    runs into the third."""
    ranges = [(3, 10), (25, 35)]
    results = run_ranks(_moment_sync_over_ranges, 2, ranges, block_bytes)
    idx = torch.cat([torch.arange(a, b) for a, b in ranges])
    anchor = torch.zeros(40)
    for k in range(2):
        packed = [torch.cat([res[0][k][0][idx], torch.zeros(7)]) for res in results]  # 17 → 24
        sent = [_sent(p - torch.cat([anchor[idx], torch.zeros(7)]), 8, 2, "bf16")[0].view(-1) for p in packed]
        mean = (sent[0] + sent[1]) / 2
        anchor[idx] += mean[:17]
        for r, res in enumerate(results):
            before, after, got_anchor = res[0][k]
            want = before.clone()
            want[idx] = torch.maximum(packed[r] + (mean - sent[r]), packed[r] / 2)[:17]
            assert torch.equal(after, want), (k, r)
            assert torch.equal(got_anchor, anchor), (k, r)
    # 3 chunks × 2 × (1-byte index + 2-byte bf16 value) = 18 bytes per payload, one sent per sync
    ops = results[0][1]
    assert ops["calls"] == 2 and ops["bytes_sent"] == 2 * 18


def test_sparse_codec_keeps_what_it_does_not_send():
    """Error feedback, bit for bit: after encoding u, the buffer holds u where nothing was sent
    and u − (the value sent) where something was; the sent entries are each chunk's largest |u|."""
    from ds_lowcomm.modes.sparse import ChunkTopK

    g = torch.Generator().manual_seed(0)
    cases = [(values, chunk, topk, chunks) for values in ("bf16", "int8")
             for chunk, topk, chunks in ((16, 3, 5), (300, 7, 5))]  # 1-byte and 2-byte indices
    cases += [("int2", 16, 3, 5), ("int2", 64, 5, 37)]  # one group; two whole groups and a part
    for values, chunk, topk, chunks in cases:
        codec = ChunkTopK(chunks * chunk - 5, chunk, topk, values)  # the last chunk padded
        u = torch.randn(codec.padded, generator=g) * torch.rand(codec.padded, generator=g) * 10
        u[codec.numel:] = 0
        error = u.clone()
        payload = torch.zeros(codec.payload_bytes, dtype=torch.uint8)
        codec.encode(error, payload)
        sent, idx = _sent(u, chunk, topk, values)
        mask = torch.zeros_like(sent, dtype=torch.bool).scatter(1, idx, True).view(-1)
        mean = torch.empty(chunks, chunk)
        codec.mean_into([payload, payload], 0, chunks, mean)  # (x + x) / 2 == x: what was sent
        assert torch.equal(error[~mask], u[~mask])
        assert torch.equal(error[mask], (u - mean.view(-1))[mask])
        if values == "int2":  # the reference's levels are fp64 means, the codec's fp32 sums
            torch.testing.assert_close(mean, sent, rtol=1e-6, atol=0)
            assert int((mean != 0).sum()) == chunks * topk  # no level is zero
        else:
            assert torch.equal(mean, sent)


def _dct_matrix(n):
    """Orthonormal DCT-II: D[k, i] = sqrt(2/n)·cos(π/n·(i + 1/2)·k), row 0 divided by sqrt(2)."""
    i = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi / n * (i[None, :] + 0.5) * i[:, None]) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d


def _demo_reference(chunk, topk, beta):
    """DeMo (arXiv 2411.19870, Algorithm 1) with two replicas and flat tiling: the momentum of the
    flat parameters, zero-padded to whole tiles of chunk × chunk (103 → 112 elements here, which
    is also the shard's padding), 2-D DCT of each tile, the top-k |coefficients| per tile kept
    (as bf16), error feedback, and the update from the sign of the inverse DCT of the
    per-coefficient mean over the replicas that sent it."""
    model = _model()
    n = _flat(model).numel()
    tiles = -(-n // (chunk * chunk))
    d = _dct_matrix(chunk)
    delta = [torch.zeros(tiles * chunk * chunk, dtype=torch.float64) for _ in range(2)]
    out = []
    for t in range(STEPS):
        sent = []
        for r in range(2):
            g = torch.cat([x.reshape(-1) for x in _grad(model, r, t)]).double()
            delta[r] *= beta
            delta[r][:n] += HP["lr"] * g
            coeffs = (d @ delta[r].view(tiles, chunk, chunk) @ d.T).reshape(tiles, -1)
            keep = coeffs.abs().topk(topk, dim=1).indices
            vals = torch.zeros_like(coeffs)
            vals.scatter_(1, keep, coeffs.gather(1, keep).to(torch.bfloat16).double())
            delta[r] -= (d.T @ vals.view(tiles, chunk, chunk) @ d).reshape(-1)
            sent.append(vals)
        carried = sum((v != 0).double() for v in sent)
        mean = sum(sent) / carried.clamp(min=1)
        q = (d.T @ mean.view(tiles, chunk, chunk) @ d).reshape(-1)[:n]
        with torch.no_grad():
            theta = _flat(model).double() * (1 - HP["lr"] * HP["weight_decay"]) - HP["lr"] * torch.sign(q)
            torch.nn.utils.vector_to_parameters(theta.float(), model.parameters())
        out.append(_flat(model))
    return out


def test_demo_is_the_papers_update_with_a_dct_from_its_formula():
    """Two replicas (shard_group_size 1), flat tiling in tiles of 4 × 4, top 3 per tile in bf16."""
    demo = {"chunk": 4, "topk": 3, "tiling": "flat", "values": "bf16", "beta": 0.9}
    results = run_ranks(_train, 2, {"mode": "demo", "shard_group_size": 1, "demo": demo})
    ref = _demo_reference(4, 3, 0.9)
    for t in range(STEPS):
        for res in results:
            torch.testing.assert_close(res["after"][t], ref[t], rtol=1e-5, atol=1e-6)
