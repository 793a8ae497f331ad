"""The kill-during-save script (tests/kill_during_save.py) over a few seeds, so one seed's luck
cannot hide a failure; a save killed twice at one tag, by hand, is test_checkpoint.py's."""
import pytest
import os
import subprocess
import sys

pytestmark = pytest.mark.integration

HERE = os.path.dirname(os.path.abspath(__file__))


#: acco kills that re-save the tag latest names, at an I/O point (the same kill every run) before the
#: new content is swapped in: rank 1 before writing its file (seed 11), rank 0 at the barrier after
#: DeepSpeed's files (seed 40). The checkpoint must load the previous save of that tag, which has
#: other weights (a flush came between). Each fails if the tag is rewritten in place, and each
#: failed when the script expected the killed save's weights.
SEEDS = "11,40"


def test_kill_during_save_script_over_seeds():
    """The script itself (2-rank jobs, SIGKILL), a few seeds; the full check:
    ``--trials 4 --modes zero1,acco,desloc --seeds 0-9`` (with and without ``--resave``)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "kill_during_save.py"), "--trials", "1",
                           "--modes", "acco", "--resave", "--seeds", SEEDS],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "0 failed trial(s)" in proc.stdout
    trials = [l for l in proc.stdout.splitlines() if l.startswith("OK ")]
    assert len(trials) == 2 and all("re-saving latest" in l and "resumed previous" in l for l in trials), trials
