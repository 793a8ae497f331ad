"""The order of ds_lowcomm's collectives, recorded on 4 real gloo ranks in every mode.

NCCL needs what gloo forgives: every rank issues the same collectives on each communicator in the
same order, and two communicators never have work in flight issued from two host threads at once
(NCCL promises no forward progress then: "Using multiple NCCL communicators concurrently";
NVIDIA/nccl#574). A recorder wraps every torch.distributed collective in each rank and logs, per
call, its communicator (the group's sorted global ranks and its creation index among groups of
those ranks, or "world"), op, numel, dtype, issuing thread, and the time from entry until it
returned (an ``async_op`` call: until its work's ``wait()``). Calls issued off the training
thread (the comm worker's) are held 10 ms before they start, widening each window the way a slow
link or a busy GPU would.

Asserted for each mode and option (against the other ranks' records, never a rank's own):

(a) per communicator, the sequence of (op, numel, dtype) is the same on every rank of it (an
    all-to-all with uneven splits: what each rank sends to each peer is what that peer receives);
(b) no two different communicators have calls in flight at the same moment from two different
    threads, except the groups asked for as gloo (the control group: CPU tensors on every backend,
    never an NCCL communicator);
(c) desloc with shard groups of 2, streamed or not, issues every call on its two communicators
    from the training thread (a streamed sync as asynchronous work): (b) whatever the timing.

The modes run as tests/test_modes.py builds them (a real ModeContext around its small torch model,
no DeepSpeed), all in one group of 4 ranks; "mode": "automatic" runs on a DeepSpeed engine (it
chooses there), made to see two nodes of 2 ranks behind a slow link: streamed desloc over
shard groups of 2, exactly the layout whose syncs once ran on the comm worker while the training
thread ran the local step's collectives.
"""
from __future__ import annotations

import inspect
import threading
import time

import pytest
import torch

from dist import run_ranks
from test_modes import HP, _data, _model

WORLD = 4
GAS, STEPS = 4, 6
#: seconds each collective issued off the training thread waits before it starts (in its window)
HOLD = 0.01
#: seconds of a micro-batch's compute where the ranks are uneven (three times that on the slow rank)
MICRO_SECONDS = 0.02

#: name: (the "lowcomm" section, the rank slowed down or None, a pacer's forced quota on rank 1 or None)
CASES = {
    "zero1": ({"mode": "zero1"}, None, None),
    "zero1-overlap": ({"mode": "zero1", "zero1": {"overlap": True}}, None, None),
    "acco": ({"mode": "acco", "acco": {"accumulate_while_waiting": False}}, None, None),
    # computing while waiting, rank 1 three times slower: the fast ranks launch at their own micro-batches,
    # balance lowers rank 1's quota, and the flush aligns the ranks' rounds over the control group
    "acco-aww-uneven": ({"mode": "acco", "acco": {"accumulate_while_waiting": True}}, 1, None),
    # lowcomm.pace: rank 1 computes one micro-batch of each round's two, the rest forward only
    "acco-paced": ({"mode": "acco", "acco": {"accumulate_while_waiting": False}}, 1, 1),
    "dpu-aww": ({"mode": "acco", "acco": {"variant": "dpu", "accumulate_while_waiting": True}}, 1, None),
    "demo": ({"mode": "demo", "shard_group_size": 2, "demo": {"chunk": 4, "topk": 3, "tiling": "flat"}},
             None, None),
    "demo-overlap": ({"mode": "demo", "shard_group_size": 2,
                      "demo": {"chunk": 4, "topk": 3, "tiling": "flat", "overlap": True, "lookahead": False}},
                     None, None),
    "desloc": ({"mode": "desloc", "shard_group_size": 2,
                "desloc": {"param_sync_every": 2, "momentum_sync_every": 2, "variance_sync_every": 3}}, None, None),
    # streamed with one rank per replica: the local step has no collective, the comm worker runs the syncs
    "desloc-streamed-s1": ({"mode": "desloc", "shard_group_size": 1,
                            "desloc": {"param_sync_every": 2, "param_sync_delay": 1, "momentum_sync_every": 2,
                                       "variance_sync_every": 4}}, None, None),
    # streamed over shard groups of 2: launched after steps 2, 4 and 6 with the first moment (at 4 the
    # second too), each applied a step later (the last by the flush)
    "desloc-streamed": ({"mode": "desloc", "shard_group_size": 2,
                         "desloc": {"param_sync_every": 2, "param_sync_delay": 1, "momentum_sync_every": 2,
                                    "variance_sync_every": 4}}, None, None),
    # launched after step 4 with both moments, the first moment averaged again at step 6 while it
    # flies (the sync completed first), applied by the flush
    "desloc-streamed-late": ({"mode": "desloc", "shard_group_size": 2,
                              "desloc": {"param_sync_every": 4, "param_sync_delay": 3, "momentum_sync_every": 2,
                                         "variance_sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9}},
                             None, None),
    "desloc-streamed-compressed": ({"mode": "desloc", "shard_group_size": 2,
                                    "desloc": {"param_sync_every": 2, "param_sync_delay": 1, "sync_topk": 2,
                                               "sync_chunk": 16, "outer_lr": 0.7}}, None, None),
    # Muon: a matrix cut by the shard boundary all-reduced inside the shard group every step, the
    # second moment's sync packing the AdamW ranges
    "desloc-streamed-muon": ({"mode": "desloc", "shard_group_size": 2,
                              "desloc": {"param_sync_every": 2, "param_sync_delay": 1, "momentum_sync_every": 2,
                                         "variance_sync_every": 2, "inner_optimizer": "muon"}}, None, None),
}

#: the torch.distributed functions that issue collectives (the object ones, point to point too)
COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather",
               "all_gather_into_tensor", "all_gather_single", "all_to_all", "all_to_all_single", "broadcast",
               "reduce", "gather", "scatter", "barrier", "all_gather_object", "broadcast_object_list",
               "gather_object", "scatter_object_list", "send", "recv", "isend", "irecv")


class Recorder:
    """Wraps the collectives of torch.distributed (and the ones ds_lowcomm.comm.collectives bound
    at import) in this process; :attr:`log` holds one dict per call, :attr:`host_groups` the labels
    of the groups created with ``backend="gloo"``."""

    def __init__(self) -> None:
        import torch.distributed as dist

        import ds_lowcomm.comm.collectives as collectives

        self.dist = dist
        self.log: list = []
        self.labels: dict = {}  # id(group) -> (label, group)
        self.host_groups: set = set()
        self._local = threading.local()
        self._lock = threading.Lock()
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))
        for bound in ("_reduce_scatter", "_all_gather"):  # bound by name at import
            if hasattr(collectives, bound):
                fn = getattr(collectives, bound)
                setattr(collectives, bound, self._wrap(fn.__name__, fn))
        new_group = dist.new_group

        def recorded_new_group(ranks=None, *args, **kwargs):
            group = new_group(ranks, *args, **kwargs)
            members = tuple(sorted(range(dist.get_world_size()) if ranks is None else ranks))
            index = sum(label.startswith(f"{members}#") for label, _ in self.labels.values())
            label = f"{members}#{index}"
            self.labels[id(group)] = (label, group)  # (the group kept alive: its id stays its own)
            if kwargs.get("backend") == "gloo":
                self.host_groups.add(label)
            return group

        dist.new_group = recorded_new_group

    def label(self, group) -> str:
        if group is None or group is self.dist.GroupMember.WORLD or group is self.dist.group.WORLD:
            return "world"
        if id(group) in self.labels:
            return self.labels[id(group)][0]
        return f"{tuple(sorted(self.dist.get_process_group_ranks(group)))}?"

    def _wrap(self, name, fn):
        signature = inspect.signature(fn)
        recorder = self

        def wrapped(*args, **kwargs):
            if getattr(recorder._local, "inside", False):  # a collective calling another: the outer one counts
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            arguments = bound.arguments
            tensors = [v for v in arguments.values() if isinstance(v, torch.Tensor)]
            first = tensors[0] if tensors else None
            entry = {"op": name, "group": recorder.label(arguments.get("group")),
                     "numel": None if first is None else first.numel(),
                     "dtype": None if first is None else str(first.dtype),
                     "thread": threading.current_thread().name, "start": time.monotonic(), "end": None}
            if name == "all_to_all_single" and (arguments.get("output_split_sizes") or arguments.get("input_split_sizes")):
                # uneven splits: sizes differ by rank by design; checked pairwise instead
                entry["numel"] = None
                entry["splits"] = (list(arguments.get("input_split_sizes") or []),
                                   list(arguments.get("output_split_sizes") or []))
            with recorder._lock:
                recorder.log.append(entry)
            if threading.current_thread() is not threading.main_thread():
                time.sleep(HOLD)
            recorder._local.inside = True
            try:
                out = fn(*args, **kwargs)
            finally:
                recorder._local.inside = False
            if arguments.get("async_op") and out is not None:
                return _Work(out, entry)
            entry["end"] = time.monotonic()
            return out

        wrapped.__name__ = name
        return wrapped


class _Work:
    """An ``async_op`` call's work: in flight until ``wait()`` returns (or it reports completion)."""

    def __init__(self, work, entry) -> None:
        self._work, self._entry = work, entry

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if self._entry["end"] is None:
            self._entry["end"] = time.monotonic()
        return out

    def is_completed(self):
        done = self._work.is_completed()
        if done and self._entry["end"] is None:
            self._entry["end"] = time.monotonic()
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _run_mode(rank, case):
    """``STEPS`` steps of the case's mode in a DeepSpeed-style loop (no boundaries marked, a step
    after each GAS micro-batches), then a flush, on a topology of its own."""
    import workers
    from ds_lowcomm.modes import MODES

    lowcomm, slow, keep = CASES[case]
    model = _model()
    cfg, ctx, steps = workers.mode_context(lowcomm, model, GAS, HP, paced=keep is not None)
    grads, pacer, mode_cls = ctx.grads, ctx.pacer, MODES[cfg.mode]
    mode = mode_cls(ctx, cfg.mode_options)
    mode.bind_loop(False)
    if pacer is not None:
        pacer.active = True  # "pace": "fastest"
        if rank == 1:  # as tests/test_pace.py forces it: whatever the paces say
            pacer.quota = keep
            pacer.update = lambda paces: None
    for t in range(STEPS):
        grads.attach()
        for m in range(GAS):
            boundary = m == GAS - 1
            computed = True if pacer is None else pacer.begin_micro_batch()
            mode.on_backward_start(boundary)
            x, y = _data(rank, t, m)
            if computed:
                (torch.nn.functional.mse_loss(model(x), y) / GAS).backward()
                if slow is not None:  # uneven ranks: a micro-batch takes 20 ms, 60 ms on the slow one
                    time.sleep(MICRO_SECONDS * (3 if rank == slow else 1))
            else:
                with torch.no_grad():
                    model(x)
            if pacer is not None:
                pacer.end_micro_batch()
            grads.count(computed, 1.0)
            mode.on_micro_batch_end(boundary)
        mode.step()  # (acco and DPU: steps driven from the micro-batches; nothing here)
    mode.flush()
    if ctx.worker is not None:
        ctx.worker.close()
    ctx.topology.close(control=True)
    return steps[0]


def _record_modes(rank, world, cases):
    recorder = Recorder()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for case in cases:
        recorder.log = []
        try:
            steps = _run_mode(rank, case)
            out[case] = dict(log=recorder.log, hosts=set(recorder.host_groups), steps=steps, error=None)
        except Exception as err:  # reported by the case's test; the other cases go on
            import traceback

            out[case] = dict(log=recorder.log, hosts=set(recorder.host_groups), steps=None,
                             error=f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
            break  # the ranks may now disagree on what comes next
    torch.distributed.destroy_process_group()
    return out


def _members(label):
    return tuple(range(WORLD)) if label == "world" else tuple(int(r) for r in label.split("#")[0].strip("()?").split(",") if r.strip())


def check(logs, hosts):
    """Assert (a) and (b) of the module doc over the ranks' ``logs`` (one list of calls per rank);
    ``hosts``: labels of the groups asked for as gloo. Returns the communicators seen."""
    by_group = {}
    for rank, log in enumerate(logs):
        for entry in log:
            by_group.setdefault(entry["group"], {}).setdefault(rank, []).append(entry)
    for label, per_rank in by_group.items():
        members = _members(label)
        assert set(per_rank) <= set(members), (label, sorted(per_rank))
        seqs = {r: [(e["op"], e["numel"], e["dtype"]) for e in per_rank.get(r, [])] for r in members}
        first = members[0]
        for r in members[1:]:
            if seqs[r] != seqs[first]:
                raise AssertionError(f"communicator {label}: rank {r} issued {_first_difference(seqs[first], seqs[r])} "
                                     f"against rank {first}")
        for k, entry in enumerate(per_rank[first]):  # uneven all-to-alls: sends match receives
            if "splits" in entry:
                splits = {r: per_rank[r][k]["splits"] for r in members}
                for i, a in enumerate(members):
                    for j, b in enumerate(members):
                        sent, received = splits[a][0], splits[b][1]
                        assert sent[j] == received[i], (label, k, a, b, splits)
    for rank, log in enumerate(logs):
        calls = [e for e in log if e["group"] not in hosts]
        assert all(e["end"] is not None for e in calls), [e for e in calls if e["end"] is None]
        calls.sort(key=lambda e: e["start"])
        for i, a in enumerate(calls):
            for b in calls[i + 1:]:
                if b["start"] >= a["end"]:
                    continue  # (b starts later than a; later ones start later still, but a may be long)
                if a["group"] != b["group"] and a["thread"] != b["thread"]:
                    raise AssertionError(f"rank {rank}: {a['op']} on {a['group']} from thread {a['thread']} in "
                                         f"flight while {b['op']} on {b['group']} from thread {b['thread']} ran")
    return set(by_group)


def _first_difference(a, b):
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"call {k}: {y} where it issued {x}"
    return f"{len(b)} calls where it issued {len(a)}"


@pytest.fixture(scope="module")
def recorded():
    return run_ranks(_record_modes, WORLD, list(CASES), timeout=240)


@pytest.mark.ranks
@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_issues_the_same_collectives_and_no_two_threads_cross(recorded, case):
    """Each mode's calls over 6 steps and a flush, per communicator, equal on every rank; no two
    communicators in flight from two threads (module doc). With shard groups of 2 both kinds of
    communicator are used; desloc's calls all come from the training thread, and a streamed
    sync is still in flight when the next step's shard collectives begin."""
    results = [r.get(case) for r in recorded]
    assert all(r is not None for r in results), "an earlier case failed on some rank: see its test"
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    assert all(r["steps"] >= 1 for r in results), [r["steps"] for r in results]  # real rounds ran
    seen = {_members(label) for label in check([r["log"] for r in results], results[0]["hosts"])}
    lowcomm = CASES[case][0]
    if lowcomm.get("shard_group_size") == 2:  # shard groups (0,1), (2,3); replica groups (0,2), (1,3)
        assert {(0, 1), (2, 3), (0, 2), (1, 3)} <= seen, seen
        if lowcomm["mode"] == "desloc":  # both communicators' calls from one thread, whatever the timing
            assert all(_threads(r["log"], r["hosts"]) == {"MainThread"} for r in results), \
                [_threads(r["log"], r["hosts"]) for r in results]
        if lowcomm.get("desloc", {}).get("param_sync_delay"):
            assert all(_streamed_beside_steps(r["log"]) for r in results)


def _streamed_beside_steps(log):
    """Whether a replica-group call was still in flight (not waited for) when a later step's
    reduce-scatter or norm began on the shard group: the steps after a streamed sync's launch do
    not wait for it (at shard groups of 2, what test_modes.py's held sync shows at 1)."""
    replica = [e for e in log if _members(e["group"]) in ((0, 2), (1, 3))]
    shard = [e for e in log if _members(e["group"]) in ((0, 1), (2, 3)) and "gather" not in e["op"]]
    return any(r["start"] < s["start"] < r["end"] for r in replica for s in shard)


def _threads(log, hosts):
    """The threads that issued a rank's calls on communicators other than the gloo host groups."""
    return {e["thread"] for e in log if e["group"] not in hosts}


def _record_automatic(rank, world):
    """"mode": "automatic" on a DeepSpeed engine that sees 2 nodes of 2 ranks, the link between
    them slow and the one inside fast (the probes made to report so, as tests/test_auto.py does):
    desloc over shard groups of 2, the user's Kx 4 streamed a quarter of it behind."""
    import os

    import torch.distributed as dist

    import ds_lowcomm.optimizer as optimizer
    import workers

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    optimizer.predict_sync_s = lambda group, numel, device, control: (
        1e-9 if dist.get_world_size(group) == 2 else 1e3)
    recorder = Recorder()
    engine = workers.build_engine(workers.config("automatic", desloc={"param_sync_every": 4,
                                                                      "momentum_sync_every": 4}))
    workers.train(engine, STEPS, rank=rank)
    engine.optimizer.flush()
    chosen = engine.comm_stats()["automatic"]
    engine.destroy()
    return dict(log=recorder.log, hosts=recorder.host_groups, chosen=chosen)


@pytest.mark.integration
def test_automatic_on_two_nodes_issues_the_same_collectives_and_no_two_threads_cross():
    """"automatic"'s choice on two nodes behind a slow link, streamed desloc with shard groups of
    2, trained 6 steps (a sync launched after step 4 with the first moment, applied after step 5)
    and flushed: (a), (b) and (c) of the module doc over every collective the engine's ranks
    issued, DeepSpeed's own included; the sync still in flight when step 5's shard collectives
    begin."""
    results = run_ranks(_record_automatic, WORLD, timeout=240)
    chosen = results[0]["chosen"]
    assert chosen["mode"] == "desloc" and chosen["shard_group_size"] == 2, chosen
    assert chosen["options"]["param_sync_delay"] == 1, chosen
    seen = {_members(label) for label in check([r["log"] for r in results], results[0]["hosts"])}
    assert {(0, 1), (2, 3), (0, 2), (1, 3)} <= seen, seen
    assert all(_threads(r["log"], r["hosts"]) == {"MainThread"} for r in results), \
        [_threads(r["log"], r["hosts"]) for r in results]
    assert all(_streamed_beside_steps(r["log"]) for r in results)
