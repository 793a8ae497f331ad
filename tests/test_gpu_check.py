"""``tools/gpu_check.sh call1|call2 --dry-run``: the GPU check's two calls on the CPU, the same code
with a tiny model, the CPU accelerator and the host's clock, so that a typo cannot cost a session
its few minutes on a GPU (call 2 here on three modes; the GPU run takes every mode). The JSON each
call writes and the table it prints are read back."""
import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


def _dry_run(tmp_path, call, *extra):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    res = subprocess.run([str(ROOT / "tools" / "gpu_check.sh"), call, "--dry-run", *extra], env=env,
                         capture_output=True, text=True, timeout=600)
    assert (out / f"{call}.json").exists(), res.stdout[-3000:] + res.stderr[-3000:]
    assert (out / f"{call}.log").read_text() == res.stdout  # the log keeps what was printed
    return res, json.loads((out / f"{call}.json").read_text()), out


@pytest.mark.integration
def test_call1_dry_run(tmp_path):
    res, call1, out = _dry_run(tmp_path, "call1")
    assert res.returncode == 0, res.stdout[-3000:]
    engines = call1["engines"]
    assert list(engines) == gpu_check.CALL1_MODES and call1["versions"]["deepspeed"] == "0.19.8"
    for mode, e in engines.items():
        assert "error" not in e, (mode, e.get("traceback"))
        assert len(e["windows"]) == 3 and e["tokens_per_s"] > 0 and e["vs_zero1"] > 0, e
        assert isinstance(e["host_syncs"], dict) and "peak_allocated_mb" in e
    assert engines["zero1"]["vs_zero1"] == 1.0
    assert engines["acco"]["micro_batches_per_round"] >= 2 and "exposed_comm_s_per_step" in engines["acco"]
    # the Trainer's path: the loop's marks bound the engine, so acco's rounds are fixed there
    assert engines["acco-trainer"]["micro_batches_per_round"] == 3.0  # (an estimate of 2, a real round of 4)
    for mode in gpu_check.PROFILED:  # (on the CPU: the training thread's idle gaps between ops)
        assert engines[mode]["profile"]["gaps_over_50us_per_step"] >= 0, engines[mode]["profile"]
        assert (out / "traces" / f"{mode}.json.gz").exists()
    # what the device tool brings back: at most 8 files, no deeper than $OUT/a/b/file
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(
        ["call1.json", "call1.log", *(f"traces/{m}.json.gz" for m in gpu_check.PROFILED)])
    table = res.stdout[res.stdout.index("gpu_check call1 ("):]
    assert all(f"\n{mode} " in table for mode in gpu_check.CALL1_MODES), table


@pytest.mark.integration
def test_call2_dry_run(tmp_path):
    modes = ["acco", "acco-fixed", "desloc-int2"]
    res, call2, out = _dry_run(tmp_path, "call2", "--modes", ",".join(modes))
    checks = call2["checks"]
    # the CUDA tier collected and run (its CUDA tests skip here; the fakes of test_worker_cuda run)
    assert call2["cuda_tier"]["counts"].get("skipped") and call2["cuda_tier"]["ok"], call2["cuda_tier"]
    assert checks["sanitizer-acco"]["ok"], call2["sanitizer-acco"]
    for mode in modes:  # two ranks: replicas identical; the same run as the "CPU reference"
        assert checks[f"2ranks-{mode}"]["replicas_identical"], checks[f"2ranks-{mode}"]
        if mode != "acco":
            assert checks[f"2ranks-{mode}"]["rel"] == 0.0, checks[f"2ranks-{mode}"]
    # rank 1 slowed: the numbers the verdicts read are there (their order depends on this CPU's load)
    assert len(checks["slow-zero1-trainer"]["computed_share_by_rank"]) == 2
    assert len(checks["slow-acco-trainer"]["computed_share_by_rank"]) == 2
    assert len(checks["slow-acco"]["micro_batches_per_round_by_rank"]) == 2
    assert all(checks["timing"][m]["tokens_per_s"] > 0 for m in ("zero1", "zero1-overlap", "acco"))
    # acco with fixed rounds, saved (asynchronously) half way and resumed: the same run
    assert checks["resume"]["rel"] == 0.0 and checks["resume"]["same_parameters"], checks["resume"]
    assert res.returncode == (0 if all(c.get("ok") is not False for c in checks.values()) else 1)
    assert sorted(p.name for p in out.iterdir()) == ["call2.json", "call2.log", "call2_logs.tar.gz"]
    table = res.stdout[res.stdout.index("gpu_check call2 ("):]
    assert all(name in table for name in checks), table


@pytest.mark.unit
def test_profile_summary_counts_default_stream_gaps(tmp_path):
    """Gaps between the default stream's merged kernel, copy and memset intervals, per step; a
    side stream's kernels are not the default stream's busy time but counted where they overlap it."""
    trace = tmp_path / "trace.json"
    events = [{"cat": "kernel", "ts": a, "dur": d, "args": {"stream": s}}
              for a, d, s in [(0, 10, 7), (5, 10, 7), (100, 10, 7), (120, 5, 7), (300, 10, 7), (95, 20, 13)]]
    events.append({"cat": "gpu_memcpy", "ts": 140, "dur": 100, "args": {"stream": 7}})
    events.append({"cat": "cpu_op", "ts": 0, "dur": 1000, "tid": 1})
    trace.write_text(json.dumps({"traceEvents": events}))
    s = gpu_check.profile_summary(trace, steps=2)
    # merged: [0,15] [100,110] [120,125] [140,240] [300,310]: gaps 85, 10, 15, 60 -> two over 50 µs
    assert s["default_stream"] == "7" and s["gaps_over_50us"] == 2 and s["gaps_over_50us_per_step"] == 1.0
    assert s["gap_us_per_step"] == 72.5 and s["side_overlapping_default_us"] == 10.0
    assert s["streams"]["13"] == {"events": 1, "busy_us": 20.0}


@pytest.mark.unit
def test_sync_inventory_counts_whole_device_synchronizes(monkeypatch):
    """``torch.cuda.set_sync_debug_mode`` does not warn on ``torch.cuda.synchronize``, so the
    inventory wraps it while counting: a call is counted under its caller, one outside the
    window is not, a warning raised inside the wrapped call is not counted again, and the
    original is back after :meth:`stop`. The CUDA module is a recording fake here (this machine
    has no GPU); the counting is the tool's own code."""
    calls, modes = [], []

    def original(*a):
        calls.append(a)
        warnings.warn("called a synchronizing CUDA operation")  # as a debug mode that warned here would

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=original, set_sync_debug_mode=modes.append))
    inventory = gpu_check.SyncInventory()

    def timer_like():  # the caller the count names
        fake.cuda.synchronize(0)

    filters = warnings.filters[:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timer_like()
    inventory.start(fake)
    timer_like()
    timer_like()
    warnings.warn("called a synchronizing CUDA operation")  # a sync of another kind, counted once
    inventory.stop(fake)
    shown = warnings.showwarning
    assert fake.cuda.synchronize is original and len(calls) == 3 and modes == ["warn", "default"]
    assert shown != inventory.showwarning and warnings.filters == filters
    counts = dict(inventory.counts)
    sync = {k: n for k, n in counts.items() if k.startswith("synchronize@")}
    ((key, n),) = sync.items()
    assert n == 2 and key.startswith("synchronize@tests/test_gpu_check.py:") and "[MainThread]" in key, key
    assert sum(counts.values()) == 3, counts
    per_thread = inventory.per_thread(steps=2)
    assert list(per_thread) == ["MainThread"] and per_thread["MainThread"]["per_step"] == 1.5


@pytest.mark.unit
def test_memory_is_the_growth_over_the_engines_before(monkeypatch):
    """Each engine's peak allocated and reserved, read while it is built and warmed, less what
    the engines built before it hold (CUDA's allocator counters faked: no GPU here)."""
    import torch

    now = {"allocated": 3 << 20, "reserved": 8 << 20, "max_allocated": 0, "max_reserved": 0}
    for name, fn in {"synchronize": lambda *a: None, "empty_cache": lambda: None,
                     "reset_peak_memory_stats": lambda *a: now.update(max_allocated=now["allocated"],
                                                                       max_reserved=now["reserved"]),
                     "memory_allocated": lambda *a: now["allocated"], "memory_reserved": lambda *a: now["reserved"],
                     "max_memory_allocated": lambda *a: now["max_allocated"],
                     "max_memory_reserved": lambda *a: now["max_reserved"]}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    mark = gpu_check.memory_mark(cuda=True)
    now.update(allocated=5 << 20, max_allocated=10 << 20, max_reserved=20 << 20)  # the engine's build and steps
    assert gpu_check.memory_since(mark) == {"peak_allocated_mb": 7, "peak_reserved_mb": 12, "resident_mb": 2}
    assert gpu_check.memory_mark(cuda=False) is None and gpu_check.memory_since(None)["peak_allocated_mb"] is None


@pytest.mark.unit
def test_the_tables_show_what_a_gpu_run_reports():
    """The tables from results shaped as a GPU run's (memory, syncs by thread, an engine that
    failed, a call cut short, failed checks): what the dry runs cannot produce on the CPU."""
    e = {"tokens_per_s": 100_000.0, "vs_zero1": 0.5, "peak_allocated_mb": 6329, "peak_reserved_mb": 7848,
         "profile": {"gaps_over_50us_per_step": 1070.0}, "micro_batches_per_round": 3.9,
         "exposed_comm_s_per_step": 0.0123,
         "host_syncs": {"MainThread": {"per_step": 1.0}, "ds_lowcomm-comm": {"per_step": 4.0},
                        "Dummy-3": {"per_step": 0.5}}}
    res = {"versions": {"device": "NVIDIA H100"}, "params": 86_040_000, "steps": {"windows": 3, "window": 8},
           "engines": {"acco": e, "demo": {"error": "RuntimeError: CUDA out of memory"}},
           "timed_out": "past 215 s"}
    table = gpu_check.call1_table(res)
    assert "NVIDIA H100, 86.0M params" in table and "100,000" in table and "0.50" in table and "1070" in table
    assert "1 main, 4 comm, 0.5 Dummy-3" in table and "3.90" in table and "12.3" in table
    assert "demo" in table and "CUDA out of memory" in table and "TIMED OUT" in table
    checks = {"cuda_tier": {"counts": {"passed": 13}, "failed": [], "ok": True},
              "2ranks-acco": {"replicas_identical": False, "ok": False},
              "timing": {"zero1": {"tokens_per_s": 9e4, "vs_zero1": 1.0}, "acco": {"tokens_per_s": None,
                                                                                 "vs_zero1": None}, "ok": None}}
    table = gpu_check.call2_table({"versions": {"device": "NVIDIA H100"}, "seconds": 120.0, "checks": checks})
    assert "2ranks-acco             FAILED" in table and "90,000 tok/s, 1.00x zero1" in table and "- tok/s" in table
