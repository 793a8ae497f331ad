"""Elastic restarts under torchrun: the warning for torch's shared rendezvous store, and
tools/elastic_restarts.py's trial (2 agents of 2 ranks, one killed, the survivor restarts from the
newest checkpoint at 2 ranks and finishes)."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
@pytest.mark.parametrize("env, warns", [
    ({"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}, True),
    ({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),  # a first start
    ({"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),  # the fix in place
    ({}, False),  # not under torchrun
], ids=["restart-shared", "first-start", "own-store", "no-torchrun"])
def test_a_restart_on_the_shared_store_names_the_fix(caplog, env, warns):
    from ds_lowcomm.integration.initialize import warn_shared_rendezvous_store

    with caplog.at_level(logging.WARNING, logger="ds_lowcomm"):
        assert warn_shared_rendezvous_store(env) is warns
    assert ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text) is warns


@pytest.mark.integration
def test_a_killed_node_restarts_from_the_newest_checkpoint(tmp_path):
    """One kill, desloc (the tool's default reports 20 per mode): the survivor resumes from the
    last save at or before the kill and finishes. With torch's shared rendezvous store (the tool
    turns it off) the restarted workers failed to connect in 5 of 6 trials on a 2-core machine."""
    out = tmp_path / "trials.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "elastic_restarts.py"), "--kills", "1", "--modes",
                           "desloc", "--max-steps", "20", "--save-every", "5", "--seed", "3", "--json", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (trial,) = json.loads(out.read_text())
    assert trial["finished"] and trial["exit"] == 0
    assert trial["resumed_from"] % 5 == 0 and 0 <= trial["steps_lost"] <= 5
    assert trial["resumed_from"] <= trial["kill_at"]
    assert 0 < trial["seconds_to_first_step"] < 120
    assert "| desloc | 1 of 1 |" in proc.stdout
