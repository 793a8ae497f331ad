"""``tools/gpu_check.sh --dry-run``: the GPU check's whole plan on the CPU, so it keeps working
between the rare runs on a GPU machine (two modes here, acco for its call-2 checks and desloc-int2
for the comm worker's streamed syncs; the GPU run takes every mode)."""
import pytest
import json
import os
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    res = subprocess.run([str(ROOT / "tools" / "gpu_check.sh"), "all", str(out), "--dry-run",
                          "--modes", "acco,desloc-int2", "--jobs", "2"], env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    call1, call2, call3 = (json.loads((out / f"call{i}.json").read_text()) for i in (1, 2, 3))
    assert call1["versions"]["deepspeed"] == "0.19.8"
    assert {k for k, v in call1["runs"].items() if "final_train_loss" in v} == {"acco-fp32", "desloc-int2-fp32"}
    checks = call2["checks"]
    # desloc (Muon, int2 syncs streamed 2 steps behind): the run ends on a sync, flushed by
    # examples/train.py, so its replicas agree bit for bit as the others' do
    assert all(checks[m]["replicas_identical"] for m in ("acco", "desloc-int2")), checks
    # acco with fixed rounds, saved (asynchronously) at half way and resumed: the same loss as
    # the run that was never interrupted
    assert checks["acco-async-save-resume"]["rel"] == 0.0, checks["acco-async-save-resume"]
    mb = checks["acco-slow"]["micro_batches_per_round"]
    assert mb[0] > mb[1], mb  # the slowed rank 1 computes fewer
    assert all(call3[m]["tokens_per_s"] > 0 for m in ("acco", "desloc-int2"))
    assert call3["newton_schulz"]["one_at_a_time_ms"] > 0 and call3["newton_schulz"]["batched_ms"] > 0


def test_sync_inventory_counts_whole_device_synchronizes(monkeypatch):
    """``torch.cuda.set_sync_debug_mode`` does not warn on ``torch.cuda.synchronize``, so the
    inventory wraps it while counting: a call is counted under its caller, one outside the
    window is not, and the original is back after :meth:`stop`. The CUDA module is a recording
    fake here (this machine has no GPU); the counting is the tool's own code."""
    import types

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import gpu_check

    calls, modes = [], []
    original = lambda *a: calls.append(a)  # noqa: E731
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=original, set_sync_debug_mode=modes.append))
    inventory = gpu_check.SyncInventory()

    def timer_like():  # the caller the count names
        fake.cuda.synchronize(0)

    timer_like()
    inventory.start(fake)
    timer_like()
    timer_like()
    inventory.stop(fake)
    timer_like()
    import warnings

    shown = warnings.showwarning
    assert fake.cuda.synchronize is original and len(calls) == 4 and modes == ["warn", "default"]
    assert shown != inventory.showwarning  # (bound methods compare by function and instance)
    ((key, n),) = inventory.counts.items()
    assert n == 2 and key.startswith("synchronize@tests/test_gpu_check.py:") and "[MainThread]" in key, key
