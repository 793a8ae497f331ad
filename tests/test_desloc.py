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
