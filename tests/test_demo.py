"""DeMo: a reference implementation of its equations, replicas that never drift, bytes (exact resume: test_resume.py)."""
import math

import pytest
import torch

import workers
from dist import run_ranks
from ds_lowcomm.modes.dct import DctTopK

pytestmark = pytest.mark.integration

GAS = 2


def demo_config(g, **demo):
    cfg = workers.config("demo", shard_group_size=g, demo=demo)
    cfg["gradient_accumulation_steps"] = GAS
    return cfg


def _train_demo(rank, world, g, steps, demo, digest_every):
    engine = workers.build_engine(demo_config(g, **demo))
    digests = []
    losses = []
    for step in range(steps):
        losses += workers.train(engine, 1, start=step, rank=rank)
        if (step + 1) % digest_every == 0:
            digests.append(workers.params_digest(engine))
    opt = engine.optimizer
    return dict(master=opt.master_weights(), digests=digests, losses=losses, stats=engine.comm_stats(),
                payload=opt.mode.codec.payload_bytes, padded=opt.flat.layout.padded)


def reference_demo(world, steps, cfg, padded, chunk=64, topk=32, beta=0.999, values="bf16", delayed=False,
                   lookahead=False, tiling="matrix"):
    """DeMo from its equations, every rank its own replica, in one process. ``delayed``: the
    gradients of step s are taken on the parameters after s−2 updates (one-step-delayed apply);
    with ``lookahead``, moved by −lr·sign(β·δ + lr·clipped g) of the rank's previous step.
    ``tiling``: "matrix" tiles each weight matrix on its own rows and columns, as the reference
    DeMo does; "flat" tiles consecutive elements of the flat vector."""
    torch.set_num_threads(1)
    hp = cfg["optimizer"]["params"]
    lr, wd, clip = hp["lr"], hp["weight_decay"], cfg["gradient_clipping"]
    model = workers.tiny_gpt2(0)
    params = list(model.parameters())
    theta = torch.zeros(padded)
    n = sum(p.numel() for p in params)
    theta[:n] = torch.nn.utils.parameters_to_vector(params).detach()
    matrices = ()
    if tiling == "matrix":
        offsets = [0] + [int(x) for x in torch.tensor([p.numel() for p in params]).cumsum(0)]
        matrices = tuple((o, p.numel() // p.shape[-1], p.shape[-1]) for o, p in zip(offsets, params)
                         if p.dim() >= 2)
    codec = DctTopK(padded, chunk, topk, values, matrices)
    delta = [torch.zeros(padded) for _ in range(world)]
    look = [torch.zeros(padded) for _ in range(world)]
    history = [theta]
    for step in range(steps):
        payloads = []
        at = history[max(step - 1, 0)] if delayed else theta
        for i in range(world):
            point = at - lr * look[i] if lookahead else at
            torch.nn.utils.vector_to_parameters(point[:n].clone(), params)
            model.zero_grad()
            for micro in range(GAS):
                x = workers.batch(step, micro, i)
                (model(x, labels=x).loss / GAS).backward()
            g = torch.zeros(padded)
            g[:n] = torch.cat([p.grad.flatten() for p in params])
            # Exactly the library's arithmetic: sign() turns any rounding difference into a flip.
            if lookahead:
                norm = torch.linalg.vector_norm(g, dtype=torch.float64).item()
                scale = 1.0 / ((norm + 1e-6) / clip) if (norm + 1e-6) / clip > 1 else 1.0
                look[i] = (delta[i] * beta).add_(g, alpha=lr * scale).sign_()
            factor = (math.sqrt(g.double().square().sum().float().item()) + 1e-6) / clip
            if factor > 1:
                g = g * (1.0 / factor)
            delta[i] = delta[i] * beta + lr * g
            idx, vals = codec.encode(delta[i])
            delta[i] = delta[i] - codec.dense(idx, vals)
            payloads.append(codec.pack(idx, vals))
        q = codec.decode_mean(payloads)
        theta = theta * (1 - lr * wd) - lr * torch.sign(q)
        history.append(theta)
    return theta[:n]


@pytest.mark.parametrize("tiling", ["flat", "matrix"])
def test_matches_reference_demo(tiling):
    steps = 10
    r0, r1 = run_ranks(_train_demo, 2, 1, steps, {"tiling": tiling}, 1)
    assert r0["digests"] == r1["digests"]
    ref = reference_demo(2, steps, demo_config(1), r0["padded"], tiling=tiling)
    torch.testing.assert_close(r0["master"], ref, rtol=1e-5, atol=1e-5)
    assert r0["losses"][-1] < r0["losses"][0]


@pytest.mark.parametrize("lookahead", [True, False])
def test_overlap_matches_one_step_delayed_reference(lookahead):
    steps = 10
    r0, r1 = run_ranks(_train_demo, 2, 1, steps, {"overlap": True, "lookahead": lookahead}, 1)
    assert torch.equal(r0["master"], r1["master"])
    # Each rank computes at its own look-ahead point; the replicas agree on every global update.
    assert (r0["digests"] == r1["digests"]) != lookahead
    ref = reference_demo(2, steps, demo_config(1), r0["padded"], delayed=True, lookahead=lookahead)
    torch.testing.assert_close(r0["master"], ref, rtol=1e-5, atol=1e-5)
    other = reference_demo(2, steps, demo_config(1), r0["padded"], delayed=True, lookahead=not lookahead)
    undelayed = reference_demo(2, steps, demo_config(1), r0["padded"])
    for wrong in (other, undelayed):  # the delay and the look-ahead are real
        assert not torch.allclose(r0["master"], wrong, rtol=1e-5, atol=1e-5)
    ops = r0["stats"]["ops"]
    assert ops["replica.all_gather"]["calls"] == steps
    assert r0["stats"]["steps"] == steps  # steps count when taken: the last one's update is in flight
    assert r0["losses"][-1] < r0["losses"][0]


def test_four_ranks_two_shard_groups_never_drift():
    steps = 200
    results = run_ranks(_train_demo, 4, 2, steps, {"values": "sign"}, 50, timeout=600)
    assert all(r["digests"] == results[0]["digests"] for r in results)  # bit-identical, 4 ranks
    for r in results:
        ops = r["stats"]["ops"]
        # Across replica groups only the packed payload travels: one all-gather per step.
        assert [k for k in ops if k.startswith("replica.")] == ["replica.all_gather"]
        assert ops["replica.all_gather"]["calls"] == steps
        assert ops["replica.all_gather"]["bytes_sent"] == steps * (2 - 1) * r["payload"]
        assert ops["shard.reduce_scatter"]["calls"] == steps
    assert results[0]["losses"][-1] < results[0]["losses"][0] - 0.5


def _overlap_checkpoint_resumed_without_overlap(rank, world, save_dir):
    source = workers.build_engine(demo_config(1, overlap=True))
    workers.train(source, 4, rank=rank)
    source.save_checkpoint(f"{save_dir}/in_flight")  # step 4's update not yet in the model
    source.optimizer.flush()
    source.save_checkpoint(f"{save_dir}/flushed")
    resumed = {}
    for tag in ("in_flight", "flushed"):
        engine = workers.build_engine(demo_config(1), seed=5)
        engine.load_checkpoint(f"{save_dir}/{tag}")
        at_load = (workers.params_digest(engine), engine.optimizer.steps)
        losses = workers.train(engine, 3, start=4, rank=rank)
        resumed[tag] = (at_load, engine.global_steps, losses, workers.params_digest(engine))
    return workers.params_digest(source), resumed


def test_overlap_checkpoint_resumes_without_overlap(tmp_path):
    # Loading installs the update that was in flight: the same weights, step count and momentum
    # as a checkpoint taken after flush(), and from there the same training.
    for flushed_digest, resumed in run_ranks(_overlap_checkpoint_resumed_without_overlap, 2,
                                             str(tmp_path)):
        assert resumed["in_flight"] == resumed["flushed"]
        assert resumed["in_flight"][0][0] == flushed_digest
