"""A rank that dies mid-training makes the survivors exit non-zero, quickly, saying what happened;
a script that never tears down exits cleanly."""
import json
import os
import subprocess
import sys
import time

import pytest

from dist import free_port

pytestmark = pytest.mark.integration

TIMEOUT_S = 12
HERE = os.path.dirname(__file__)


def _launch(script, *args):
    """``script`` (beside this file) with ``args`` on 2 ranks, a process each, as torchrun would
    start them; returns the processes, stdout and stderr piped."""
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, script), *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.parametrize("how", ["die", "stall"])
def test_lost_rank_stops_the_others(how):
    procs = _launch("rank_dies.py", str(TIMEOUT_S), how)
    t0 = time.monotonic()
    try:
        out, err = procs[0].communicate(timeout=180)
    finally:
        for p in procs:
            p.kill()
    elapsed = time.monotonic() - t0
    assert procs[1].wait() == (3 if how == "die" else -9)
    assert procs[0].returncode != 0, out
    assert "finished all steps" not in out
    assert "CollectiveError" in err, err[-3000:]
    assert "failed on global rank 0" in err and "Another rank probably died" in err
    # Start-up plus 3 steps plus at most one collective timeout.
    assert elapsed < 60 + TIMEOUT_S, elapsed
    if how == "stall":
        assert elapsed >= TIMEOUT_S, "a stalled peer can only be detected by the timeout"
    print(f"{how}: survivor exited with {procs[0].returncode} after {elapsed:.1f}s: "
          f"{[l for l in err.splitlines() if 'CollectiveError' in l][-1]}")


def test_a_script_that_never_tears_down_exits_cleanly(tmp_path):
    """Most scripts end without ``engine.destroy()`` or ``destroy_process_group``; a comm thread
    still inside a collective when the interpreter finalizes aborts the rank (SIGABRT) after
    training succeeded. ds_lowcomm's exit handler destroys the engine first: with acco's last
    round and a preemption guard's all-reduce in flight at the end, both ranks exit 0, the comm
    thread stopped and ds_lowcomm's groups (the asynchronous saves' too) destroyed."""
    prefix = str(tmp_path / "rank")
    procs = _launch("ends_without_teardown.py", prefix, "end")
    try:
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0 and "trained" in out, err[-3000:]
        assert "terminate called" not in err, err[-3000:]
    for rank in range(2):
        report = json.loads(open(f"{prefix}{rank}.json").read())
        assert report == {"groups_registered": [], "threads_alive": [], "imported_before": False}, report


def test_a_rank_that_raises_exits_without_waiting_for_its_rounds(tmp_path):
    """After an uncaught exception the exit handler waits for nothing: rank 0 raises with a round
    in flight that rank 1 (alive, stopped) never joins, and exits within seconds, not after the
    60 s collective timeout its round would take to fail."""
    procs = _launch("ends_without_teardown.py", str(tmp_path / "rank"), "raise")
    try:
        out, err = procs[0].communicate(timeout=180)
        exited = time.time()
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode != 0 and "RuntimeError: a bug in the script" in err, err[-3000:]
    raised = float(out.split("raising at ")[1].split()[0])
    assert exited - raised < 20, exited - raised
