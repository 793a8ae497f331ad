"""The GPU check: what a machine with one CUDA GPU can tell us about the CUDA/NCCL path, in three
short calls, each saving its results as JSON (and its logs) under ``--out``.

    python tools/gpu_check.py call1 --out DIR    # one GPU, NCCL: correctness
    python tools/gpu_check.py call2 --out DIR    # two ranks on one GPU over gloo: the side stream
    python tools/gpu_check.py call3 --out DIR    # a GPT-2-124M-size model in bf16: speed, memory
    python tools/gpu_check.py all --dry-run --out DIR   # the whole plan on CPU, tiny settings

``tools/gpu_check.sh`` installs the wheels a bare GPU machine lacks and calls this. Every run is
``examples/train.py`` (or the CUDA test tier), under a time limit, launched by
``torch.distributed.run`` through this file's ``rank`` entry, which can put two ranks on one GPU
over gloo (NCCL refuses two ranks on one device), enable ``torch.cuda.set_sync_debug_mode`` for
two warm steps (the host-sync inventory) and profile steps with ``torch.profiler``.

What one GPU cannot check: NCCL collectives between GPUs, concurrency across communicators,
NCCL's watchdog and timeouts, communication hidden between devices.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: each mode's "lowcomm" section (None: stock DeepSpeed ZeRO-1)
MODES = {
    "stock": None,
    "zero1": {"mode": "zero1"},
    "zero1-overlap": {"mode": "zero1", "zero1": {"overlap": True}},
    "acco": {"mode": "acco", "acco": {"variant": "acco"}},
    "demo-overlap": {"mode": "demo", "shard_group_size": 1,
                     "demo": {"overlap": True, "topk": 64, "chunk": 64, "values": "sign", "tiling": "matrix"}},
    "desloc": {"mode": "desloc", "shard_group_size": 1,
               "desloc": {"param_sync_every": 16, "momentum_sync_every": 48, "variance_sync_every": 96}},
    # Muon's local step, synchronous syncs
    "desloc-muon": {"mode": "desloc", "shard_group_size": 1,
                    "desloc": {"param_sync_every": 16, "momentum_sync_every": 32, "variance_sync_every": 64,
                               "inner_optimizer": "muon"}},
    # Muon's local step, the syncs streamed 2 steps behind on the comm worker, the moments with them
    "desloc-streamed": {"mode": "desloc", "shard_group_size": 1,
                        "desloc": {"param_sync_every": 16, "momentum_sync_every": 32, "variance_sync_every": 64,
                                   "param_sync_delay": 2, "inner_optimizer": "muon"}},
    # the same, the parameter syncs compressed to int2 (top-4 of 64), the moments never averaged
    "desloc-int2": {"mode": "desloc", "shard_group_size": 1,
                    "desloc": {"param_sync_every": 16, "momentum_sync_every": 0, "variance_sync_every": 0,
                               "sync_topk": 4, "sync_values": "int2", "param_sync_delay": 2,
                               "inner_optimizer": "muon"}},
}
ACCO_FIXED = {"acco": {"variant": "acco", "accumulate_while_waiting": False, "balance": False}}
#: relative tolerance of zero1's final training loss against stock DeepSpeed's on the same device
PARITY = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2}
#: two-rank runs: each mode's final loss within this of the CPU reference
CPU_REFERENCE_TOLERANCE = 0.02


def every_4(mode: str) -> dict | None:
    """desloc's replicas agree right after a parameter sync (a streamed one once
    ``examples/train.py`` flushes it at the end): syncs every 4 steps, the last one included, and
    the moments every 8 and 16 where they are averaged at all. None for the other modes."""
    if (MODES[mode] or {}).get("mode") != "desloc":
        return None
    desloc = dict(MODES[mode]["desloc"], param_sync_every=4)
    for key, every in (("momentum_sync_every", 8), ("variance_sync_every", 16)):
        if desloc[key]:
            desloc[key] = every
    return {"desloc": desloc}


def config(mode: str, dtype: str, steps: int, mbs: int, gas: int, lowcomm: dict | None = None) -> dict:
    """A DeepSpeed config for ``mode`` in ``dtype``: the shipped zero1.json's optimizer and
    schedule (resized to ``steps``), stock DeepSpeed with torch's AdamW (no JIT build)."""
    cfg = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas)
    cfg["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=max(1, steps // 10))
    cfg.pop("lowcomm")
    if MODES[mode] is None:
        cfg["optimizer"] = {"type": "AdamW", "params": {**cfg["optimizer"]["params"], "torch_adam": True}}
    else:
        cfg["lowcomm"] = {**MODES[mode], **(lowcomm or {})}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return cfg


# -- one rank (under torch.distributed.run) --------------------------------------------------------

class SyncInventory:
    """Host syncs by (file:line, thread) while ``torch.cuda.set_sync_debug_mode("warn")`` is on:
    each synchronizing CUDA call warns; the innermost frame of ours (ds_lowcomm, examples) or,
    failing that, the caller's is counted. ``torch.cuda.synchronize`` (a whole device, every
    stream) does not warn in that mode, so :meth:`start` wraps it to count it too, as
    ``synchronize@`` its caller (DeepSpeed's throughput timer makes one unless told not to)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self._synchronize = None

    def _count(self, prefix: str = "") -> None:
        frames = traceback.extract_stack()[:-2]
        ours = [f for f in frames if "ds_lowcomm" in f.filename or "examples" in f.filename]
        if prefix:  # the caller of the accelerator's synchronize (DeepSpeed's timer, say)
            where = next((f for f in reversed(frames) if "deepspeed/accelerator/" not in f.filename), frames[-1])
        else:
            where = ours[-1] if ours else frames[-1]
        name = os.path.relpath(where.filename, ROOT) if str(ROOT) in where.filename else where.filename
        key = f"{prefix}{name}:{where.lineno} [{threading.current_thread().name}]"
        with self.lock:
            self.counts[key] += 1

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            self._count()

    def start(self, torch) -> None:
        """Count from now: the debug mode's warnings and every ``torch.cuda.synchronize``."""
        import warnings

        self._showwarning, warnings.showwarning = warnings.showwarning, self.showwarning
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        real = self._synchronize = torch.cuda.synchronize

        def synchronize(*a, **k):
            self._count("synchronize@")
            return real(*a, **k)
        torch.cuda.synchronize = synchronize

    def stop(self, torch) -> None:
        """Stop counting: the debug mode, ``showwarning`` and ``torch.cuda.synchronize`` as they were."""
        import warnings

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._showwarning
        if self._synchronize is not None:
            torch.cuda.synchronize, self._synchronize = self._synchronize, None


def rank_main(argv) -> None:
    """One rank of ``examples/train.py`` with ``argv``; see the module's doc."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--one-gpu-gloo", action="store_true")
    ap.add_argument("--sync-inventory", default=None, metavar="FILE")
    ap.add_argument("--profile", default=None, metavar="FILE")
    ap.add_argument("--result", required=True)
    ap.add_argument("train_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    if args.one_gpu_gloo:  # every rank on device 0; DeepSpeed reuses the group it finds
        os.environ["LOCAL_RANK"] = "0"
        torch.cuda.set_device(0)
        dist.init_process_group("gloo")
    sys.path.insert(0, str(EXAMPLES))
    import deepspeed

    import train

    start_at, counted = 3, 2  # warm steps first: allocations and JIT are not the steady state
    inventory = SyncInventory() if args.sync_inventory else None
    profiler = None
    real_initialize = deepspeed.initialize
    engines = []

    def initialize(*a, **k):
        out = real_initialize(*a, **k)
        engine, real_step = out[0], out[0].step
        engines.append(engine)

        seen, phase = [engine.global_steps], ["before"]

        def step(*sa, **sk):
            # acco advances global_steps where a round installs (a forward or a step), so the
            # phases begin at the first engine.step() after the count has moved.
            nonlocal profiler
            result = real_step(*sa, **sk)
            if engine.global_steps != seen[0]:  # an optimizer step ended
                seen[0] = done = engine.global_steps
                if inventory and phase[0] == "before" and done >= start_at:
                    inventory.start(torch)
                if args.profile and phase[0] == "before" and done >= start_at:
                    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                  torch.profiler.ProfilerActivity.CUDA])
                    profiler.__enter__()
                if phase[0] == "before" and done >= start_at:
                    phase[0] = "on"
                elif phase[0] == "on" and done >= start_at + counted:
                    phase[0] = "after"
                    if inventory:
                        inventory.stop(torch)
                    if profiler is not None:
                        torch.cuda.synchronize()
                        profiler.__exit__(None, None, None)
                        trace = Path(args.profile).with_suffix(".trace.json")
                        profiler.export_chrome_trace(str(trace))
                        Path(args.profile).write_text(json.dumps(profile_summary(trace), indent=1))
                        profiler = None
            return result
        engine.step = step
        return out

    deepspeed.initialize = initialize
    train_args = [a for a in args.train_args if a != "--"]
    result = train.main(train_args)
    import hashlib
    digest = hashlib.sha256()
    for p in engines[0].module.parameters():
        digest.update(p.detach().float().cpu().numpy().tobytes())
    result["param_sha256"] = digest.hexdigest()
    rank = os.environ.get("RANK", "0")
    Path(args.result.replace("RANK", rank)).write_text(json.dumps(result))
    if inventory:
        Path(args.sync_inventory.replace("RANK", rank)).write_text(
            json.dumps(dict(inventory.counts.most_common()), indent=1))


def profile_summary(trace: Path) -> dict:
    """Kernel time per stream, side-stream kernel time overlapping default-stream kernels, and
    default-stream idle gaps over 50 µs, from a profiler's Chrome trace (its kernel events carry
    their stream)."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    by_stream = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            by_stream[e.get("args", {}).get("stream", e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
    out = {"kernels": sum(map(len, by_stream.values())),
           "streams": {str(s): {"kernels": len(v), "busy_us": round(sum(b - a for a, b in v), 1)}
                       for s, v in by_stream.items()}}
    if by_stream:
        main = max(by_stream, key=lambda s: len(by_stream[s]))
        busy = sorted(by_stream[main])
        overlap = 0.0
        for s, spans in by_stream.items():
            if s != main:
                for a, b in spans:
                    overlap += sum(min(b, d) - max(a, c) for c, d in busy if d > a and c < b)
        gaps = [c - b for (_, b), (c, _) in zip(busy, busy[1:]) if c - b > 50]
        out.update(default_stream=str(main), side_overlapping_default_us=round(overlap, 1),
                   default_idle_gaps_over_50us=len(gaps), default_idle_us=round(sum(gaps), 1),
                   default_span_us=round(busy[-1][1] - busy[0][0], 1))
    return out


# -- the plan ------------------------------------------------------------------------------------

_PORTS = set()
_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """A port the OS has free now and no run of this process has been given (runs start in
    parallel: two asking at once must not get the same one)."""
    import socket

    with _PORTS_LOCK:
        while True:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port not in _PORTS:
                _PORTS.add(port)
                return port


def run_limited(cmd, log, limit: float, env: dict):
    """``cmd``'s exit code, or "timeout" after ``limit`` seconds: then its whole process group
    (the launcher's workers too) is killed, so nothing is left holding the GPU."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout"


class Plan:
    """Runs launched by this process; every one under a time limit, its log kept."""

    def __init__(self, out: Path, dry: bool, jobs: int) -> None:
        self.out, self.dry, self.jobs = out, dry, jobs
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if self.dry:
            env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        else:
            env.setdefault("DS_ACCELERATOR", "cuda")
        return env

    def train(self, name: str, mode: str, dtype: str, *, steps: int, ranks: int = 1, mbs: int = 8,
              gas: int = 4, model=(4, 4, 128), block: int = 128, extra=(), limit: float = 120,
              one_gpu_gloo: bool = False, sync_inventory: bool = False, profile: bool = False,
              env: dict | None = None, schedule: int | None = None, lowcomm: dict | None = None) -> dict:
        """One ``examples/train.py`` run; returns its result dict (rank 0's; every rank's with
        ``one_gpu_gloo``) or ``{"error": ...}``."""
        cfg = self.out / "configs" / f"{name}.json"
        cfg.parent.mkdir(exist_ok=True)
        cfg.write_text(json.dumps(config(mode, dtype, schedule or steps, mbs, gas, lowcomm)))
        result = self.out / "results" / f"{name}.rankRANK.json"
        result.parent.mkdir(exist_ok=True)
        n_layer, n_head, n_embd = model
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", "PORT", __file__, "rank", "--result", str(result)]
        if one_gpu_gloo and not self.dry:
            cmd.append("--one-gpu-gloo")
        if sync_inventory and not self.dry:
            cmd += ["--sync-inventory", str(self.out / "results" / f"{name}.syncs.rankRANK.json")]
        if profile and not self.dry:
            cmd += ["--profile", str(self.out / "results" / f"{name}.profile.json")]
        cmd += ["--", "--deepspeed", str(cfg), "--max-steps", str(steps), "--eval-every", "0",
                "--eval-iters", "2", "--n-layer", str(n_layer), "--n-head", str(n_head),
                "--n-embd", str(n_embd), "--block-size", str(block), "--log-every", str(max(1, steps // 4)),
                *extra]
        t0 = time.time()
        # A port free when asked can be taken before the launcher binds it (parallel runs open
        # many connections, each on an ephemeral port): such a start is retried on another port.
        for _ in range(3):
            with open(self.logs / f"{name}.log", "w") as log:
                rc = run_limited([str(free_port()) if a == "PORT" else a for a in cmd], log, limit,
                                 env={**self.env(), **(env or {})})
            if rc == 0 or "EADDRINUSE" not in (self.logs / f"{name}.log").read_text(errors="replace"):
                break
        seconds = round(time.time() - t0, 1)
        ranks_done = sorted(result.parent.glob(f"{name}.rank[0-9]*.json"))
        if rc != 0 or not ranks_done:
            tail = (self.logs / f"{name}.log").read_text(errors="replace")[-1500:]
            return {"error": f"exit {rc}", "seconds": seconds, "log_tail": tail}
        res = {"seconds": seconds, "ranks": [json.loads(p.read_text()) for p in ranks_done]}
        res.update(res["ranks"][0])
        for kind in ("syncs", "profile"):
            found = [p for p in sorted(result.parent.glob(f"{name}.{kind}*.json")) if "trace" not in p.name]
            if found:
                res[kind] = {p.name: json.loads(p.read_text()) for p in found}
        return res

    def parallel(self, runs: dict) -> dict:
        """``{name: kwargs}`` of :meth:`train`, ``jobs`` at a time (on one GPU: small models)."""
        with ThreadPoolExecutor(self.jobs) as pool:
            futures = {name: pool.submit(self.train, name, **kw) for name, kw in runs.items()}
            return {name: f.result() for name, f in futures.items()}


def versions() -> dict:
    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out.update(device=torch.cuda.get_device_name(0), nccl=".".join(map(str, torch.cuda.nccl.version())))
    for name in ("deepspeed", "transformers", "ds_lowcomm"):
        try:
            out[name] = getattr(__import__(name), "__version__", "?")
        except Exception as err:  # noqa: BLE001 (reported, the check goes on)
            out[name] = f"import failed: {type(err).__name__}: {err}"
    return out


def call1(plan: Plan, modes) -> dict:
    """One GPU, NCCL: the CUDA test tier; every mode in fp32 and bf16 (zero1 and stock in fp16
    too) against stock DeepSpeed; the sanitizer on the overlapped modes; the host-sync inventory."""
    res = {"versions": versions()}
    if not plan.dry:
        t0 = time.time()
        with open(plan.logs / "cuda_tier.log", "w") as log:
            import importlib.util
            parallel = ["-n", "6"] if importlib.util.find_spec("xdist") else []
            rc = run_limited([sys.executable, "-m", "pytest", "-q", *parallel, "tests/test_cuda.py"], log,
                             150, env=plan.env())
        res["cuda_tier"] = {"exit": rc, "seconds": round(time.time() - t0, 1),
                            "tail": (plan.logs / "cuda_tier.log").read_text(errors="replace")[-800:]}
    steps = 6 if plan.dry else 60
    dtypes = ["fp32"] if plan.dry else ["fp32", "bf16"]
    runs = {f"{m}-{d}": dict(mode=m, dtype=d, steps=steps) for m in modes for d in dtypes}
    if not plan.dry:
        runs.update({f"{m}-fp16": dict(mode=m, dtype="fp16", steps=steps) for m in ("stock", "zero1")})
        runs.update({f"sanitizer-{m}": dict(mode=m, dtype="fp32", steps=3, env={"TORCH_CUDA_SANITIZER": "1"},
                                            limit=150)
                     for m in ("acco", "zero1-overlap", "demo-overlap") if m in modes})
    if not plan.dry:  # (a CPU has no host-device syncs to count)
        runs.update({f"syncs-{m}": dict(mode=m, dtype="bf16", steps=6, sync_inventory=True) for m in modes})
    res["runs"] = runs_done = plan.parallel(runs)
    parity = {}
    for d in dtypes + ([] if plan.dry else ["fp16"]):
        a, b = runs_done.get(f"zero1-{d}", {}), runs_done.get(f"stock-{d}", {})
        if "final_train_loss" in a and "final_train_loss" in b:
            rel = abs(a["final_train_loss"] - b["final_train_loss"]) / abs(b["final_train_loss"])
            parity[d] = {"zero1": a["final_train_loss"], "stock": b["final_train_loss"], "rel": rel,
                         "ok": rel <= PARITY[d]}
    res["parity_zero1_vs_stock"] = parity
    return res


def call2(plan: Plan, modes) -> dict:
    """Two ranks on one GPU over gloo (CUDA tensors): replicas identical, losses near the CPU
    reference, acco with a slowed rank, acco's async save and resume."""
    steps = 8 if plan.dry else 40
    small = dict(steps=steps, ranks=2, mbs=4, gas=4, one_gpu_gloo=True)
    names = [m for m in modes if m != "stock"]
    runs = {f"{m}-2ranks": dict(mode=m, dtype="fp32", **small, lowcomm=every_4(m)) for m in names}
    if "acco" in names:
        runs["acco-slow-2ranks"] = dict(mode="acco", dtype="fp32", extra=("--slow-ranks", "1:2"), **small)
    # acco's round sizes follow timing (accumulate_while_waiting, balance): the resume check
    # uses acco with fixed rounds, so an uninterrupted run is its reference
    save = plan.out / "acco_save"
    resume = dict(mode="acco", dtype="fp32", schedule=steps, lowcomm={"async_save": True, **ACCO_FIXED}, **small)
    if "acco" in names:
        runs["acco-fixed-2ranks"] = dict(resume)
        runs["acco-save-half"] = {**resume, "steps": steps // 2, "extra": ("--save-dir", str(save))}
    res = {"runs": plan.parallel(runs)}
    if "acco" in names and "error" not in res["runs"]["acco-save-half"]:
        res["runs"]["acco-resumed"] = plan.train("acco-resumed", **resume, extra=("--save-dir", str(save), "--resume"))
    # The loss checked against the CPU's: acco's from its fixed-round run, since the default
    # acco's round sizes follow the device's timing (a faster device accumulates more
    # micro-batches per round), so its loss is not the CPU's by design.
    compared = {m: "acco-fixed-2ranks" if m == "acco" else f"{m}-2ranks" for m in names}
    if not plan.dry:  # the same runs on the CPU: the reference losses
        cpu = Plan(plan.out / "cpu_reference", dry=True, jobs=plan.jobs)
        res["cpu_reference"] = cpu.parallel({name: runs[name] for name in compared.values()})
    checks = {}
    for m in names:
        r = res["runs"].get(f"{m}-2ranks", {})
        ranks = r.get("ranks", [])
        check = {"ranks_done": len(ranks)}
        if ranks:
            check["replicas_identical"] = len({x["param_sha256"] for x in ranks}) == 1
            check["final_losses"] = [x["final_train_loss"] for x in ranks]
            r = res["runs"].get(compared[m], {})
            ref = res.get("cpu_reference", {}).get(compared[m], {})
            if "final_train_loss" in ref and "final_train_loss" in r:
                rel = abs(r["final_train_loss"] - ref["final_train_loss"]) / ref["final_train_loss"]
                check.update(compared=compared[m], cpu_reference=ref["final_train_loss"], rel=rel,
                             ok=rel <= CPU_REFERENCE_TOLERANCE)
        if check.get("replicas_identical") is False:
            check["ok"] = False
        checks[m] = check
    full, resumed = res["runs"].get("acco-fixed-2ranks", {}), res["runs"].get("acco-resumed", {})
    if "final_train_loss" in full and "final_train_loss" in resumed:
        rel = abs(full["final_train_loss"] - resumed["final_train_loss"]) / full["final_train_loss"]
        checks["acco-async-save-resume"] = {"uninterrupted": full["final_train_loss"],
                                            "resumed": resumed["final_train_loss"], "rel": rel, "ok": rel <= 1e-3}
    slow = res["runs"].get("acco-slow-2ranks", {}).get("ranks", [])
    if slow:  # under the slowed rank 1 the micro-batches shift to rank 0
        per_round = [x.get("micro_batches_per_round") for x in slow]
        checks["acco-slow"] = {"micro_batches_per_round": per_round,
                               "ok": None not in per_round and per_round[0] > per_round[1]}
    res["checks"] = checks
    return res


def newton_schulz_timing(dry: bool) -> dict:
    """Muon's Newton–Schulz (``newton_schulz``) on a GPT-2-124M-shaped model's 48 hidden matrices
    (dry: tiny ones), called per matrix against once per shape (one batch of 12, as ``ShardMuon``
    batches them at this size): ms per step's worth, after 3 warm-ups; ``{"error": ...}`` if it
    fails (the modes still run)."""
    import torch

    from ds_lowcomm.shard.muon import newton_schulz

    device = "cpu" if dry else "cuda"
    width, layers, reps = (32, 2, 2) if dry else (768, 12, 20)
    shapes = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]
    out = {}
    try:
        mats = [torch.randn(s, device=device) for s in shapes * layers]
        batches = [torch.stack(mats[i::len(shapes)]) for i in range(len(shapes))]
        for name, run in (("one_at_a_time_ms", lambda: [newton_schulz(m) for m in mats]),
                          ("batched_ms", lambda: [newton_schulz(b) for b in batches])):
            for _ in range(3):
                run()
            if not dry:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                run()
            if not dry:
                torch.cuda.synchronize()
            out[name] = round((time.perf_counter() - t0) / reps * 1e3, 2)
    except Exception as err:  # noqa: BLE001 (reported; the training runs of call 3 still run)
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        if not dry:  # this process holds no GPU memory while the runs train
            mats = batches = None
            torch.cuda.empty_cache()
    return out


def call3(plan: Plan, modes) -> dict:
    """Muon's Newton–Schulz timed one matrix at a time and batched; a GPT-2-124M-size model in
    bf16, micro-batch 8, accumulation 4, 30 steps, one at a time: tokens/s and peak GPU memory per
    mode; then a profile of acco's steps 3-5 in a run of its own
    (the profiler's overhead and its trace export would count in a measured run's step time)."""
    model, block, steps = ((2, 2, 64), 64, 6) if plan.dry else ((12, 12, 768), 1024, 30)
    dtype = "fp32" if plan.dry else "bf16"
    res = {"newton_schulz": newton_schulz_timing(plan.dry)}
    for m in modes:
        res[m] = plan.train(f"gpt2-{m}", m, dtype, steps=steps, model=model, block=block, limit=90)
    if "acco" in modes and not plan.dry:  # (a CPU run has no CUDA streams to profile)
        res["acco-profiled"] = plan.train("gpt2-acco-profiled", "acco", dtype, steps=6, model=model, block=block,
                                          profile=True, limit=90)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("call", choices=["call1", "call2", "call3", "all", "rank"])
    ap.add_argument("--out", default="gpu_check_out", help="results directory (created)")
    ap.add_argument("--dry-run", action="store_true", help="the plan on CPU, tiny settings, no GPU needed")
    ap.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    ap.add_argument("--jobs", type=int, default=None, help="runs at a time (default: 6 on a GPU, 1 dry)")
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["rank"]:
        rank_main(argv[1:])
        return 0
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if not args.dry_run:
        import torch
        if not torch.cuda.is_available():
            ap.error("no CUDA device here: add --dry-run to run the plan on the CPU")
    out = Path(args.out)
    plan = Plan(out, args.dry_run, args.jobs or (1 if args.dry_run else 6))
    calls = {"call1": call1, "call2": call2, "call3": call3}
    failed = False
    for name in (list(calls) if args.call == "all" else [args.call]):
        t0 = time.time()
        print(f"gpu_check {name}{' (dry run)' if args.dry_run else ''} ...", flush=True)
        res = calls[name](plan, modes)
        res["seconds"] = round(time.time() - t0, 1)
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
        errors = [k for k, v in res.get("runs", res).items() if isinstance(v, dict) and "error" in v]
        bad = [k for k, v in {**res.get("parity_zero1_vs_stock", {}), **res.get("checks", {})}.items()
               if v.get("ok") is False]
        print(f"gpu_check {name}: {res['seconds']} s; failed runs: {errors or 'none'}; "
              f"out of tolerance: {bad or 'none'}", flush=True)
        failed |= bool(errors or bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
