"""A rank that dies mid-training makes the survivors exit non-zero, quickly, saying what happened."""
import os
import subprocess
import sys
import time

import pytest

from dist import free_port

pytestmark = pytest.mark.integration

TIMEOUT_S = 12
HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("how", ["die", "stall"])
def test_lost_rank_stops_the_others(how):
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "rank_dies.py"), str(TIMEOUT_S), how],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
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
