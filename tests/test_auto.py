""""mode": "automatic": the choice table, the probes on real ranks, and runs that choose, train and
resume exactly as the chosen mode set by hand does."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import workers
from dist import run_ranks
from ds_lowcomm.auto import Measured, choose, desloc_delay, desloc_picks
from ds_lowcomm.config import LowCommConfigError, parse
from ds_lowcomm.modes import MODES

ROOT = Path(__file__).resolve().parents[1]

ALL = list(MODES)


def _state_bytes(desloc, stream):
    """Bytes per parameter on a rank, written out from docs/benchmarks.md's "Memory per GPU": DeMo
    24 (its master, δ and gradient shard, and as much again in a step), DES-LOC ``desloc`` (its
    master, two moments and gradient shard: 16), its streamed syncs ``stream`` more (the master at
    the launch, the wire and two copies of each of the two moments: 24)."""
    def per_rank(mode, size, streamed):
        return (24 if mode == "demo" else desloc + stream * streamed) / size
    return per_rank


def _measured(ratio, world=2, per_node=1, uneven=1.0, node_ratio=None, shard_group_size=None, free_gb=None,
              muon=False, desloc_bytes=16, stream_bytes=24):
    compute = 0.2
    return Measured(world, per_node, [compute] + [compute * uneven] * (world - 1), ratio * compute,
                    None if node_ratio is None else node_ratio * compute, shard_group_size,
                    numel=7 * 10 ** 9, free_bytes=None if free_gb is None else free_gb * 1e9, muon=muon,
                    state_bytes=_state_bytes(desloc_bytes, stream_bytes))


# (measured, usable modes, mode, shard_group_size, picks): the table of ds_lowcomm/auto.py,
# written out from its docstring's rows
TABLE = [
    (_measured(0.05), ALL, "zero1", None, {}),
    (_measured(0.05, uneven=2.0), ALL, "acco", None, {}),
    (_measured(1.0), ALL, "acco", None, {}),
    (_measured(1.0), ["zero1", "demo", "desloc"], "zero1", None, {"overlap": True}),
    # slow, one node: every rank its own replica, DeMo at the slow-link settings
    (_measured(10.0), ALL, "demo", 1, {"beta": 0.999, "chunk": 64, "topk": 256, "values": "sign",
                                       "tiling": "matrix"}),
    # slow between nodes of 2 whose own link is fast: DES-LOC, replicas of a node, Kx >= 6r
    (_measured(10.0, world=4, per_node=2, node_ratio=0.1), ALL, "desloc", 2,
     {"param_sync_every": 64, "momentum_sync_every": 192, "variance_sync_every": 384, "param_sync_delay": 16}),
    # ... and whose own link is slow too: every rank its own replica
    (_measured(10.0, world=4, per_node=2, node_ratio=5.0), ALL, "demo", 1, None),
    (_measured(10.0), ["zero1", "acco", "desloc"], "desloc", 1, None),
    (_measured(10.0), ["zero1", "acco"], "acco", None, {}),
    # the user's shard_group_size decides the layout
    (_measured(0.05, shard_group_size=1), ALL, "demo", 1, None),
    (_measured(10.0, shard_group_size=2), ALL, "acco", None, {}),
    (_measured(10.0, world=4, shard_group_size=2), ALL, "desloc", 2, None),
    # 7B parameters, 60 GB free per GPU (48 GB usable): a whole replica's state (112-168 GB) does
    # not fit on one, a node of 8's share does (14 GB); with nothing that fits, the sharded row
    (_measured(10.0, world=16, per_node=8, free_gb=60), ALL, "desloc", 8, None),
    (_measured(10.0, world=16, per_node=1, free_gb=60), ALL, "acco", None, {}),
    (_measured(10.0, world=16, per_node=8, free_gb=220), ALL, "demo", 1, None),
    # the user's local step is Muon, which only desloc runs: desloc where demo would be, each rank
    # its own replica; nothing else changes
    (_measured(10.0, muon=True), ALL, "desloc", 1,
     {"param_sync_every": 64, "momentum_sync_every": 192, "variance_sync_every": 384, "param_sync_delay": 16}),
    (_measured(10.0, shard_group_size=1, muon=True), ALL, "desloc", 1, None),
    (_measured(10.0, muon=True), ["zero1", "acco", "demo"], "demo", 1, None),
    (_measured(10.0, world=4, per_node=2, node_ratio=0.1, muon=True), ALL, "desloc", 2, None),
    (_measured(1.0, muon=True), ALL, "acco", None, {}),
    # 7B, 220 GB free (176 usable), nodes of 8 whose own link is slow, the user's outer step and
    # compressed parameter syncs (28 bytes; 20 more streamed, the payload its wire): a whole
    # replica's desloc state (196 GB) does not fit, DeMo's (168 GB) would; with Muon desloc on a
    # node's ranks comes first (24.5 GB, 42 streamed)
    (_measured(10.0, world=16, per_node=8, node_ratio=5.0, free_gb=220, muon=True, desloc_bytes=28,
               stream_bytes=20), ALL, "desloc", 8,
     {"param_sync_every": 64, "momentum_sync_every": 192, "variance_sync_every": 384, "param_sync_delay": 16}),
    # 30 GB free (24 usable): desloc on a node of 8 fits (14 GB), with its streamed syncs' copies
    # (35 GB) it does not
    (_measured(10.0, world=16, per_node=8, node_ratio=0.1, free_gb=30), ALL, "desloc", 8,
     {"param_sync_every": 64, "momentum_sync_every": 192, "variance_sync_every": 384}),
    (_measured(0.05, muon=True), ALL, "zero1", None, {}),
]


@pytest.mark.unit
@pytest.mark.parametrize("i", range(len(TABLE)))
def test_the_choice_table(i):
    measured, usable, mode, size, picks = TABLE[i]
    choice = choose(measured, usable)
    assert (choice.mode, choice.shard_group_size) == (mode, size), choice
    if picks is not None:
        assert choice.options == picks
    assert f"{measured.ratio:.2f} steps of compute" in choice.reason
    if measured.free_bytes is not None and (mode, size) != ("demo", 1):
        assert "would not fit in memory" in choice.reason
    assert ("no streaming picked: its buffers would not fit" in choice.reason) == (
        mode == "desloc" and "param_sync_delay" not in choice.options)
    assert ("Muon as the local step" in choice.reason) == (measured.muon and mode == "desloc")


@pytest.mark.unit
def test_desloc_picks_and_no_mode_left():
    assert [desloc_picks(r)["param_sync_every"] for r in (0.1, 3, 5.4, 10, 20, 100)] == [16, 32, 64, 64, 128, 256]
    assert desloc_picks(10) == {"param_sync_every": 64, "momentum_sync_every": 192, "variance_sync_every": 384,
                                "param_sync_delay": 16}
    # streamed behind a quarter of the period that runs; compressed moment syncs are synchronous
    assert [desloc_delay(kx) for kx in (1, 3, 4, 8, 64, 256)] == [0, 0, 1, 2, 16, 64]
    assert desloc_delay(64, moment_sync_topk=4) == 0
    assert "param_sync_delay" not in desloc_picks(10, streamed=False)
    with pytest.raises(LowCommConfigError, match="found no mode"):
        choose(_measured(10.0, world=4, shard_group_size=2), ["zero1", "acco"])


@pytest.mark.unit
def test_auto_config():
    cfg = parse(workers.config("automatic", automatic={"recheck_every": 50}, desloc={"param_sync_every": 8}), MODES)
    assert cfg.mode == "automatic" and cfg.mode_options.recheck_every == 50
    assert cfg.given_by_mode["desloc"] == {"param_sync_every"}
    # a candidate's own check runs with the settings auto would give it
    odd = workers.config("automatic")
    odd["gradient_accumulation_steps"] = 3
    check = parse(odd, MODES).check_mode
    assert "gradient_accumulation_steps" in check("acco", MODES["acco"].Options(), None)
    assert check("zero1", MODES["zero1"].Options(), None) is None
    assert "pace" in parse(workers.config("automatic", pace="fastest"), MODES).check_mode("demo", MODES["demo"].Options(), 1)
    for bad, words in (({"mode": "automatc"}, "did you mean 'automatic'"), ({"mode": "automatic", "automatic": {"every": 3}},
                                                                     "lowcomm.automatic.every: unknown key"),
                       ({"mode": "automatic", "automatic": {"recheck_every": -1}}, "lowcomm.automatic.recheck_every")):
        cfg = workers.config(None)
        cfg["lowcomm"] = bad
        with pytest.raises(LowCommConfigError, match=words):
            parse(cfg, MODES)


def _probe(rank, world):
    import os

    import torch.distributed as dist

    from ds_lowcomm.auto import predict_sync_s, ranks_per_node

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    control = dist.new_group(list(range(world)), backend="gloo")
    seconds = predict_sync_s(group, 1 << 22, torch.device("cpu"), control)
    agreed = ranks_per_node(world, group)
    os.environ["LOCAL_WORLD_SIZE"] = str(1 + rank)  # the launcher's word disagrees between ranks
    return seconds, agreed, ranks_per_node(world, group)


@pytest.mark.ranks
def test_probes_on_real_ranks():
    for seconds, agreed, disagreed in run_ranks(_probe, 2):
        assert 0 < seconds < 30
        assert agreed == 2 and disagreed == 1



def _probe_a_modelled_link(rank, world, latency, bytes_per_s, jitter, seeds, hiccup_at):
    """predict_sync_s with each all-reduce's time from a model of a link (``latency`` + bytes /
    ``bytes_per_s`` + uniform noise within ± ``jitter``): what a high-latency link does, which this
    kernel cannot shape (no netem). The probe of ``hiccup_at`` elements (if any) reads 0.2 s slow
    the first time it runs, as a busy host can make it. The predictions for a 1B-parameter model,
    one per seed."""
    import random

    import torch.distributed as dist

    import ds_lowcomm.auto as auto

    dist.init_process_group("gloo")
    group = dist.new_group([0])
    hiccup_at = {"first": auto.FIRST_PROBE_BYTES // 4, "largest": auto.PROBE_BYTES // 4}.get(hiccup_at)
    predictions, bytes_seconds = [], []
    for seed in range(seeds):
        noise, hiccups, spent = random.Random(seed), {hiccup_at}, []

        def timed(group, numel, device, repeats=2):
            hiccup = 0.2 if numel in hiccups else 0.0
            hiccups.discard(numel)
            spent.append(4 * numel / bytes_per_s)
            return latency + 4 * numel / bytes_per_s + noise.uniform(-jitter, jitter) + hiccup

        auto._timed_all_reduce = timed
        predictions.append(auto.predict_sync_s(group, 10 ** 9, torch.device("cpu"), group))
        assert hiccups <= {None}, "the hiccup never fired"
        bytes_seconds.append(sum(spent))
    return predictions, bytes_seconds, auto.PROBE_SECONDS


@pytest.mark.ranks
@pytest.mark.parametrize("latency, bytes_per_s, jitter, hiccup_at", [
    (0.1, 12.5e6, 0.002, None), (0.0005, 12.5e6, 0.002, None), (0.001, 2e6, 0.002, None),
    # 10 Gbit/s, where the 1 MiB probe spends under a millisecond: a hiccup on the first probe
    # (64 KiB) or the largest, which must not leave a probe of a few kilobytes to extrapolate
    (0.00005, 1.25e9, 0.00002, "first"), (0.00005, 1.25e9, 0.00002, "largest"),
])
def test_probes_time_bytes_past_the_latency(latency, bytes_per_s, jitter, hiccup_at):
    """On a modelled link with noise, over 20 seeds, the prediction for a 1B-parameter model is
    within 10% of latency + bytes / rate: at 100 ms of latency too, where every probe takes longer
    than PROBE_SECONDS and only its bytes may stop the doubling, and on a fast link where one probe
    reads slow once. The probes' bytes take under 5·PROBE_SECONDS of link time (the docstring's
    bound; none of these links is slow enough for the first probe alone to pass it)."""
    expected = latency + 4e9 / bytes_per_s
    predictions, bytes_seconds, probe_seconds = run_ranks(_probe_a_modelled_link, 1, latency, bytes_per_s, jitter,
                                                          20, hiccup_at)[0]
    for seed, predicted in enumerate(predictions):
        assert abs(predicted - expected) <= 0.1 * expected, (seed, predicted, expected)
    assert max(bytes_seconds) < 5 * probe_seconds, bytes_seconds


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                    reason="the namespace needs root and iproute2")
@pytest.mark.parametrize("rate, burst, numel", [
    ("16mbit", "256kb", 1 << 18),  # the bench's token bucket, a 1 MiB model
    # a burst that the doubling probes spend part way through one of them, a 4 MiB model: that
    # probe alone reads the link about 2x too fast
    ("32mbit", "2900kb", 1 << 20),
])
def test_probes_read_a_rate_limited_link(rate, burst, numel):
    """Behind a token bucket on the loopback, the probes predict an all-reduce of ``numel``
    elements within a factor of 1.5 of that all-reduce timed at the link's rate (its burst spent),
    and take under 0.4 of its time (a single 1 MiB probe took all of it for the 1 MiB model, and
    probes doubling until one spent 0.1 s, then halving once, about half of it)."""
    from ds_lowcomm.bench.link import Link

    link = Link(rate, None)
    try:
        subprocess.run(["tc", "-n", link.ns, "qdisc", "replace", "dev", "lo", "root", "handle", "2:", "tbf", "rate",
                        rate, "burst", burst, "latency", "100ms"], check=True)
        proc = subprocess.run([*link.prefix(), sys.executable, str(Path(__file__).parent / "probe_on_link.py"),
                               str(numel)], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    finally:
        link.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert rank["timed"] > 0.5, rank  # the link limits
        assert rank["timed"] / 1.5 < rank["predicted"] < 1.5 * rank["timed"], rank
        assert rank["cost"] < 0.4 * rank["timed"], rank


#: the options whose state bytes are checked against what the mode allocates (2 ranks, each its
#: own replica): each term of desloc's count, alone or together, and DeMo with and without overlap
STATE_CASES = [
    ("desloc", {}),
    ("desloc", {"inner_optimizer": "muon"}),
    ("desloc", {"outer_lr": 0.7, "outer_momentum": 0.9}),
    ("desloc", {"sync_topk": 8}),
    ("desloc", {"outer_lr": 0.7, "sync_topk": 8}),
    ("desloc", {"moment_sync_topk": 8, "momentum_sync_every": 4, "variance_sync_every": 0}),
    ("desloc", {"param_sync_every": 2, "param_sync_delay": 1}),
    ("desloc", {"param_sync_every": 2, "param_sync_delay": 1, "variance_sync_every": 0, "sync_topk": 8,
                "outer_lr": 0.7}),
    ("demo", {}),
    ("demo", {"overlap": True}),
]


def _tensor_bytes(obj, skip_storages, seen=None, found=None):
    """The bytes of the distinct tensor storages reachable from ``obj``'s attributes (dicts, lists
    and the library's own objects followed; the context it was handed, its worker and the
    storages in ``skip_storages`` left out)."""
    seen = set() if seen is None else seen
    found = {} if found is None else found
    if id(obj) in seen:
        return found
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() not in skip_storages and storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
        return found
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif type(obj).__module__.startswith("ds_lowcomm.") and hasattr(obj, "__dict__"):
        children = [v for k, v in vars(obj).items() if k not in ("ctx", "local_ctx", "worker")]
    else:
        return found
    for child in children:
        _tensor_bytes(child, skip_storages, seen, found)
    return found


def _allocated_state(rank, world):
    out = []
    for mode, options in STATE_CASES:
        engine = workers.build_engine(workers.config(mode, shard_group_size=1, **{mode: options}))
        workers.train(engine, 2, rank=rank)  # buffers a round allocates on first use exist by now
        # At rest: a streamed sync still running on the comm worker holds the payloads it gathered
        # (a transient of the flight), which a walk beside it would count or not by timing.
        engine.optimizer.settle()
        m = engine.optimizer.mode
        skip = {t.untyped_storage().data_ptr() for t in (m.ctx.flat.buffer, m.ctx.grads.buffer)}
        held = sum(_tensor_bytes(m, skip).values()) / m.ctx.flat.layout.numel
        out.append((held, MODES[mode].state_bytes(m.options, 1)))
        engine.destroy()
    # what "automatic" asks on a GPU (on a CPU it checks no memory): the user's desloc options,
    # streamed or not unless they set the delay themselves
    asked = []
    for desloc in ({"outer_lr": 0.7}, {"param_sync_every": 8, "param_sync_delay": 2},
                   {"momentum_sync_every": 48, "moment_sync_topk": 8}):
        engine = workers.build_engine(workers.config("automatic", desloc=desloc))
        asked += [engine.optimizer._state_bytes("desloc", 2, streamed) for streamed in (False, True)]
        engine.destroy()
    return out, asked


@pytest.mark.integration
def test_state_bytes_count_what_the_modes_hold():
    """Each mode's ``state_bytes``, which automatic's memory check reads, against the bytes of the
    tensors the running mode holds (followed from the mode object, a 2-step run, fp32): equal but
    for what the count adds on purpose, desloc's fp32 gradient shard (4; this run's gradient sums
    are fp32 already) and DeMo's step transients (16: the gradient shard and the codec's 12),
    within 2% (payloads, padding); and what automatic asks them with the user's options."""
    held_and_stated, asked = run_ranks(_allocated_state, 2)[0]
    for (mode, options), (held, stated) in zip(STATE_CASES, held_and_stated):
        expected = held + (16 if mode == "demo" else 4)
        assert abs(stated - expected) <= 0.02 * expected, (mode, options, held, stated)
    # shards of 2: the outer step (16 + 8), streamed 24 more; the user's own delay streams either
    # way (16 + 24); compressed moment syncs (16 + 2·4) never stream
    assert asked == [12.0, 24.0, 20.0, 20.0, 12.0, 12.0]

ACCO_FIXED = {"accumulate_while_waiting": False, "balance": False}  # acco's timing-driven options off

# name: (ranks, accumulation steps, "lowcomm" keys, the link the probes report, what must be chosen)
# "moderate": r between FAST and SLOW; "slow": r >= SLOW; "nodes": slow between nodes of 2 ranks,
# fast inside one; None: this machine's own probes (loopback), whatever they choose
AUTO_CASES = {
    "probed": (2, 2, {"acco": ACCO_FIXED}, None, None),
    "acco": (2, 2, {"acco": ACCO_FIXED, "automatic": {"recheck_every": 1}}, "moderate", ("acco", None)),
    # an odd accumulation count rules acco out; the first micro-batch is a step's boundary
    "zero1-overlap": (2, 1, {}, "moderate", ("zero1", None)),
    "demo": (2, 2, {}, "slow", ("demo", 1)),
    # the user's local step is Muon: desloc with it, where AdamW's runs get demo; the user's Kx 4
    # runs, its syncs streamed behind 1 step (a quarter of it)
    "desloc-muon": (2, 2, {"desloc": {"inner_optimizer": "muon", "param_sync_every": 4}}, "slow", ("desloc", 1)),
    # the user's compressed moment syncs are synchronous: no streaming (else desloc would be refused)
    "desloc-moments": (2, 2, {"desloc": {"inner_optimizer": "muon", "param_sync_every": 4, "momentum_sync_every": 4,
                                         "moment_sync_topk": 8}}, "slow", ("desloc", 1)),
    # the user's own delay wins
    "desloc-own-delay": (2, 2, {"desloc": {"inner_optimizer": "muon", "param_sync_every": 4, "param_sync_delay": 2}},
                         "slow", ("desloc", 1)),
    "desloc-nodes": (4, 2, {}, "nodes", ("desloc", 2)),
}


#: the streaming delay each case with the user's Kx 4 runs: a quarter of it, none with compressed
#: moment syncs, the user's own
DELAYS = {"desloc-muon": 1, "desloc-moments": 0, "desloc-own-delay": 2}


def _link(kind):
    """Make the probes report ``kind`` (the timings only; the training is real)."""
    import os

    import torch.distributed as dist

    import ds_lowcomm.auto as auto
    import ds_lowcomm.optimizer as optimizer

    if kind == "moderate":
        auto.SLOW = math.inf
    if kind == "nodes":
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    if kind is not None:
        optimizer.predict_sync_s = lambda group, numel, device, control: (
            1e-9 if kind == "nodes" and dist.get_world_size(group) == 2 else 1e3)


def _auto_vs_fixed(rank, world, case, steps):
    """An "automatic" run and, on the same data, the mode it chose set by hand."""
    import logging

    import ds_lowcomm.auto as auto

    _, gas, lowcomm, link, _ = AUTO_CASES[case]
    _link(link)
    cfg = workers.config("automatic", **lowcomm)
    cfg["gradient_accumulation_steps"] = gas
    engine = workers.build_engine(cfg)
    l_auto = workers.train(engine, steps, rank=rank)
    chosen = engine.comm_stats()["automatic"]
    mode = chosen["mode"]
    fixed_lowcomm = {mode: {**chosen["options"], **lowcomm.get(mode, {})}}
    if chosen["shard_group_size"] is not None:
        fixed_lowcomm["shard_group_size"] = chosen["shard_group_size"]
    cfg = workers.config(mode, **fixed_lowcomm)
    cfg["gradient_accumulation_steps"] = gas
    fixed = workers.build_engine(cfg)
    l_fixed = workers.train(fixed, steps, rank=rank)
    for e in (engine, fixed):
        e.optimizer.flush()  # zero1 overlap gathers the last step's parameters during the next forward
    out = dict(chosen=chosen, losses=(l_auto, l_fixed), digests=[workers.params_digest(e) for e in (engine, fixed)],
               masters=[e.optimizer.master_weights() for e in (engine, fixed)],
               bytes=[e.comm_stats()["bytes_sent_per_step"] for e in (engine, fixed)], logged=[])
    if lowcomm.get("automatic", {}).get("recheck_every"):
        # the link's ratio is now past SLOW: the next re-check logs another verdict, and switches nothing
        handler = logging.Handler()
        handler.emit = lambda record: out["logged"].append(record.getMessage())
        logging.getLogger("ds_lowcomm").addHandler(handler)
        auto.SLOW = 0.0
        workers.train(engine, 1, start=steps, rank=rank)
        out["mode_after"] = engine.optimizer.mode_name
    return out


@pytest.mark.integration
@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_trains_as_the_mode_it_chose(case):
    """Every row of the table, end to end: the first micro-batch's gradient, computed before the
    choice on the whole world's layout, carries into the chosen one, and the run equals the chosen
    mode set by hand, bit for bit."""
    world, _, _, _, expected = AUTO_CASES[case]
    # the cases with a sync (at step 4) run past it, the others 3 steps
    results = run_ranks(_auto_vs_fixed, world, case, 6 if case.startswith("desloc-") and case != "desloc-nodes" else 3)
    for r in results:
        l_auto, l_fixed = r["losses"]
        assert l_auto == l_fixed
        assert r["digests"][0] == r["digests"][1]
        assert torch.equal(r["masters"][0], r["masters"][1])
        assert r["bytes"][0] == r["bytes"][1]  # the probes are not training's bytes
    chosen = results[0]["chosen"]
    assert all(r["chosen"] == chosen for r in results)  # one verdict
    if expected is not None:
        assert (chosen["mode"], chosen["shard_group_size"]) == expected
    if case == "zero1-overlap":
        assert chosen["options"] == {"overlap": True}
    if case == "desloc-nodes":  # r is far past 6 x 256
        assert chosen["options"]["param_sync_every"] == 256 and chosen["options"]["param_sync_delay"] == 64
        assert results[0]["digests"][0] == results[1]["digests"][0] != results[2]["digests"][0]  # 2 replicas
    if case in DELAYS:  # a sync at step 4, streamed or not
        assert chosen["options"]["param_sync_every"] == 4
        assert chosen["options"]["param_sync_delay"] == DELAYS[case]
    if case == "acco":
        assert any("would now choose demo" in m for m in results[0]["logged"]), results[0]["logged"]
        assert not any("would now choose" in m for m in results[1]["logged"])  # rank 0 alone re-checks
        assert all(r["mode_after"] == "acco" for r in results)


def _resume(rank, world, save_dir, first_mode):
    cfg_automatic = workers.config("automatic", shard_group_size=1) if first_mode == "automatic" else workers.config("automatic")
    straight = workers.build_engine(cfg_automatic if first_mode == "automatic" else workers.config(first_mode))
    l_straight = workers.train(straight, 6, rank=rank)
    first = workers.build_engine(cfg_automatic if first_mode == "automatic" else workers.config(first_mode))
    l_resumed = workers.train(first, 3, rank=rank)
    first.save_checkpoint(save_dir)
    second = workers.build_engine(cfg_automatic, seed=123)
    second.load_checkpoint(save_dir)
    l_resumed += workers.train(second, 3, start=3, rank=rank)
    return dict(losses=(l_straight, l_resumed), digests=[workers.params_digest(e) for e in (straight, second)],
                modes=[e.optimizer.mode_name for e in (straight, second)],
                chosen=second.comm_stats().get("automatic"))


@pytest.mark.integration
@pytest.mark.parametrize("first_mode", ["automatic", "zero1"])
def test_auto_resumes_in_the_checkpoints_mode(tmp_path, first_mode):
    """A restart of "automatic" takes the mode, picks and layout its checkpoint was written with (an
    "automatic" run's choice, or a fixed mode's), and continues exactly as the run that never stopped."""
    for r in run_ranks(_resume, 2, str(tmp_path), first_mode):
        l_straight, l_resumed = r["losses"]
        assert l_resumed == l_straight
        assert r["digests"][0] == r["digests"][1]
        expected = "demo" if first_mode == "automatic" else "zero1"
        assert r["modes"] == [expected, expected]
        assert r["chosen"]["mode"] == expected
        if first_mode == "automatic":
            assert r["chosen"]["options"]["topk"] == 256 and r["chosen"]["shard_group_size"] == 1
        else:
            assert r["chosen"]["shard_group_size"] is None and math.isfinite(l_resumed[-1])


def _resume_streamed(rank, world, save_dir, first_delay, resume_delay):
    """"automatic"'s desloc (the user's Muon and Kx 4 on a slow link: streamed a step behind),
    saved at step 4 with that step's sync in flight, resumed by "automatic"; ``first_delay``: the
    user's own param_sync_delay in the run that saves and the straight run (None: "automatic"'s),
    ``resume_delay`` in the run that resumes."""
    _link("slow")
    own = {"inner_optimizer": "muon", "param_sync_every": 4}
    with_delay = lambda delay: own if delay is None else {**own, "param_sync_delay": delay}  # noqa: E731
    first_cfg = workers.config("automatic", desloc=with_delay(first_delay))
    straight = workers.build_engine(first_cfg)
    l_straight = workers.train(straight, 6, rank=rank)
    first = workers.build_engine(first_cfg)
    l_resumed = workers.train(first, 4, rank=rank)
    first.save_checkpoint(save_dir)
    second = workers.build_engine(workers.config("automatic", desloc=with_delay(resume_delay)), seed=123)
    second.load_checkpoint(save_dir)
    l_resumed += workers.train(second, 2, start=4, rank=rank)
    return dict(losses=(l_straight, l_resumed), digests=[workers.params_digest(e) for e in (straight, second)],
                chosen=[e.comm_stats()["automatic"] for e in (straight, second)])


@pytest.mark.integration
@pytest.mark.parametrize("first_delay,resume_delay", [(None, None), (0, None), (2, None), (None, 0)])
def test_auto_resumes_a_streamed_sync_in_flight(tmp_path, first_delay, resume_delay):
    """A checkpoint of "automatic"'s streamed desloc, saved with a sync in flight, resumes exactly
    (the sync applied at the step it would have been). The delay recorded runs again, not fitted
    anew: a checkpoint that streamed nothing (the user's delay 0 there, as one of before streaming
    recorded none) resumes synchronous, and the user's own 2 stays 2, where this config would
    stream a step behind. The resuming config's own delay wins, and is what is reported."""
    for r in run_ranks(_resume_streamed, 2, str(tmp_path), first_delay, resume_delay):
        l_straight, l_resumed = r["losses"]
        ran = 1 if first_delay is None else first_delay
        if resume_delay is None:
            assert l_resumed == l_straight
            assert r["digests"][0] == r["digests"][1]
        assert [c["options"]["param_sync_delay"] for c in r["chosen"]] == [ran, ran if resume_delay is None
                                                                          else resume_delay]


def _save_before_choosing(rank, world, save_dir):
    import os

    engine = workers.build_engine(workers.config("automatic"))
    message = workers.raised(RuntimeError, engine.save_checkpoint, save_dir)
    return message, sorted(os.listdir(save_dir))


@pytest.mark.integration
def test_a_save_before_the_choice_is_refused_before_anything_is_written(tmp_path):
    for message, written in run_ranks(_save_before_choosing, 2, str(tmp_path)):
        assert message is not None and "before the first training micro-batch" in message
        assert written == []  # no tag, no latest


def _save_two_replicas(rank, world, save_dir):
    engine = workers.build_engine(workers.config("desloc", shard_group_size=2, desloc={"param_sync_every": 4}))
    workers.train(engine, 3, rank=rank)  # mid-period: the two replicas differ
    engine.save_checkpoint(save_dir)
    return engine.optimizer.master_weights()


def _resume_at_another_world(rank, world, save_dir):
    engine = workers.build_engine(workers.config("automatic"), seed=123)
    engine.load_checkpoint(save_dir)
    master = engine.optimizer.master_weights()
    losses = workers.train(engine, 1, start=3, rank=rank)
    return dict(chosen=engine.comm_stats()["automatic"], master=master, losses=losses)


@pytest.mark.integration
def test_auto_resumes_another_worlds_checkpoint_in_a_layout_that_divides_it(tmp_path):
    """A desloc checkpoint of 2 replicas of 2 ranks, resumed by "automatic" on 3 ranks: 2 does not
    divide 3, so it runs desloc with shard groups of gcd(2, 3) = 1, every replica starting from
    the mean of the two saved ones."""
    saved = run_ranks(_save_two_replicas, 4, str(tmp_path))
    assert not torch.equal(saved[0], saved[2])
    mean = (saved[0] + saved[2]) / 2
    for r in run_ranks(_resume_at_another_world, 3, str(tmp_path)):
        assert (r["chosen"]["mode"], r["chosen"]["shard_group_size"]) == ("desloc", 1)
        torch.testing.assert_close(r["master"], mean, rtol=0, atol=1e-7)
        assert math.isfinite(r["losses"][0])


def _forward_outside_the_engine(rank, world):
    import time

    engine = workers.build_engine(workers.config("automatic"))
    gas = engine.gradient_accumulation_steps()
    losses, backward_s = [], None
    for j in range(2 * gas):
        x = workers.batch(j // gas, j % gas, rank).to(engine.device)
        loss = engine.module(x, labels=x).loss  # not engine(x): the engine never sees the forward pass
        t0 = time.perf_counter()
        engine.backward(loss)
        if backward_s is None:
            backward_s = time.perf_counter() - t0
        engine.step()
        losses.append(loss.item())
    return dict(step_s=engine.optimizer.measured.step_s[rank], bound=1.5 * backward_s * gas,
                mode=engine.optimizer.mode_name, losses=losses)


@pytest.mark.integration
def test_auto_times_a_loop_that_runs_its_forward_outside_the_engine():
    """With no forward pass through the engine, the first micro-batch is timed from its backward
    pass (a forward is about half a backward: 1.5× the backward), and the run goes on."""
    for r in run_ranks(_forward_outside_the_engine, 2):
        assert 0 < r["step_s"] <= r["bound"]
        assert r["mode"] != "automatic" and all(math.isfinite(v) for v in r["losses"])
