"""Exact resume in every mode: a run saved, stopped and loaded into a fresh engine (another seed)
gives the losses, parameters and master weights of the run that never stopped.

One harness for every mode: it drives micro-batches one by one (backward and ``engine.step()``
each, DeepSpeed's loop), so the cut can fall mid-step where a mode allows it (acco, with a round
in flight). Loads at another world size: test_checkpoint.py.
"""
import os
import time

import pytest
import torch

import workers
from dist import run_ranks

pytestmark = pytest.mark.integration


def _config(mode, gas=2, bf16=False, **lowcomm):
    cfg = workers.config(mode, bf16=bf16, **lowcomm)
    cfg["gradient_accumulation_steps"] = gas
    return cfg


def _fp16(cfg):
    # An overflow at step 1 halves the scale; a short window doubles it again after the resume:
    # the scaler's state must come back with the checkpoint.
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "hysteresis": 1, "loss_scale_window": 3}
    return cfg


# name: (config, micro-batches in all, micro-batch after which the save falls)
CASES = {
    "zero1-fp32": (_config("zero1"), 16, 8),
    "zero1-bf16": (_config("zero1", bf16=True), 16, 8),
    "zero1-fp16": (_fp16(_config("zero1")), 16, 8),
    # mid-step, the estimate round in flight: its change from the model's parameters gathered
    # in bf16, not yet added to the model (estimate_dtype bf16, the default)
    "acco": (_config("acco", gas=4, acco={"variant": "acco", "accumulate_while_waiting": False}), 36, 19),
    # the real round in flight, its change gathered in bf16 (real_gather_dtype bf16, the default)
    "acco-real-change": (_config("acco", gas=4, acco={"variant": "acco", "accumulate_while_waiting": False}),
                         36, 17),
    # the paper's rounds (parameters gathered whole), the real round in flight at the save
    "acco-paper": (_config("acco", gas=4, acco={"variant": "acco", "accumulate_while_waiting": False,
                                                 "estimate_dtype": "fp32", "real_gather_dtype": "fp32"}), 36, 17),
    "demo": (_config("demo", shard_group_size=1), 16, 8),
    # step 4's update in flight at the save
    "demo-overlap": (_config("demo", shard_group_size=1, demo={"overlap": True}), 16, 8),
    # step 5: mid-period for θ (2), m (6) and v (12)
    "desloc": (_config("desloc", shard_group_size=1, desloc={"param_sync_every": 2}), 18, 10),
    # Muon as the local step: its momentum in exp_avg, saved per replica like AdamW's
    "desloc-muon": (_config("desloc", shard_group_size=1, desloc={"param_sync_every": 2,
                                                                   "inner_optimizer": "muon"}), 18, 10),
    # compressed parameter syncs: each replica's error buffer (what its syncs have not sent) saved
    "desloc-compressed": (_config("desloc", shard_group_size=1, desloc={"param_sync_every": 2, "sync_topk": 2,
                                                                         "sync_chunk": 16}), 18, 10),
    # int2 values, the last chunk of 60 holding 8 parameters: its padding picked, sent as ±lo
    "desloc-compressed-int2": (_config("desloc", shard_group_size=1, desloc={
        "param_sync_every": 2, "sync_topk": 10, "sync_chunk": 60, "sync_values": "int2"}), 18, 10),
    # compressed moment syncs (m at 2, 4, v at 3), mid-period for both at step 5: each replica's
    # moments hold what it has not sent, the anchors what the replicas agreed on; int2, the last
    # chunk of 60 holding 8 elements (its padding picked for the top 10 and sent, never kept)
    "desloc-compressed-moments": (_config("desloc", shard_group_size=1, desloc={
        "param_sync_every": 2, "momentum_sync_every": 2, "variance_sync_every": 3, "moment_sync_topk": 10,
        "sync_chunk": 60, "moment_sync_values": "int2"}), 18, 10),
    # with Muon: the second moment's sync packs the AdamW ranges
    "desloc-muon-compressed-moments": (_config("desloc", shard_group_size=1, desloc={
        "param_sync_every": 2, "momentum_sync_every": 2, "variance_sync_every": 3, "moment_sync_topk": 2,
        "sync_chunk": 16, "inner_optimizer": "muon"}), 18, 10),
    # a streamed parameter sync launched at step 4, applied at 6, in flight at the save after step 5
    "desloc-streamed": (_config("desloc", shard_group_size=1, desloc={"param_sync_every": 4,
                                                                       "param_sync_delay": 2}), 18, 10),
    # the moments launched with it too: each moment at the launch and its mean saved in flight
    "desloc-streamed-moments": (_config("desloc", shard_group_size=1, desloc={
        "param_sync_every": 4, "momentum_sync_every": 4, "variance_sync_every": 4,
        "param_sync_delay": 2}), 18, 10),
    # the same, compressed: the payload encoded at step 4, the anchor it moves saved in flight
    "desloc-compressed-streamed": (_config("desloc", shard_group_size=1, desloc={
        "param_sync_every": 4, "param_sync_delay": 2, "sync_topk": 2, "sync_chunk": 16}), 18, 10),
}


def _run(engine, rank, start, stop, losses, poison=None):
    losses.extend(workers.micro_batches(engine, start, stop, rank, poison))


def _straight_vs_resumed(rank, world, save_dir, case):
    workers.allow_fp16_on_this_cpu()
    cfg, total, cut = CASES[case]
    poison = {2: 1e8} if case.endswith("fp16") and rank == 0 else None  # step 1's first micro-batch

    straight = workers.build_engine(cfg)
    l_straight = []
    _run(straight, rank, 0, total, l_straight, poison)

    first = workers.build_engine(cfg)
    l_resumed = []
    _run(first, rank, 0, cut, l_resumed, poison)
    in_flight = getattr(first.optimizer.mode, "inflight", None)
    in_flight = None if in_flight is None or in_flight.round is None else (
        "delta" if in_flight.round.delta is not None else "result")
    syncs = getattr(first.optimizer.mode, "syncs", None)
    if syncs is not None and syncs.ticket is not None:
        in_flight = f"sync applied at round {syncs.finish_at}"
    first.save_checkpoint(save_dir, client_state={"j": cut})
    second = workers.build_engine(cfg, seed=123)  # everything must come from the checkpoint
    _, client = second.load_checkpoint(save_dir)
    _run(second, rank, client["j"], total, l_resumed)
    per_step = ("bytes_sent_per_step", "bytes_received_per_step")
    return dict(straight=l_straight, resumed=l_resumed, in_flight=in_flight,
                digests=[workers.params_digest(e) for e in (straight, second)],
                masters=[e.optimizer.master_weights() for e in (straight, second)],
                steps=[e.global_steps for e in (straight, second)],
                metrics=[{k: e.comm_stats()[k] for k in per_step} for e in (straight, second)],
                scales=[e.optimizer.loss_scale for e in (straight, first, second)],
                skipped=[e.skipped_steps for e in (straight, second)])


@pytest.mark.parametrize("case", list(CASES))
def test_resume(tmp_path, case):
    r0, r1 = run_ranks(_straight_vs_resumed, 2, str(tmp_path), case)
    for r in (r0, r1):
        assert r["resumed"] == r["straight"]  # exact, not approximately
        assert r["digests"][1] == r["digests"][0]
        assert torch.equal(r["masters"][1], r["masters"][0])
        assert r["steps"][1] == r["steps"][0] > 0
    if case.startswith("desloc"):
        assert r0["digests"][1] != r1["digests"][1]  # replicas differ mid-period, each resumed exactly
    elif case == "demo-overlap":
        # each rank's model is its own look-ahead point; the master the round installs is shared
        assert torch.equal(r0["masters"][1], r1["masters"][1])
    else:
        assert r0["digests"][1] == r1["digests"][1]
    if case in ("acco-paper", "demo-overlap"):
        assert r0["in_flight"] == r1["in_flight"] == "result"
    if case.endswith("streamed"):
        assert r0["in_flight"] == r1["in_flight"] == "sync applied at round 6"
    if case in ("acco", "acco-real-change"):
        assert r0["in_flight"] == r1["in_flight"] == "delta"
    if case.startswith("zero1") and case != "zero1-fp16":
        # Per-step bytes of the resumed process equal the uninterrupted run's (zero1 sends the
        # same every step), though it counted only the steps since the resume. (Under fp16 the
        # straight run's skipped step made one more small all-reduce.)
        straight, resumed = r0["metrics"]
        assert resumed == straight and straight["bytes_sent_per_step"] > 0
    if case == "zero1-fp16":
        # The scale went 4096 -> 2048 at the overflow and back up after the resume, as straight.
        straight, first, second = r0["scales"]
        assert first == 2048.0 and second == straight == 4096.0, r0["scales"]
        assert r0["skipped"] == [1, 1]


def _async_save(rank, world, save_dir):
    """A save with ``async_save`` on a slow disk: training goes on while the files are written."""
    import ds_lowcomm.checkpoint.checkpointer as checkpointer
    write = checkpointer.atomic_save

    def slow_disk(obj, path):
        time.sleep(1.0)  # the training thread runs two more steps meanwhile
        return write(obj, path)

    checkpointer.atomic_save = slow_disk
    cfg, total, cut = CASES["acco"]
    cfg = dict(cfg, lowcomm=dict(cfg["lowcomm"], async_save=True))
    first = workers.build_engine(cfg)
    l_first = []
    _run(first, rank, 0, cut, l_first)
    first.save_checkpoint(save_dir, client_state={"j": cut})
    published_at_return = os.path.exists(os.path.join(save_dir, "latest"))
    _run(first, rank, cut, total, l_first)  # changes the state the background thread is writing
    second = workers.build_engine(cfg, seed=123)
    _, client = second.load_checkpoint(save_dir)  # waits for the save
    l_second = []
    _run(second, rank, client["j"], total, l_second)
    digests = [workers.params_digest(e) for e in (first, second)]
    first.destroy()
    return dict(published_at_return=published_at_return, first=l_first[cut:], second=l_second, digests=digests)


def test_async_save_writes_the_state_of_the_save_step(tmp_path):
    for r in run_ranks(_async_save, 2, str(tmp_path)):
        assert not r["published_at_return"]  # save_checkpoint returned before the files were done
        assert len(r["first"]) == CASES["acco"][1] - CASES["acco"][2]
        assert r["second"] == r["first"]
        assert r["digests"][1] == r["digests"][0]


def _async_save_failure(rank, world, save_dir):
    """Rank 1's background write of global_step2 fails (a full disk); then a re-save of that tag
    on a slow disk, followed at once by destroy_process_group."""
    import json

    import torch.distributed as dist

    import ds_lowcomm.checkpoint.checkpointer as checkpointer
    from ds_lowcomm.checkpoint import CheckpointError
    write, attempts = checkpointer.atomic_save, []

    def disk(obj, path):
        attempts.append(os.path.basename(os.path.dirname(path)))
        if rank == 1 and attempts == ["global_step1", "global_step2"]:
            raise OSError(28, "No space left on device")
        time.sleep(0.5)
        return write(obj, path)

    checkpointer.atomic_save = disk
    engine = workers.build_engine(_config("zero1", async_save=True))
    _run(engine, rank, 0, 2, [])
    engine.save_checkpoint(save_dir)  # global_step1
    _run(engine, rank, 2, 4, [])
    engine.save_checkpoint(save_dir)  # global_step2: fails on rank 1 in the background
    try:
        engine.save_checkpoint(save_dir, tag="never")  # the failure surfaces here, nothing saved
        error = None
    except CheckpointError as err:
        error = str(err)
    with open(os.path.join(save_dir, "latest")) as f:
        latest_after_failure = f.read()
    engine.save_checkpoint(save_dir)  # global_step2 again, beside the half-written one, then swapped in
    dist.destroy_process_group()  # must wait for that save: it finishes on a group this tears down
    with open(os.path.join(save_dir, "latest")) as f:
        latest = f.read()
    with open(os.path.join(save_dir, "global_step2", "lowcomm_manifest.json")) as f:
        manifest = sorted(json.load(f)["files"])
    return dict(error=error, latest_after_failure=latest_after_failure, latest=latest, manifest=manifest,
                never=os.path.exists(os.path.join(save_dir, "never")))


def _model_write_failure(rank, world, save_dir):
    """Rank 0's DeepSpeed model file cannot be written (a full disk) in the second save."""
    from ds_lowcomm.checkpoint import CheckpointError

    engine = workers.build_engine(_config("zero1"))
    _run(engine, rank, 0, 2, [])
    engine.save_checkpoint(save_dir)  # global_step1
    _run(engine, rank, 2, 4, [])
    if rank == 0:
        def full_disk(state_dict, path):
            raise OSError(28, "No space left on device")
        engine.checkpoint_engine.save = full_disk
    t0 = time.time()
    try:
        engine.save_checkpoint(save_dir)  # global_step2
        error = None
    except CheckpointError as err:
        error = str(err)
    seconds = time.time() - t0
    with open(os.path.join(save_dir, "latest")) as f:
        latest = f.read()
    if rank == 0:
        del engine.checkpoint_engine.save
    engine.save_checkpoint(save_dir, tag="after")  # the disk has room again: saves as usual
    return dict(error=error, seconds=seconds, latest=latest, patched="save" in vars(engine.checkpoint_engine))


def test_a_failed_model_write_ends_the_save_on_every_rank(tmp_path):
    """DeepSpeed 0.19.8 raises a failed write on the failing rank alone, the others waiting in its
    barrier until the collective timeout: here every rank raises within seconds, naming the rank
    and the file, 'latest' unchanged, and the next save works."""
    for r in run_ranks(_model_write_failure, 2, str(tmp_path)):
        assert r["error"] is not None and "rank 0 could not write" in r["error"], r["error"]
        assert "mp_rank_00_model_states.pt" in r["error"] and "No space left on device" in r["error"]
        assert r["seconds"] < 20 and r["latest"] == "global_step1" and not r["patched"]
    assert (tmp_path / "latest").read_text() == "after"


def test_async_save_failure_is_raised_everywhere_and_loses_nothing(tmp_path):
    for r in run_ranks(_async_save_failure, 2, str(tmp_path)):
        assert r["error"] is not None and "rank 1 could not write" in r["error"], r["error"]
        assert "No space left on device" in r["error"]
        assert r["latest_after_failure"] == "global_step1" and not r["never"]
        assert r["latest"] == "global_step2"
        assert r["manifest"] == ["lowcomm_rank00000.pt", "lowcomm_rank00001.pt", "mp_rank_00_model_states.pt"]
