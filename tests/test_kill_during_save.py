"""A save killed while it re-saves a tag (same step: acco's step count stays put between saves, or
a user saves twice at one step) never damages the checkpoint ``latest`` names; and the
kill-during-save script (tests/kill_during_save.py) over a few seeds, so one seed's luck cannot
hide a failure."""
import os
import subprocess
import sys
from unittest import mock

import torch

import workers
from dist import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def _killed(*_args, **_kwargs):
    raise KeyboardInterrupt("killed")


def _resave_after_torn_swap(rank, world, save_dir):
    from ds_lowcomm.checkpoint import checkpointer

    engine = workers.build_engine(workers.config("zero1"))
    workers.train(engine, 1, rank=rank)
    engine.save_checkpoint(save_dir, tag="same")
    before = engine.optimizer.master_weights()
    workers.train(engine, 1, start=1, rank=rank)
    # Killed between the swap's renames: the tag's previous content is left under ".replaced"
    # (what loads), the new one under ".saving".
    rename = os.rename

    def killed_at_second_rename(src, dst):
        if str(src).endswith(checkpointer.STAGING):
            raise KeyboardInterrupt("killed")
        rename(src, dst)

    with mock.patch.object(checkpointer.os, "rename", side_effect=killed_at_second_rename):
        try:
            engine.save_checkpoint(save_dir, tag="same")
        except KeyboardInterrupt:
            pass
    out = {"after_swap_kill": sorted(n for n in os.listdir(save_dir) if n.startswith("same"))}
    # The resumed run saves that tag again and is killed while writing its file (before any
    # rename): the previous content must still be what loads, exactly.
    resumed = workers.build_engine(workers.config("zero1"), seed=3)
    resumed.load_checkpoint(save_dir)
    out["resumed_previous"] = torch.equal(resumed.optimizer.master_weights(), before)
    workers.train(resumed, 1, start=2, rank=rank)
    with mock.patch.object(checkpointer, "atomic_save", side_effect=_killed):
        try:
            resumed.save_checkpoint(save_dir, tag="same")
        except KeyboardInterrupt:
            pass
    with open(os.path.join(save_dir, "latest")) as f:
        out["latest"] = f.read()
    out["after_second_kill"] = sorted(n for n in os.listdir(save_dir) if n.startswith("same"))
    fresh = workers.build_engine(workers.config("zero1"), seed=4)
    try:
        fresh.load_checkpoint(save_dir)
        out["loads_previous"] = torch.equal(fresh.optimizer.master_weights(), before)
    except Exception as err:  # noqa: BLE001  (reported by the test)
        out["loads_previous"] = f"{type(err).__name__}: {err}"
    # A save that completes replaces it and cleans up.
    after = resumed.optimizer.master_weights()
    resumed.save_checkpoint(save_dir, tag="same")
    out["after_save"] = sorted(n for n in os.listdir(save_dir) if n.startswith("same"))
    fresh.load_checkpoint(save_dir)
    out["loads_new"] = torch.equal(fresh.optimizer.master_weights(), after)
    return out


def test_resave_killed_twice_keeps_the_previous_save(tmp_path):
    (out,) = run_ranks(_resave_after_torn_swap, 1, str(tmp_path))
    assert out["after_swap_kill"] == ["same.replaced", "same.saving"]
    assert out["resumed_previous"]
    assert out["latest"] == "same"
    assert out["loads_previous"] is True, out["loads_previous"]
    # Staged again beside it: the previous content under ".replaced" was not touched.
    assert "same.replaced" in out["after_second_kill"], out["after_second_kill"]
    assert out["after_save"] == ["same"]
    assert out["loads_new"]


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
