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


def local_muon(world, steps, k, cfg):
    """Each worker steps its hidden matrices with Muon (momentum 0.95, Nesterov, update scaled by
    0.2·√max(A, B), decoupled weight decay, Moonlight's form) and the rest (embeddings, vectors)
    with torch's AdamW, on its own data; every k steps θ, the momenta and v are averaged."""
    torch.set_num_threads(1)
    hp, gas, clip = cfg["optimizer"]["params"], cfg["gradient_accumulation_steps"], cfg["gradient_clipping"]
    lr, wd = hp["lr"], hp["weight_decay"]
    model = workers.tiny_gpt2(0)
    params = list(model.parameters())
    embeddings = {id(model.transformer.wte.weight), id(model.transformer.wpe.weight)}
    is_matrix = [p.dim() == 2 and id(p) not in embeddings for p in params]
    replicas = []
    for _ in range(world):
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
            model.zero_grad()
            for micro in range(gas):
                x = workers.batch(step, micro, i)
                (model(x, labels=x).loss / gas).backward()
            norm = torch.cat([p.grad.flatten() for p in params]).double().norm().item()
            factor = (norm + 1e-6) / clip
            with torch.no_grad():
                for p, t, m, mat in zip(params, theta, momenta, is_matrix):
                    g = p.grad / factor if factor > 1 else p.grad.clone()
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
                        mean = sum(s[j][key] for s in adam_states) / world
                        for s in adam_states:
                            s[j][key].copy_(mean)
                for j, mat in enumerate(is_matrix):
                    mean = sum(r[0][j].detach() for r in replicas) / world
                    for r in replicas:
                        r[0][j].copy_(mean)
                    if mat:
                        mean = sum(r[2][j] for r in replicas) / world
                        for r in replicas:
                            r[2][j].copy_(mean)
    return torch.cat([t.detach().flatten() for t in replicas[0][0]])


def test_muon_inner_step_is_local_muon():
    """``inner_optimizer: "muon"`` against a reference written from Muon's equations: the hidden
    matrices orthogonalised, embeddings and vectors AdamW, all three states averaged every k."""
    k, steps = 3, 6
    cfg = desloc_config(1, param_sync_every=k, momentum_sync_every=k, variance_sync_every=k, inner_optimizer="muon")
    r0, r1 = run_ranks(_train, 2, cfg, steps)
    assert torch.equal(r0["master"], r1["master"])  # synced at step 6
    ref = local_muon(2, steps, k, cfg)
    torch.testing.assert_close(r0["master"][:ref.numel()], ref, rtol=1e-5, atol=1e-5)
    # not the AdamW inner step
    assert (r0["master"][:ref.numel()] - local_adam(2, steps, k, cfg)).abs().max() > 1e-3

