"""The GPU check: two device calls of at most 4 minutes each, each writing JSON under ``$OUT``.

Two commands of at most 4 minutes each, start-up included (a GPU machine held for a quarter of
an hour answers both and can run one again). From the repository root, with the wheels in
``.whl/`` and ``.gpu/site`` copied along (``tools/gpu_check.sh prepare`` makes them where there is
a network)::

    tools/gpu_check.sh call1
    tools/gpu_check.sh call2

and each has a dry run on the CPU, the same code with a tiny model, the CPU accelerator and the
host's clock (``tests/test_gpu_check.py`` runs both)::

    tools/gpu_check.sh call1 --dry-run
    tools/gpu_check.sh call2 --dry-run

**Call 1** (one process, one rank, bf16, a GPT-2-124M-shaped model: 12 layers x 768, byte
vocabulary, block 1024, micro-batch 8, accumulation 4): is each mode as fast as it should be?
Every engine is built once (stock DeepSpeed ZeRO-1, ``zero1``, ``acco``, ``acco`` on the Hugging
Face Trainer's path, ``zero1`` with overlap, ``demo`` with and without overlap, ``desloc``). While
it is built and warmed up (3 steps), its peak allocated and reserved memory is read (after
``empty_cache``, as the growth over what the engines built before it hold), then its host syncs
are counted per thread over two steps (:class:`SyncInventory`). Then timing windows alternate
between the engines: three rounds, each window one untimed step, then 8 steps between two device
synchronizes, ended only once every round it launched has finished (``optimizer.settle()``).
Tokens/s is each engine's median window, reported with its ratio to ``zero1``'s (the result:
absolute rates vary between machines), with ``acco``'s micro-batches per round and exposed
communication per step. Last, ``acco``'s, the Trainer-path ``acco``'s and ``zero1``'s
default-stream gaps over 50 µs per step, over three profiled steps (:func:`profile_summary`;
after the windows, which CUPTI could slow). The Trainer's path is what ``accelerate`` does under
the Trainer: ``set_gradient_accumulation_boundary`` before every backward, ``engine.step()`` at
the boundary only, and the step's gradient norm read after it; the engine learns from the first
mark that the loop marks its boundaries (``bind_loop``), so ``acco`` there runs with
``accumulate_while_waiting`` off, every switch waiting for its round.

**Call 2**: correctness. In parallel: the CUDA test tier (``tests/test_cuda.py``,
``tests/test_worker_cuda.py`` and every ``tests/test_nccl_*.py``, split over four pytest
processes); ``TORCH_CUDA_SANITIZER=1`` on a short run of each overlapped mode, one process each;
two ranks on the one GPU over gloo (NCCL refuses two ranks on one device), one
``torch.distributed.run`` group that runs every mode (replicas bit-identical at the end, final
losses against the same group run on the CPU), rank 1 slowed 2x (``zero1`` and ``acco`` on the
Trainer's path, paced on the device clock: rank 1 computes fewer micro-batches fully; default
``acco``: rank 1 computes fewer per round), ``zero1`` overlap and ``acco`` timed against ``zero1``
(gloo's transfers are real) and ``acco`` (fixed rounds, ``async_save``) saved half way and
resumed; and that group's replica runs on the CPU, the reference.

What one GPU cannot check: NCCL collectives between GPUs, several communicators at once, NCCL's
watchdog and timeouts, communication hidden between devices.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import copy
import gzip
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: each mode's "lowcomm" section (None: stock DeepSpeed ZeRO-1)
MODES = {
    "stock": None,
    "zero1": {"mode": "zero1"},
    "zero1-overlap": {"mode": "zero1", "zero1": {"overlap": True}},
    "acco": {"mode": "acco", "acco": {"variant": "acco"}},
    # the Trainer's path: the loop marks its boundaries, so every switch waits for its round
    "acco-trainer": {"mode": "acco", "acco": {"variant": "acco", "accumulate_while_waiting": False}},
    # fixed rounds under a DeepSpeed loop: deterministic, so its loss can be compared with the CPU's
    "acco-fixed": {"mode": "acco", "acco": {"variant": "acco", "accumulate_while_waiting": False, "balance": False}},
    "demo": {"mode": "demo", "shard_group_size": 1,
             "demo": {"topk": 64, "chunk": 64, "values": "sign", "tiling": "matrix"}},
    "demo-overlap": {"mode": "demo", "shard_group_size": 1,
                     "demo": {"overlap": True, "topk": 64, "chunk": 64, "values": "sign", "tiling": "matrix"}},
    "desloc": {"mode": "desloc", "shard_group_size": 1,
               "desloc": {"param_sync_every": 16, "momentum_sync_every": 48, "variance_sync_every": 96}},
    # Muon's local step, synchronous syncs
    "desloc-muon": {"mode": "desloc", "shard_group_size": 1,
                    "desloc": {"param_sync_every": 16, "momentum_sync_every": 32, "variance_sync_every": 64,
                               "inner_optimizer": "muon"}},
    # Muon, the syncs streamed 2 steps behind on the comm worker, the moments with them
    "desloc-streamed": {"mode": "desloc", "shard_group_size": 1,
                        "desloc": {"param_sync_every": 16, "momentum_sync_every": 32, "variance_sync_every": 64,
                                   "param_sync_delay": 2, "inner_optimizer": "muon"}},
    # the same, the parameter syncs compressed to int2 (top-4 of 64), the moments never averaged
    "desloc-int2": {"mode": "desloc", "shard_group_size": 1,
                    "desloc": {"param_sync_every": 16, "momentum_sync_every": 0, "variance_sync_every": 0,
                               "sync_topk": 4, "sync_values": "int2", "param_sync_delay": 2,
                               "inner_optimizer": "muon"}},
}
#: modes driven by the Trainer's loop (boundaries marked, ``engine.step()`` at the boundary only);
#: "zero1-trainer" is zero1's own section under that loop
TRAINER_LOOP = {"acco-trainer", "zero1-trainer"}
MODES["zero1-trainer"] = MODES["zero1"]
CALL1_MODES = ["stock", "zero1", "acco", "acco-trainer", "zero1-overlap", "demo", "demo-overlap", "desloc"]
#: call 1: the engines whose default-stream gaps are profiled
PROFILED = ("zero1", "acco", "acco-trainer")
#: call 2: every mode on two ranks (stock has no lowcomm replicas to compare)
CALL2_MODES = ["zero1", "zero1-overlap", "acco", "acco-fixed", "demo", "demo-overlap", "desloc", "desloc-muon",
               "desloc-streamed", "desloc-int2"]
#: call 2: modes whose final loss is not the CPU's by design (acco's rounds follow the device's timing)
NOT_COMPARED = {"acco"}
SANITIZED = ["acco", "zero1-overlap", "demo-overlap"]
#: two-rank runs: each mode's final loss within this of the CPU reference, relative
CPU_REFERENCE_TOLERANCE = 0.02
#: default-stream idle gaps longer than this are counted (µs)
GAP_US = 50


@dataclass(frozen=True)
class Size:
    layers: int
    heads: int
    embd: int
    block: int
    mbs: int
    gas: int


#: call 1's model: GPT-2 124M's shape with a byte vocabulary (86M parameters); dry: tiny
GPT2, DRY = Size(12, 12, 768, 1024, 8, 4), Size(2, 2, 64, 64, 2, 4)
#: call 2: the replica, slowed and resume runs; the two-rank timing (gloo moving 2 bytes per parameter)
TINY, MEDIUM = Size(4, 4, 128, 128, 4, 4), Size(6, 6, 384, 256, 8, 4)

#: call 1's steps: warm-up, sync inventory, profile, per timed window, windows per engine
CALL1_STEPS = {"warm": 3, "inventory": 2, "profile": 3, "window": 8, "windows": 3}
CALL1_DRY = {"warm": 1, "inventory": 1, "profile": 1, "window": 2, "windows": 3}
#: call 2's steps (replica runs a multiple of 4: desloc's syncs every 4 steps end on one)
CALL2_STEPS = {"replicas": 24, "slow": 16, "warm": 2, "window": 4, "windows": 3, "resume": 10}
CALL2_DRY = {"replicas": 4, "slow": 6, "warm": 1, "window": 1, "windows": 3, "resume": 2}
#: wall-clock limits (s): call 1's process, and call 2's subprocesses
#: (each call within 4 minutes with the wheels' install and the imports: the tier's collection
#: has 40 s of the tier's 200; a 250 s limit around the whole call only backs them up)
CALL1_LIMIT, TIER_LIMIT, SANITIZER_LIMIT, GROUP_LIMIT = 215, 160, 150, 200
#: call 2's group starts its timing by then (s from its start) if the other jobs still run
QUIET_WAIT = 140


def every_4(mode: str) -> dict | None:
    """desloc's replicas agree right after a parameter sync (a streamed one once flushed at the
    end): syncs every 4 steps, the last one included, and the moments every 8 and 16 where they
    are averaged at all. None for the other modes."""
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
        cfg["lowcomm"] = {**copy.deepcopy(MODES[mode]), **(lowcomm or {})}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


# -- training in this process ----------------------------------------------------------------------

class Clock:
    """The timing windows' clock: the host's, the device synchronized at each end (on the CPU
    the same calls, the synchronize a no-op)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


def init_distributed(cuda: bool, two_ranks_one_gpu: bool = False) -> None:
    """The process group: this process as the one rank (call 1, the sanitizer runs: NCCL on a
    GPU, as a user's one-GPU run has), or a rank of ``torch.distributed.run`` that puts every rank
    on device 0 over gloo."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if cuda and two_ranks_one_gpu:
        os.environ["LOCAL_RANK"] = "0"  # DeepSpeed's device is LOCAL_RANK's
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda and not two_ranks_one_gpu else "gloo")
    import ds_lowcomm

    ds_lowcomm.skip_shm_comm_build()


def make_model(size: Size):
    """The GPT-2-style model of ``examples/train.py`` (byte vocabulary, no dropout, seed 1337)."""
    from ds_lowcomm.examples import train as ex

    args = argparse.Namespace(block_size=size.block, n_embd=size.embd, n_layer=size.layers, n_head=size.heads,
                              dropout=0.0, seed=1337)
    return ex.build_model(args, 256)


def build(mode: str, dtype: str, size: Size, schedule: int, model=None, lowcomm: dict | None = None,
          slow: float = 1.0):
    """A DeepSpeed engine (ds_lowcomm's for a "lowcomm" section) of ``mode`` on ``model`` (a
    fresh one if None); ``slow``: its forward passes ``slow`` times as long (examples/common.py)."""
    import deepspeed

    from ds_lowcomm.examples.common import slow_down

    model = make_model(size) if model is None else model
    slow_down(model, slow)
    cfg = config(mode, dtype, schedule, size.mbs, size.gas, lowcomm)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


class Batches:
    """Micro-batches of the built-in corpus as ``examples/train.py`` samples them: exact ones
    (a function of step, micro-batch and rank, the same on any device), or ``staged`` ones made
    once and reused (timing: no sampling or host-to-device copy in the windows)."""

    def __init__(self, size: Size, device, rank: int = 0, staged: int = 0) -> None:
        from ds_lowcomm.examples import train as ex

        self.ex, self.size, self.device, self.rank = ex, size, device, rank
        self.tokens = ex.Tokenizer("byte", "").encode(ex.builtin_corpus())
        self.staged = [self._make(0, i) for i in range(staged)]

    def _make(self, step: int, micro: int):
        s = self.size
        return self.ex.to_device(self.ex.sample_batch(self.tokens, 1337, step, micro, self.rank, s.mbs, s.block),
                                 self.device)

    def __call__(self, step: int, micro: int):
        if self.staged:
            return self.staged[(step * 3 + micro) % len(self.staged)]
        return self._make(step, micro)


def train_steps(engine, n: int, batches: Batches, trainer: bool = False, losses: list | None = None) -> int:
    """``n`` optimizer steps; returns the micro-batches handed out. DeepSpeed's loop: forward,
    backward and ``engine.step()`` until the step count moves (acco may take more or fewer than
    the accumulation steps). The Trainer's (accelerate's ``DeepSpeedEngineWrapper``): the boundary
    set before every backward, ``engine.step()`` at the boundary only, then the gradient norm the
    Trainer logs (a host read where it is a device tensor). ``losses``: each step's mean loss
    appended, a device scalar (no host read in the loop)."""
    import torch

    gas = engine.gradient_accumulation_steps()
    handed = 0
    for _ in range(n):
        step, k = engine.global_steps, 0
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        while True:
            if trainer:
                engine.set_gradient_accumulation_boundary(k == gas - 1)
            x = batches(step, k)
            loss = engine(x[:, :-1], labels=x[:, :-1]).loss
            engine.backward(loss)
            if not trainer or k == gas - 1:
                engine.step()
            total += loss.detach()
            k += 1
            if (k == gas) if trainer else (engine.global_steps != step):
                break
        if trainer:
            norm = engine.get_global_grad_norm()
            if hasattr(norm, "item"):
                norm.item()
        handed += k
        if losses is not None:
            losses.append(total / k)
    return handed


def settle(engine) -> None:
    """Every round the engine launched has run (``optimizer.settle()``: acco, demo overlap and the
    streamed syncs leave one in flight after a step); nothing for stock DeepSpeed."""
    if hasattr(engine, "comm_stats"):
        engine.optimizer.settle()


def flush(engine) -> None:
    """The update still in flight installed (ds_lowcomm; what examples/train.py does at its end)."""
    if hasattr(engine, "comm_stats"):
        engine.optimizer.flush()


def comm_numbers(engine) -> dict:
    """ds_lowcomm's cumulative communication counters ({} for stock DeepSpeed)."""
    if not hasattr(engine, "comm_stats"):
        return {}
    s = engine.comm_stats()
    out = {k: s[k] for k in ("exposed_comm_seconds", "host_wait_seconds", "device_wait_seconds", "round_seconds",
                             "rounds", "micro_batches") if k in s}
    for k in ("micro_batches_per_round", "micro_batches_per_round_by_rank", "computed_share_by_rank"):
        if s.get(k) is not None:
            out[k] = s[k]
    return out


def digest(engine) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def window(engine, steps: int, batches: Batches, trainer: bool, clock: Clock, barrier=None) -> dict:
    """One timing window: an untimed step, every round settled and the device synchronized, then
    ``steps`` steps and their rounds' completion, timed between two synchronizes."""
    train_steps(engine, 1, batches, trainer)
    settle(engine)
    clock.sync()
    if barrier is not None:
        barrier()
    before = comm_numbers(engine)
    t0 = clock.now()
    handed = train_steps(engine, steps, batches, trainer)
    settle(engine)
    seconds = clock.now() - t0
    after = comm_numbers(engine)
    out = {"seconds": seconds, "micro_batches": handed}
    for k in ("exposed_comm_seconds", "host_wait_seconds", "device_wait_seconds", "round_seconds"):
        if k in after:
            out[k.replace("_seconds", "_s_per_step")] = (after[k] - before[k]) / steps
    if "rounds" in after:
        out["rounds"] = after["rounds"] - before["rounds"]
    return out


def medians(windows: list, size: Size, world: int = 1) -> dict:
    """The windows' medians: tokens/s (each window's own), and the per-step numbers."""
    tps = [w["micro_batches"] * size.mbs * size.block * world / w["seconds"] for w in windows]
    out = {"tokens_per_s": statistics.median(tps), "tokens_per_s_windows": [round(x) for x in tps]}
    for k in ("exposed_comm_s_per_step", "host_wait_s_per_step", "device_wait_s_per_step", "round_s_per_step"):
        if all(k in w for w in windows):
            out[k] = statistics.median(w[k] for w in windows)
    return out


class SyncInventory:
    """Host syncs by (file:line, thread) while ``torch.cuda.set_sync_debug_mode("warn")`` is on:
    each synchronizing CUDA call warns; the innermost frame of ours (ds_lowcomm, examples) or,
    failing that, the caller's is counted. ``torch.cuda.synchronize`` (a whole device, every
    stream) does not warn in that mode, so :meth:`start` wraps it to count it too, as
    ``synchronize@`` its caller (DeepSpeed's throughput timer makes one unless told not to); a
    warning raised inside the wrapped call is not counted twice."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self._synchronize = None
        self._inside = threading.local()

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
        if "synchroniz" in str(message) and not getattr(self._inside, "synchronize", False):
            self._count()

    def start(self, torch, debug_mode: bool = True) -> None:
        """Count from now: the debug mode's warnings (``debug_mode``: a CUDA build) and every
        ``torch.cuda.synchronize``."""
        import warnings

        self._warnings = warnings.catch_warnings()  # (restores the filters and showwarning at stop)
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self.showwarning
        self._debug_mode = debug_mode
        if debug_mode:
            torch.cuda.set_sync_debug_mode("warn")
        real = self._synchronize = torch.cuda.synchronize
        inside = self._inside

        def synchronize(*a, **k):
            self._count("synchronize@")
            inside.synchronize = True
            try:
                return real(*a, **k)
            finally:
                inside.synchronize = False
        torch.cuda.synchronize = synchronize

    def stop(self, torch) -> None:
        """Stop counting: the debug mode, the warning filters, ``showwarning`` and
        ``torch.cuda.synchronize`` as they were."""
        if self._debug_mode:
            torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(None, None, None)
        if self._synchronize is not None:
            torch.cuda.synchronize, self._synchronize = self._synchronize, None

    def per_thread(self, steps: int) -> dict:
        """``{thread: {"per_step": total, "sites": {site: per step}}}``."""
        out: dict = {}
        for key, n in self.counts.most_common():
            site, thread = key.rsplit(" [", 1)
            entry = out.setdefault(thread.rstrip("]"), {"per_step": 0.0, "sites": {}})
            entry["per_step"] += n / steps
            entry["sites"][site] = n / steps
        return out


def profile_summary(trace: Path, steps: int, cuda: bool = True) -> dict:
    """From a profiler's Chrome trace: busy time per stream (on the CPU, per thread: the dry run's
    stand-in), the default stream's idle gaps over ``GAP_US`` between its merged kernel, copy and
    memset intervals, per step, and side-stream time overlapping the default stream's. The default
    stream is CUDA's legacy stream (id 7 in the trace) where it has work, else the busiest."""
    events = json.loads(Path(trace).read_text()).get("traceEvents", [])
    cats = {"kernel", "gpu_memcpy", "gpu_memset"} if cuda else {"cpu_op"}
    spans = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in cats and "dur" in e:
            key = e.get("args", {}).get("stream", e.get("tid")) if cuda else e.get("tid")
            spans[str(key)].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    merged = {s: _merge(v) for s, v in spans.items()}
    out = {"steps": steps, "events": sum(map(len, spans.values())),
           "streams": {s: {"events": len(spans[s]), "busy_us": round(sum(b - a for a, b in m), 1)}
                       for s, m in merged.items()}}
    if not merged:
        return out
    main = "7" if cuda and "7" in merged else max(merged, key=lambda s: sum(b - a for a, b in merged[s]))
    busy = merged[main]
    gaps = [c - b for (_, b), (c, _) in zip(busy, busy[1:]) if c - b > GAP_US]
    starts, overlap = [c for c, _ in busy], 0.0
    for s, m in merged.items():  # (busy is sorted and disjoint: each side interval meets a run of it)
        if s != main:
            for a, b in m:
                i = max(0, bisect.bisect_right(starts, a) - 1)
                while i < len(busy) and busy[i][0] < b:
                    overlap += max(0.0, min(b, busy[i][1]) - max(a, busy[i][0]))
                    i += 1
    span = busy[-1][1] - busy[0][0]
    out.update(default_stream=main, default_busy_us=round(sum(b - a for a, b in busy), 1),
               default_span_us=round(span, 1), gaps_over_50us=len(gaps),
               gaps_over_50us_per_step=len(gaps) / steps, gap_us_per_step=round(sum(gaps) / steps, 1),
               side_overlapping_default_us=round(overlap, 1))
    return out


def _merge(spans: list) -> list:
    out: list = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


def profile(engine, steps: int, batches: Batches, trainer: bool, clock: Clock, path: Path) -> dict:
    """``steps`` steps under ``torch.profiler`` (CUDA activity only on a GPU: the host's own
    events would slow the host this measures), their rounds settled inside; the trace kept
    gzipped beside the JSON, its :func:`profile_summary` returned."""
    import torch
    from torch.profiler import ProfilerActivity

    settle(engine)
    clock.sync()
    activities = [ProfilerActivity.CUDA] if clock.cuda else [ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        train_steps(engine, steps, batches, trainer)
        settle(engine)
        clock.sync()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    summary = profile_summary(path, steps, clock.cuda)
    with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return summary


def memory_mark(cuda: bool):
    """Before an engine is built: the allocator emptied of cached blocks, the peaks reset."""
    if not cuda:
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def memory_since(mark) -> dict:
    """The peaks over ``mark``: this engine's peak allocated and reserved (what the engines built
    before it hold subtracted), and what it keeps allocated between steps."""
    if mark is None:
        return {"peak_allocated_mb": None, "peak_reserved_mb": None, "resident_mb": None}
    import torch

    torch.cuda.synchronize()
    mb = 2 ** 20
    return {"peak_allocated_mb": round((torch.cuda.max_memory_allocated() - mark[0]) / mb),
            "peak_reserved_mb": round((torch.cuda.max_memory_reserved() - mark[1]) / mb),
            "resident_mb": round((torch.cuda.memory_allocated() - mark[0]) / mb)}


# -- call 1 --------------------------------------------------------------------------------------

def call1(args) -> int:
    """See the module's doc. Writes ``call1.json`` after every phase, so a call cut short keeps
    what it measured; past ``CALL1_LIMIT`` seconds it writes what it has and exits (status 3)."""
    cuda = not args.dry_run
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
    out = Path(args.out)
    size, n = (GPT2, CALL1_STEPS) if cuda else (DRY, CALL1_DRY)
    modes = args.modes or CALL1_MODES
    started = time.time()
    res = {"call": "call1", "dry_run": not cuda, "size": asdict(size), "steps": n, "dtype": "bf16",
           "modes": modes, "engines": {m: {} for m in modes}}
    path = out / "call1.json"

    def cut_short():
        try:
            res["timed_out"] = f"past {CALL1_LIMIT} s: what was measured so far"
            write_json(path, res)
            print(call1_table(res), flush=True)
        finally:
            os._exit(3)

    timer = threading.Timer(CALL1_LIMIT, cut_short)
    timer.daemon = True
    timer.start()

    import torch

    init_distributed(cuda)
    res["versions"] = versions()
    clock = Clock(cuda)
    batches = Batches(size, "cuda" if cuda else "cpu", staged=8)
    base = make_model(size)
    res["params"] = sum(p.numel() for p in base.parameters())
    schedule = 10_000  # (the schedule's warm-up spans every step run: no step runs at rate 0)
    engines = {}
    for m in modes:  # built once each: memory and host syncs while it warms up
        e, trainer = res["engines"][m], m in TRAINER_LOOP
        try:
            mark = memory_mark(cuda)
            t0 = time.perf_counter()
            engine = build(m, "bf16", size, schedule, model=copy.deepcopy(base))
            train_steps(engine, n["warm"], batches, trainer)
            settle(engine)
            e["build_and_warm_s"] = round(time.perf_counter() - t0, 2)
            e.update(memory_since(mark))
            inventory = SyncInventory()
            settle(engine)
            clock.sync()
            inventory.start(torch, debug_mode=cuda)
            try:
                train_steps(engine, n["inventory"], batches, trainer)
                settle(engine)
            finally:
                inventory.stop(torch)
            e["host_syncs"] = inventory.per_thread(n["inventory"])
            engines[m] = engine
        except Exception as err:  # noqa: BLE001 (reported; the other engines go on)
            e["error"] = f"{type(err).__name__}: {err}"
            e["traceback"] = traceback.format_exc()[-3000:]
        write_json(path, res)
    windows = {m: [] for m in engines}
    for _ in range(n["windows"]):  # alternating: a drift of the machine falls on every engine alike
        for m in list(engines):
            try:
                windows[m].append(window(engines[m], n["window"], batches, m in TRAINER_LOOP, clock))
            except Exception as err:  # noqa: BLE001
                res["engines"][m]["error"] = f"window: {type(err).__name__}: {err}"
                res["engines"][m]["traceback"] = traceback.format_exc()[-3000:]
                engines.pop(m)
            res["engines"][m]["windows"] = windows[m]
        write_json(path, res)
    for m in [m for m in PROFILED if m in engines]:  # (after the windows: CUPTI may slow what runs after it)
        try:
            res["engines"][m]["profile"] = profile(engines[m], n["profile"], batches, m in TRAINER_LOOP, clock,
                                                   out / "traces" / f"{m}.json")
        except Exception as err:  # noqa: BLE001
            res["engines"][m]["profile"] = {"error": f"{type(err).__name__}: {err}"}
    for m, engine in engines.items():
        e = res["engines"][m]
        e.update(medians(windows[m], size))
        e["step_s"] = statistics.median(w["seconds"] for w in windows[m]) / n["window"]
        stats = comm_numbers(engine)
        if "micro_batches_per_round" in stats:
            e["micro_batches_per_round"] = stats["micro_batches_per_round"]
        losses: list = []
        train_steps(engine, 1, batches, m in TRAINER_LOOP, losses)
        e["last_loss"] = float(losses[-1])
    zero1 = res["engines"].get("zero1", {}).get("tokens_per_s")
    for e in res["engines"].values():
        if zero1 and "tokens_per_s" in e:
            e["vs_zero1"] = e["tokens_per_s"] / zero1
    res["seconds"] = round(time.time() - started, 1)
    timer.cancel()
    write_json(path, res)
    print(call1_table(res), flush=True)
    bad = [m for m, e in res["engines"].items() if "error" in e or "tokens_per_s" not in e]
    return 1 if bad else 0


def _thread(name: str) -> str:
    """A thread's name in the table: main (the training loop's), comm (ds_lowcomm's worker), else
    its own, cut to 8 characters (autograd's device threads are Dummy-N to Python)."""
    return {"MainThread": "main", "ds_lowcomm-comm": "comm"}.get(name, name[:8])


def _fmt(x, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def call1_table(res: dict) -> str:
    """Call 1's short table: tokens/s and its ratio to zero1, memory, gaps, host syncs."""
    device = res.get("versions", {}).get("device", "CPU, dry run" if res.get("dry_run") else "GPU")
    rows = [f"gpu_check call1 ({device}, "
            f"{res['params'] / 1e6 if 'params' in res else 0:.1f}M params, bf16, "
            f"medians of {res['steps']['windows']} windows of {res['steps']['window']} steps)",
            f"{'mode':<14}{'tokens/s':>11}{'x zero1':>9}{'alloc MB':>10}{'resv MB':>9}{'gaps/step':>10}"
            f"{'syncs/step (thread)':>28}{'mb/round':>9}{'exposed ms':>11}"]
    for m, e in res["engines"].items():
        syncs = ", ".join(f"{v['per_step']:g} {_thread(t)}" for t, v in (e.get("host_syncs") or {}).items()) or "0"
        gaps = (e.get("profile") or {}).get("gaps_over_50us_per_step")
        exposed = e.get("exposed_comm_s_per_step")
        if "error" in e:
            rows.append(f"{m:<14}  error: {e['error'][:100]}")
            continue
        rows.append(f"{m:<14}{_fmt(e.get('tokens_per_s')):>11}{_fmt(e.get('vs_zero1'), '.2f'):>9}"
                    f"{_fmt(e.get('peak_allocated_mb')):>10}{_fmt(e.get('peak_reserved_mb')):>9}"
                    f"{_fmt(gaps, '.0f'):>10}{syncs[:27]:>28}{_fmt(e.get('micro_batches_per_round'), '.2f'):>9}"
                    f"{_fmt(None if exposed is None else exposed * 1e3, '.1f'):>11}")
    if res.get("timed_out"):
        rows.append(f"TIMED OUT: {res['timed_out']}")
    return "\n".join(rows)


# -- call 2: the two-rank group (under torch.distributed.run) -------------------------------------

def group_main(args) -> int:
    """One rank of call 2's group: every rank on device 0 over gloo (``--cpu``: the CPU
    reference). Parts: ``replicas`` (every mode, fp32, final loss and parameter digest), ``slow``
    (rank 1 slowed 2x), ``resume`` (acco, fixed rounds, async save half way), ``timing`` (zero1,
    zero1 overlap and acco, alternating windows; it waits up to ``QUIET_WAIT`` s from the start for
    ``--work``/quiet, made once call 2's other jobs are done). Rank 0 writes ``--result`` after
    every part."""
    started = time.time()
    cuda = not (args.dry_run or args.cpu)
    os.environ["DS_ACCELERATOR"] = "cuda" if cuda else "cpu"
    import torch
    import torch.distributed as dist

    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_distributed(cuda, two_ranks_one_gpu=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    n = CALL2_DRY if args.dry_run else CALL2_STEPS
    tiny, medium = (DRY, DRY) if args.dry_run else (TINY, MEDIUM)
    res: dict = {"device": device, "world_size": world, "steps": n, "versions": versions() if rank == 0 else None}
    parts = args.parts.split(",")
    modes = args.modes or CALL2_MODES

    def save():
        if rank == 0:
            write_json(Path(args.result), res)

    def gathered(x):
        every = [None] * world
        dist.all_gather_object(every, x)
        return every

    def part(name, fn):
        t0 = time.time()
        try:
            res[name] = fn()
        except Exception as err:  # noqa: BLE001
            res[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        res[name + "_seconds"] = round(time.time() - t0, 1)
        save()

    def one_run(mode, steps, size, dtype="fp32", slow=1.0, lowcomm=None):
        engine = build(mode, dtype, size, steps, lowcomm=lowcomm, slow=slow)
        losses: list = []
        train_steps(engine, steps, Batches(size, device, rank), mode in TRAINER_LOOP, losses)
        flush(engine)
        stats, mine = comm_numbers(engine), float(losses[-1])
        out = {"final_losses": gathered(mine), "replicas_identical": len(set(gathered(digest(engine)))) == 1,
               **{k: stats[k] for k in ("micro_batches_per_round_by_rank", "computed_share_by_rank") if k in stats}}
        out["final_train_loss"] = sum(out["final_losses"]) / world
        engine.destroy()
        return out

    def replicas():
        out = {}
        for m in modes:
            try:
                out[m] = one_run(m, n["replicas"], tiny, lowcomm=every_4(m))
            except Exception as err:  # noqa: BLE001
                out[m] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
            res["replicas"] = out
            save()
        return out

    def slow():
        # rank 1's forward passes take twice as long; paced on the device clock in the Trainer's loop
        slowed = 2.0 if rank == 1 else 1.0
        return {m: one_run(m, n["slow"], tiny, slow=slowed) for m in ("zero1-trainer", "acco-trainer", "acco")}

    def timing():
        # last, once the call's other jobs are done (their processes share the GPU and the cores)
        t0 = time.time()
        while not Path(args.work, "quiet").exists() and time.time() - started < QUIET_WAIT:
            time.sleep(0.5)
        res["timing_waited_s"] = round(time.time() - t0, 1)
        res["timing_alone"] = Path(args.work, "quiet").exists()
        dist.barrier()
        clock = Clock(cuda)
        batches = Batches(medium, device, rank, staged=8)
        engines = {m: build(m, "bf16", medium, 10_000) for m in ("zero1", "zero1-overlap", "acco")}
        for m, e in engines.items():
            train_steps(e, n["warm"], batches)
        windows = {m: [] for m in engines}
        for _ in range(n["windows"]):
            for m, e in engines.items():
                w = window(e, n["window"], batches, False, clock, barrier=dist.barrier)
                w["micro_batches"] = sum(gathered(w["micro_batches"])) / world  # (acco: each rank's own)
                windows[m].append(w)
        out = {m: {**medians(windows[m], medium, world), "windows": windows[m]} for m in engines}
        out["params"] = sum(p.numel() for p in engines["zero1"].module.parameters())
        for m in engines:
            out[m]["vs_zero1"] = out[m]["tokens_per_s"] / out["zero1"]["tokens_per_s"]
            engines[m].destroy()
        return out

    def resume():
        steps, save_dir = n["resume"], Path(args.work) / "acco_save"
        lowcomm = {"async_save": True, "acco": MODES["acco-fixed"]["acco"]}
        batches = Batches(tiny, device, rank)

        def run(engine, k):
            losses: list = []
            train_steps(engine, k, batches, False, losses)
            return losses

        full = build("acco", "fp32", tiny, 2 * steps, lowcomm=lowcomm)
        uninterrupted = float(run(full, 2 * steps)[-1])
        flush(full)
        d_full = digest(full)
        full.destroy()
        first = build("acco", "fp32", tiny, 2 * steps, lowcomm=lowcomm)
        run(first, steps)
        first.save_checkpoint(str(save_dir))
        first.destroy()  # (waits for the background save)
        second = build("acco", "fp32", tiny, 2 * steps, lowcomm=lowcomm)
        second.load_checkpoint(str(save_dir))
        at = second.global_steps
        resumed = float(run(second, steps)[-1])
        flush(second)
        d_resumed = digest(second)
        second.destroy()
        a, b = gathered(uninterrupted), gathered(resumed)
        ua, ub = sum(a) / world, sum(b) / world
        return {"resumed_at": at, "uninterrupted": ua, "resumed": ub, "rel": abs(ua - ub) / abs(ua),
                "same_parameters": all(gathered(d_full == d_resumed))}

    for name, fn in (("replicas", replicas), ("slow", slow), ("resume", resume), ("timing", timing)):
        if name in parts:
            part(name, fn)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def one_main(args) -> int:
    """A short one-rank run of ``--mode`` (the sanitizer's: ``TORCH_CUDA_SANITIZER=1`` acts at
    import): tiny model, fp32, ``--steps`` steps, flushed; writes ``--result``."""
    cuda = not args.dry_run
    os.environ["DS_ACCELERATOR"] = "cuda" if cuda else "cpu"
    init_distributed(cuda)
    mode = args.modes[0]
    size = TINY if cuda else DRY
    engine = build(mode, "fp32", size, args.steps)
    losses: list = []
    train_steps(engine, args.steps, Batches(size, "cuda" if cuda else "cpu"), mode in TRAINER_LOOP, losses)
    flush(engine)
    res = {"mode": mode, "steps": args.steps, "final_train_loss": float(losses[-1])}
    engine.destroy()
    write_json(Path(args.result), res)
    return 0


# -- call 2: the plan ----------------------------------------------------------------------------

def run_limited(cmd, log: Path, limit: float, env: dict):
    """``cmd``'s exit code, or "timeout" after ``limit`` seconds: then its whole process group
    (a launcher's ranks too) is killed, so nothing is left holding the GPU."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"


def child_env(dry: bool, **extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("DS_ACCELERATOR", "cpu" if dry else "cuda")
    if dry:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def tail(log: Path, n: int = 1500) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else ""


def cuda_tier(work: Path, dry: bool, shards: int) -> dict:
    """The CUDA test tier: its tests collected, then dealt over ``shards`` pytest processes run
    at once (each test spawns its own ranks; most of a test is their start-up); with one shard,
    the files in one process. Dry: without ``tests/test_nccl_*.py``, whose CPU tests ``make
    test`` runs (the CUDA ones skip here)."""
    nccl = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_nccl_*.py"))
    files = ["tests/test_cuda.py", "tests/test_worker_cuda.py", *([] if dry else nccl)]
    env, logs = child_env(dry), work / "logs"
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    t0, ids, rc = time.time(), [], None
    if shards > 1:
        rc = run_limited([*pytest, "--collect-only", *files], logs / "tier_collect.log", 40, env)
        ids = [line.strip() for line in tail(logs / "tier_collect.log", 10 ** 6).splitlines() if "::" in line]
    groups = [ids[i::shards] for i in range(shards)] if rc == 0 and ids else [files]
    groups = [g for g in groups if g]
    with ThreadPoolExecutor(len(groups)) as pool:
        rcs = list(pool.map(lambda ig: run_limited([*pytest, *ig[1]], logs / f"tier_{ig[0]}.log", TIER_LIMIT, env),
                            enumerate(groups)))
    counts: collections.Counter = collections.Counter()
    failed = []
    for i in range(len(groups)):
        text = tail(logs / f"tier_{i}.log", 10 ** 6)
        last = [line for line in text.splitlines() if re.search(r"\b(passed|failed|skipped|error)", line)]
        for k, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", last[-1] if last else ""):
            counts[word.rstrip("s") if word.startswith("error") else word] += int(k)
        failed += [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    res = {"files": files, "collected": len(ids), "shards": len(groups), "exit": rcs, "counts": dict(counts),
           "failed": failed, "seconds": round(time.time() - t0, 1),
           "ok": all(r in (0, 5) for r in rcs) and not counts.get("failed") and not counts.get("error")}
    if not res["ok"]:
        res["log_tails"] = [tail(logs / f"tier_{i}.log", 2000) for i, r in enumerate(rcs) if r not in (0, 5)]
    return res


def sanitized(work: Path, dry: bool, mode: str) -> dict:
    """``TORCH_CUDA_SANITIZER=1`` on a short run of ``mode``: a race ends the run with CSAN's
    report (the log's tail is kept)."""
    result, log = work / "results" / f"sanitizer-{mode}.json", work / "logs" / f"sanitizer-{mode}.log"
    t0 = time.time()
    cmd = [sys.executable, __file__, "one", "--modes", mode, "--steps", "2" if dry else "3", "--result", str(result)]
    # (on the CPU the sanitizer cannot act: the dry run runs the same process without it)
    rc = run_limited(cmd + (["--dry-run"] if dry else []), log, SANITIZER_LIMIT,
                     child_env(dry, **({} if dry else {"TORCH_CUDA_SANITIZER": "1"})))
    text = tail(log, 10 ** 6)
    race = "CSAN detected" in text or "data race" in text
    res = {"exit": rc, "seconds": round(time.time() - t0, 1), "race_reported": race,
           "ok": rc == 0 and not race and result.exists()}
    if not res["ok"]:
        res["log_tail"] = tail(log)
    return res


def group(work: Path, dry: bool, cpu: bool, parts: str, modes) -> dict:
    """Call 2's two-rank group (:func:`group_main`) under ``torch.distributed.run``."""
    name = "cpu_reference" if cpu else "group"
    result, log = work / "results" / f"{name}.json", work / "logs" / f"{name}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), __file__, "group", "--parts", parts, "--result", str(result),
           "--work", str(work)]
    cmd += (["--dry-run"] if dry else []) + (["--cpu"] if cpu else []) + (["--modes", ",".join(modes)] if modes else [])
    t0 = time.time()
    rc = run_limited(cmd, log, GROUP_LIMIT, child_env(dry, **({"OMP_NUM_THREADS": "4"} if cpu and not dry else {})))
    res = json.loads(result.read_text()) if result.exists() else {}
    res.update(exit=rc, seconds=round(time.time() - t0, 1))
    if rc != 0:
        res["log_tail"] = tail(log, 3000)
    return res


def call2(args) -> int:
    """See the module's doc: everything at once, then the checks. ``$OUT`` gets three files (few
    files copy back fastest): ``call2.json``, ``call2.log`` and every job's log and
    result in ``call2_logs.tar.gz``; they are written in a work directory under /tmp."""
    dry, out = args.dry_run, Path(args.out)
    work = Path(f"/tmp/gpu_check_work.{os.getpid()}")
    for d in ("logs", "results"):
        (work / d).mkdir(parents=True, exist_ok=True)
    started = time.time()
    modes = args.modes or CALL2_MODES
    sanitize = [m for m in SANITIZED if m in modes] if not dry else ["acco"]
    compared = [m for m in modes if m not in NOT_COMPARED]
    jobs = {"cuda_tier": lambda: cuda_tier(work, dry, 1 if dry else 4),
            "group": lambda: group(work, dry, False, "replicas,slow,timing,resume", modes),
            "cpu_reference": lambda: group(work, dry, True, "replicas", compared),
            **{f"sanitizer-{m}": (lambda m=m: sanitized(work, dry, m)) for m in sanitize}}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {k: pool.submit(fn) for k, fn in jobs.items()}
        res = {"call": "call2", "dry_run": dry}
        for k, f in futures.items():  # the group's timing waits for the others (its own is last)
            if k != "group":
                f.exception()
        (work / "quiet").touch()
        for k, f in futures.items():
            try:
                res[k] = f.result()
            except Exception as err:  # noqa: BLE001
                res[k] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    import tarfile

    with tarfile.open(out / "call2_logs.tar.gz", "w:gz") as tar:
        for d in ("logs", "results"):
            tar.add(work / d, arcname=d)
    shutil.rmtree(work, ignore_errors=True)
    res["versions"] = res.get("group", {}).get("versions") or {}  # (the group's rank 0 on the GPU)
    res["checks"] = call2_checks(res, modes, sanitize)
    res["seconds"] = round(time.time() - started, 1)
    write_json(out / "call2.json", res)
    print(call2_table(res), flush=True)
    return 0 if all(c.get("ok") is not False for c in res["checks"].values()) else 1


def call2_checks(res: dict, modes, sanitize) -> dict:
    """Each check's verdict (``ok``) and the numbers it rests on."""
    checks: dict = {"cuda_tier": {k: res["cuda_tier"].get(k) for k in ("counts", "failed", "ok")}}
    for m in sanitize:
        checks[f"sanitizer-{m}"] = {"ok": res[f"sanitizer-{m}"].get("ok", False)}
    g, ref = res.get("group", {}), res.get("cpu_reference", {}).get("replicas", {})
    for m in modes:
        r = g.get("replicas", {}).get(m, {})
        c = {"ok": False} if "final_train_loss" not in r else {
            "replicas_identical": r["replicas_identical"], "final_train_loss": r["final_train_loss"],
            "ok": r["replicas_identical"]}
        if "error" in r:
            c["error"] = r["error"]
        if m not in NOT_COMPARED and "final_train_loss" in r:
            cpu = ref.get(m, {}).get("final_train_loss")
            c["cpu_reference"] = cpu
            if cpu is None:
                c["ok"] = False
            else:
                c["rel"] = abs(r["final_train_loss"] - cpu) / abs(cpu)
                c["ok"] = c["ok"] and c["rel"] <= CPU_REFERENCE_TOLERANCE
        checks[f"2ranks-{m}"] = c
    slow = g.get("slow", {})
    for m in ("zero1-trainer", "acco-trainer", "acco"):
        r = slow.get(m, {})
        c = {k: r.get(k) for k in ("computed_share_by_rank", "micro_batches_per_round_by_rank", "replicas_identical")}
        shares = r.get("computed_share_by_rank") if m in TRAINER_LOOP else r.get("micro_batches_per_round_by_rank")
        c["ok"] = bool(shares) and len(shares) == 2 and shares[0] > shares[1] and bool(r.get("replicas_identical"))
        checks[f"slow-{m}"] = c
    t = g.get("timing", {})
    checks["timing"] = {m: {k: t.get(m, {}).get(k) for k in ("tokens_per_s", "vs_zero1")}
                        for m in ("zero1", "zero1-overlap", "acco")}
    checks["timing"]["ok"] = bool(t) and "error" not in t
    r = g.get("resume", {})
    checks["resume"] = {**{k: r.get(k) for k in ("resumed_at", "uninterrupted", "resumed", "rel", "same_parameters")},
                        "ok": r.get("rel") is not None and r["rel"] <= 1e-3}
    for k in ("group", "cpu_reference"):
        if res.get(k, {}).get("exit") not in (0, None):
            checks[k] = {"exit": res[k]["exit"], "ok": False}
    return checks


def call2_table(res: dict) -> str:
    device = res.get("versions", {}).get("device", "CPU, dry run" if res.get("dry_run") else "GPU")
    rows = [f"gpu_check call2 ({device}): {res.get('seconds')} s"]
    for name, c in res["checks"].items():
        verdict = {True: "ok", False: "FAILED", None: "-"}[c.get("ok")]
        detail = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in c.items() if k != "ok"}
        if name == "timing":
            detail = {m: f"{_fmt(v.get('tokens_per_s'))} tok/s, {_fmt(v.get('vs_zero1'), '.2f')}x zero1"
                      for m, v in c.items() if isinstance(v, dict)}
        rows.append(f"{name:<24}{verdict:<8}{json.dumps(detail, default=str)[:150]}")
    return "\n".join(rows)


# -- common ----------------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_json(path: Path, obj) -> None:
    """``obj`` as JSON at ``path``, replaced whole (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


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
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 (no git there)
        out["commit"] = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("call", choices=["call1", "call2", "group", "one"],
                    help="call1 or call2 (group and one: call 2's own processes)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                    help="results directory (default: $OUT, else ./gpu_check_out)")
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU: tiny model, few steps")
    ap.add_argument("--modes", default=None, help=f"a subset of {','.join(MODES)} (default: the call's own)")
    ap.add_argument("--parts", default="replicas,slow,timing,resume", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default="/tmp/gpu_check_work", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else None
    unknown = [m for m in args.modes or () if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if args.call == "group":
        return group_main(args)
    if args.call == "one":
        return one_main(args)
    if not args.dry_run:
        import torch
        if not torch.cuda.is_available():
            ap.error("no CUDA device here: add --dry-run to run the same code on the CPU")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(f"gpu_check {args.call}{' (dry run)' if args.dry_run else ''}: results in {args.out}", flush=True)
    return (call1 if args.call == "call1" else call2)(args)


if __name__ == "__main__":
    sys.exit(main())
