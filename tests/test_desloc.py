"""DES-LOC: Local Adam as its special case, plain AdamW with one replica, bytes (exact resume: test_resume.py)."""
import pytest
import torch

import workers
from dist import run_ranks

pytestmark = pytest.mark.integration


def desloc_config(g, **periods):
    return workers.config("desloc", shard_group_size=g, desloc=periods)


def _train(rank, world, cfg, steps):
    engine = workers.build_engine(cfg)
    losses = workers.train(engine, steps, rank=rank)
    return dict(losses=losses, master=engine.optimizer.master_weights(), stats=engine.comm_stats(),
                shard=engine.optimizer.flat.layout.shard_size)


def local_adam(world, steps, k, cfg, outer_lr=1.0, outer_momentum=0.0):
    """Each worker AdamW on its own data; every k steps θ, m and v are averaged (after the update),
    the θ average optionally through an outer Nesterov SGD (DiLoCo)."""
    torch.set_num_threads(1)
    hp, gas, clip = cfg["optimizer"]["params"], cfg["gradient_accumulation_steps"], cfg["gradient_clipping"]
    model = workers.tiny_gpt2(0)
    params = list(model.parameters())
    theta0 = torch.nn.utils.parameters_to_vector(params).detach()
    masters = [torch.nn.Parameter(theta0.clone()) for _ in range(world)]
    opts = [torch.optim.AdamW([m], lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                              weight_decay=hp["weight_decay"]) for m in masters]
    anchor = torch.nn.Parameter(theta0.clone())
    outer = torch.optim.SGD([anchor], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    for step in range(steps):
        for i in range(world):
            torch.nn.utils.vector_to_parameters(masters[i].detach().clone(), params)
            model.zero_grad()
            for micro in range(gas):
                x = workers.batch(step, micro, i)
                (model(x, labels=x).loss / gas).backward()
            g = torch.cat([p.grad.flatten() for p in params])
            factor = (g.double().norm().item() + 1e-6) / clip
            masters[i].grad = g * (1.0 / factor) if factor > 1 else g
            opts[i].step()
        if (step + 1) % k == 0:
            with torch.no_grad():
                for key in ("exp_avg", "exp_avg_sq"):
                    mean = sum(o.state[m][key] for o, m in zip(opts, masters)) / world
                    for o, m in zip(opts, masters):
                        o.state[m][key].copy_(mean)
                mean = sum(m.detach() for m in masters) / world
                if outer_lr != 1.0 or outer_momentum:
                    anchor.grad = anchor.detach() - mean
                    outer.step()
                    mean = anchor.detach().clone()
                for m in masters:
                    m.copy_(mean)
    return masters[0].detach()


@pytest.mark.parametrize("outer", [{}, {"outer_lr": 0.7, "outer_momentum": 0.9}], ids=["average", "nesterov"])
def test_equal_periods_is_local_adam(outer):
    k, steps = 3, 9
    cfg = desloc_config(1, param_sync_every=k, momentum_sync_every=k, variance_sync_every=k, **outer)
    r0, r1 = run_ranks(_train, 2, cfg, steps)
    assert torch.equal(r0["master"], r1["master"])  # synced at step 9
    ref = local_adam(2, steps, k, cfg, **outer)
    n = ref.numel()
    torch.testing.assert_close(r0["master"][:n], ref, rtol=1e-5, atol=1e-5)


def test_one_replica_is_plain_adamw_and_bytes_follow_the_periods():
    steps = 12
    # One shard group of 2 ranks = a single replica: exactly zero1 (AdamW), nothing averaged.
    single, zero1 = (run_ranks(_train, 2, cfg, steps)[0]
                     for cfg in (desloc_config(2, param_sync_every=1), workers.config("zero1")))
    assert single["losses"] == zero1["losses"]
    assert not any(k.startswith("replica.") for k in single["stats"]["ops"])

    # Two replicas, Kx = 2 (Ku = 6, Kv = 12 by default): 6 + 2 + 1 shard-sized fp32 averages.
    r = run_ranks(_train, 2, desloc_config(1, param_sync_every=2), steps)[0]
    sent = r["stats"]["ops"]["replica.all_reduce"]["bytes_sent"]
    assert sent == 2 * (2 - 1) / 2 * 4 * r["shard"] * (6 + 2 + 1)
    # One in-place all-reduce per state due (no concatenated copy of the states): 6 + 2 + 1.
    assert r["stats"]["ops"]["replica.all_reduce"]["calls"] == 6 + 2 + 1


def newton_schulz5(u):
    """Jordan's quintic Newton–Schulz iteration, written from its description: five steps of
    X ← aX + (bA + cA²)X with A = XXᵀ, from X = U/‖U‖_F, on the wide orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u / (u.norm() + 1e-7)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    for _ in range(5):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def local_muon(world, steps, k, cfg, s=1):
    """Each replica of ``s`` ranks (its gradient the mean of its ranks') steps its hidden matrices
    with Muon (momentum 0.95, Nesterov, update scaled by 0.2·√max(A, B), decoupled weight decay,
    Moonlight's form) and the rest (embeddings, vectors) with torch's AdamW; every k steps θ, the
    momenta and v are averaged over the replicas. Returns each replica's parameters."""
    torch.set_num_threads(1)
    hp, gas, clip = cfg["optimizer"]["params"], cfg["gradient_accumulation_steps"], cfg["gradient_clipping"]
    lr, wd = hp["lr"], hp["weight_decay"]
    model = workers.tiny_gpt2(0)
    params = list(model.parameters())
    embeddings = {id(model.transformer.wte.weight), id(model.transformer.wpe.weight)}
    is_matrix = [p.dim() == 2 and id(p) not in embeddings for p in params]
    replicas = []
    for _ in range(world // s):
        theta = [torch.nn.Parameter(p.detach().clone()) for p in params]
        adam = torch.optim.AdamW([t for t, mat in zip(theta, is_matrix) if not mat], lr=lr, betas=tuple(hp["betas"]),
                                 eps=hp["eps"], weight_decay=wd)
        momenta = [torch.zeros_like(t) if mat else None for t, mat in zip(theta, is_matrix)]
        replicas.append((theta, adam, momenta))
    for step in range(steps):
        for i, (theta, adam, momenta) in enumerate(replicas):
            with torch.no_grad():
                for p, t in zip(params, theta):
                    p.copy_(t)
            grads = [torch.zeros_like(p) for p in params]
            for rank in range(i * s, (i + 1) * s):
                model.zero_grad()
                for micro in range(gas):
                    x = workers.batch(step, micro, rank)
                    (model(x, labels=x).loss / gas).backward()
                for acc, p in zip(grads, params):
                    acc += p.grad / s
            norm = torch.cat([g.flatten() for g in grads]).double().norm().item()
            factor = (norm + 1e-6) / clip
            with torch.no_grad():
                for g, t, m, mat in zip(grads, theta, momenta, is_matrix):
                    g = g / factor if factor > 1 else g
                    if not mat:
                        t.grad = g
                        continue
                    m.mul_(0.95).add_(g, alpha=0.05)
                    o = newton_schulz5(0.05 * g + 0.95 * m)
                    t.mul_(1 - lr * wd).sub_(o, alpha=lr * 0.2 * max(t.shape) ** 0.5)
            adam.step()
        if (step + 1) % k == 0:
            with torch.no_grad():
                adam_states = [[r[1].state[t] for t, mat in zip(r[0], is_matrix) if not mat] for r in replicas]
                for j in range(len(adam_states[0])):
                    for key in ("exp_avg", "exp_avg_sq"):
                        mean = sum(st[j][key] for st in adam_states) / len(replicas)
                        for st in adam_states:
                            st[j][key].copy_(mean)
                for j, mat in enumerate(is_matrix):
                    mean = sum(r[0][j].detach() for r in replicas) / len(replicas)
                    for r in replicas:
                        r[0][j].copy_(mean)
                    if mat:
                        mean = sum(r[2][j] for r in replicas) / len(replicas)
                        for r in replicas:
                            r[2][j].copy_(mean)
    return [torch.cat([t.detach().flatten() for t in r[0]]) for r in replicas]


def _muon_and_adamw(rank, world, cfg, steps):
    out = _train(rank, world, cfg, steps)
    adamw = {**cfg, "lowcomm": {**cfg["lowcomm"], "desloc": {**cfg["lowcomm"]["desloc"], "inner_optimizer": "adamw"}}}
    out["adamw_stats"] = _train(rank, world, adamw, steps)["stats"]
    return out


@pytest.mark.parametrize("world,s,k", [(2, 1, 3), (4, 2, 4)], ids=["replica-per-rank", "sharded"])
def test_muon_inner_step_is_local_muon(world, s, k):
    """``inner_optimizer: "muon"`` against a reference written from Muon's equations: the hidden
    matrices orthogonalised, embeddings and vectors AdamW, all three states averaged every k; over
    shard groups of 2 the matrix a shard boundary cuts is made whole with one all-reduce of it per
    step (bytes: the formula), and the result is the unsharded one."""
    steps = 6
    cfg = desloc_config(s, param_sync_every=k, momentum_sync_every=k, variance_sync_every=k, inner_optimizer="muon")
    results = run_ranks(_muon_and_adamw, world, cfg, steps)
    refs = local_muon(world, steps, k, cfg, s)
    n = refs[0].numel()
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["master"][:n], refs[rank // s], rtol=1e-5, atol=1e-5)
    if k == 3:  # synced at step 6
        assert torch.equal(results[0]["master"], results[-1]["master"])
        # not the AdamW inner step
        assert (results[0]["master"][:n] - local_adam(world, steps, k, cfg)).abs().max() > 1e-3
    else:  # mid-period: the replicas differ
        assert not torch.equal(results[0]["master"], results[-1]["master"])
    sent = {key: r["stats"]["ops"].get("shard.all_reduce", {}).get("bytes_sent", 0)
            for key, r in (("muon", results[0]), ("adamw", {"stats": results[0]["adamw_stats"]}))}
    model = workers.tiny_gpt2(0)
    embeddings = {id(model.transformer.wte.weight), id(model.transformer.wpe.weight)}
    shard, offset, cut = results[0]["shard"], 0, 0
    for p in model.parameters():
        if p.dim() == 2 and id(p) not in embeddings and offset // shard != (offset + p.numel() - 1) // shard:
            cut += p.numel()
        offset += p.numel()
    assert (s == 1) == (cut == 0)
    assert sent["muon"] - sent["adamw"] == steps * 2 * (s - 1) / s * 4 * cut
    if s == 1:  # a second-moment sync sends the AdamW part alone (the matrices' is zero)
        hidden = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings)
        numel = sum(p.numel() for p in model.parameters())
        replica = results[0]["stats"]["ops"]["replica.all_reduce"]["bytes_sent"]
        assert replica == steps // k * 2 * (world - 1) / world * 4 * (2 * shard + numel - hidden)


def _switch_inner_optimizer(rank, world, save_dir):
    from ds_lowcomm.checkpoint import CheckpointError

    muon = desloc_config(1, param_sync_every=2, inner_optimizer="muon")
    engine = workers.build_engine(muon)
    workers.train(engine, 1, rank=rank)
    engine.save_checkpoint(save_dir)
    other = workers.build_engine(desloc_config(1, param_sync_every=2))
    refused = workers.raised(CheckpointError, other.load_checkpoint, save_dir)
    weights = workers.build_engine(desloc_config(1, param_sync_every=2))
    weights.load_checkpoint(save_dir, load_optimizer_states=False)
    return refused, workers.params_digest(engine), workers.params_digest(weights)


def test_a_muon_checkpoint_is_not_resumed_by_adamw(tmp_path):
    """Muon's momentum is not Adam's first moment and its matrices have no second moment (Adam
    would divide by zero): resuming with the other inner optimizer is refused with the way out,
    and the weights (replica 0's) still load."""
    results = run_ranks(_switch_inner_optimizer, 2, str(tmp_path))
    replica0 = results[0][1]
    for refused, _, loaded in results:
        assert refused is not None and "set lowcomm.desloc.inner_optimizer to 'muon'" in refused
        assert loaded == replica0
