"""A rank killed at a random point of a save leaves the previous checkpoint resumable, in every mode.

What it proves, per mode, over N trials of real 2-rank gloo jobs (no mocked collectives): a job
trains and saves (default tags, ``global_step<N>``) after every step into one directory; during
its k-th save one random rank gets SIGKILL, either at a random moment (the parent kills it a
uniform random fraction of the job's measured save time after the save starts) or at a random I/O
point of the save (the rank kills itself before or after its n-th file open, torch.save, fsync,
rename, removal or collective; n drawn over the points its previous save had). k is 2 or 3 in a
fresh job (so a previous checkpoint exists), 1 to 3 in a resumed one. Then:

* the surviving rank must exit non-zero on its own (a dead peer's closed sockets, or
  ``collective_timeout_s``), not hang;
* ``latest`` must name the checkpoint being saved or the previous one (the new one whenever a
  rank returned from the save);
* a fresh 2-rank job must ``load_checkpoint`` latest without error, at that step, with exactly the
  parameters (model and fp32 master) each rank logged just before saving it, and train with
  finite losses (2 steps, or 1 when it is killed in its first save). When the killed save re-used
  the tag latest already named (the step count had not moved since the previous save, as under
  acco, whose switches change the model but not the step; or a user's second save at one step),
  that tag may hold the previous save of it (killed before the new one was swapped in) or the
  killed one (after): either, the same on both ranks, and only the killed one once a rank
  returned from it; anything else (a mix, a torn file, an older save) fails.

That fresh job is the next trial's killed job: it trains on, saving into the same directory (and
re-saving the torn tag of the killed save), and is killed in turn; a last job only resumes. After
a failed resume the mode starts over in a new directory.

Ranks are forked from a multiprocessing fork server that has only imported torch, DeepSpeed and
transformers (each rank is a new process with its own process group): a job starts in seconds.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=. \\
        python tests/kill_during_save.py --trials 20 --modes zero1,acco,demo,desloc [--seed S] [--json out.json]
        python tests/kill_during_save.py --trials 4 --modes zero1,acco,desloc --seeds 0-19 [--resave]

``--resave``: every save point saves twice, flushing between (a user's second save at one step;
under acco the flush changes the model, not the step), and each kill is in a second save, so
every trial kills a re-save of the tag ``latest`` names.

Prints a line per trial and a table per mode (per seed, then the totals and the failures by seed
with ``--seeds``); exits 1 if any trial failed. tests/test_kill_during_save.py runs a few seeds.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]  # the working tree's ds_lowcomm, not an installed copy; workers.py

MODES = ("zero1", "acco", "demo", "desloc")
# Small, so that a survivor exits soon after its peer died (it sees closed sockets sooner).
COLLECTIVE_TIMEOUT_S = 10
# Big enough that a save takes a few tenths of a second here (about 4.8M parameters).
N_LAYER, N_EMBD = 6, 256
# Modules the fork server imports once; each rank is forked from it (a fresh process, no
# threads, no process group yet), which saves some 10 s of imports per job on 2 cores.
PRELOAD = ["torch", "torch.distributed", "deepspeed", "transformers.models.gpt2.modeling_gpt2",
           "ds_lowcomm", "workers"]


def lowcomm_options(mode: str) -> dict:
    """The ``lowcomm`` section of each mode, as its tests build it (default options)."""
    extra = {"shard_group_size": 1} if mode in ("demo", "desloc") else {}
    return {"collective_timeout_s": COLLECTIVE_TIMEOUT_S, **extra}


# -- child: one rank of a job -------------------------------------------------------------------

_EVENTS = None  # this rank's end of its pipe to the parent


def emit(**event) -> None:
    # Synchronous and unshared: an event sent before a kill has reached the pipe, and a rank
    # killed mid-send cannot block the other (as a shared queue's lock could).
    _EVENTS.send(event)


class IOPoints:
    """Counts the I/O and collective calls the main thread makes while a save runs and, when
    armed, SIGKILLs this process before or after the n-th of them: a kill at a chosen point of
    the save, made by patching names in this process only (the library is not touched)."""

    def __init__(self) -> None:
        self.in_save = False
        self.count = 0
        self.kill_at = None  # (n, "before" | "after")
        self.main = threading.get_ident()

    def point(self, when: str, label: str) -> None:
        if not self.in_save or threading.get_ident() != self.main:
            return
        if when == "before":
            self.count += 1
        if self.kill_at == (self.count, when):
            emit(ev="io_kill", point=f"{when} {label}", n=self.count)
            os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        import builtins

        import deepspeed.comm
        import torch
        import torch.distributed

        def wrap(owner, name, label_of):
            orig = getattr(owner, name)
            qualified = f"{owner.__name__}.{name}"

            def patched(*args, **kwargs):
                label = f"{qualified}({label_of(args, kwargs)})"
                self.point("before", label)
                out = orig(*args, **kwargs)
                self.point("after", label)
                return out

            setattr(owner, name, patched)

        def path_arg(i):
            return lambda a, k: os.path.basename(str(a[i])) if len(a) > i and isinstance(a[i], (str, os.PathLike)) else ""

        def both_paths(a, k):
            return f"{os.path.basename(str(a[0]))} -> {os.path.basename(str(a[1]))}"

        wrap(os, "replace", both_paths)
        wrap(os, "remove", path_arg(0))
        wrap(os, "makedirs", path_arg(0))

        def fd_path(a, k):
            try:
                return os.path.basename(os.readlink(f"/proc/self/fd/{a[0]}"))
            except OSError:
                return ""

        wrap(os, "fsync", fd_path)
        wrap(torch, "save", path_arg(1))
        wrap(torch.distributed, "barrier", lambda a, k: "")
        wrap(torch.distributed, "all_gather_object", lambda a, k: "")
        wrap(deepspeed.comm, "barrier", lambda a, k: "")
        orig_open = builtins.open

        def open_(file, mode="r", *args, **kwargs):
            if not any(c in mode for c in "wax+"):
                return orig_open(file, mode, *args, **kwargs)
            label = f"open({os.path.basename(str(file))}, {mode})"
            self.point("before", label)
            f = orig_open(file, mode, *args, **kwargs)
            self.point("after", label)
            return f

        builtins.open = open_


def child_entry(plan: dict, rank: int, port: int, events, log_path: str) -> None:
    global _EVENTS
    _EVENTS = events
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)  # DeepSpeed's logs and any traceback, for the report
    os.dup2(log, 2)
    child(plan)


def digest(engine) -> str:
    """The model's parameters and the fp32 master (DeepSpeed's model file holds the one, the
    ranks' files the other: a checkpoint mixing two saves shows in either). Collective."""
    import hashlib

    import workers

    master = engine.optimizer.master_weights()
    return hashlib.sha256((workers.params_digest(engine) + ":").encode()
                          + master.detach().float().cpu().numpy().tobytes()).hexdigest()


def child(plan: dict) -> None:
    import torch

    import workers
    from ds_lowcomm.checkpoint import CheckpointError

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    save_dir = plan["save_dir"]
    victim = plan.get("victim") == rank
    io = IOPoints()
    io.install()  # on every rank: each counts its points, for the next job's draw
    cfg = workers.config(plan["mode"], **lowcomm_options(plan["mode"]))
    # Another seed on resume: every weight must come from the checkpoint.
    seed = plan["job"]
    engine = workers.build_engine(cfg, seed=seed, model=workers.tiny_gpt2(seed, n_layer=N_LAYER, n_embd=N_EMBD))
    data_step = 0
    if plan["resume"]:
        with open(os.path.join(save_dir, "latest")) as f:
            tag = f.read().strip()
        try:
            _, client = engine.load_checkpoint(save_dir)
        except CheckpointError as err:
            emit(ev="load_error", error=str(err))
            os._exit(2)
        data_step = client["data_step"]
        emit(ev="loaded", tag=tag, step=engine.global_steps, digest=digest(engine))
    else:
        emit(ev="fresh")
    target = plan.get("save_index")  # the save this job is killed in; None: the last job
    saves, trained = 0, 0
    counts = []
    while True:
        loss = workers.train(engine, 1, start=data_step, rank=rank)[0]
        data_step += 1
        trained += 1
        emit(ev="loss", data_step=data_step, loss=loss if math.isfinite(loss) else str(loss))
        if target is None and trained >= 2:
            torch.distributed.barrier()
            os._exit(0)
        if target is not None and saves >= target:
            # Past the target save: train on, without saving, until killed (or the peer's death
            # makes a collective fail).
            if trained > 500:
                emit(ev="never_killed")
                os._exit(3)
            continue
        for again in range(2 if plan.get("resave") else 1):
            if again:
                if target is not None and saves >= target:
                    break
                # --resave: a user's second save at one step, after a flush (acco: the model gets
                # the master in place of its estimate; the step count stays): the same tag,
                # other weights. The kill is in such a save.
                engine.optimizer.flush()
            # The step the tag will name and the weights the checkpoint will hold: settle() first,
            # as save_checkpoint does (it changes no weight; under acco it aligns the ranks' steps).
            engine.optimizer.settle()
            step = engine.global_steps
            emit(ev="digest", index=saves + 1, step=step, digest=digest(engine))
            saves += 1
            if victim and plan["how"] == "io" and saves == target:
                # The n-th point of this save, n drawn over the points of the previous one.
                n = 1 + int(plan["io_u"] * (counts[-1] if counts else plan["io_points"][str(rank)]))
                io.kill_at = (n, plan["io_when"])
            emit(ev="save_begin", index=saves, step=step, t=time.time())
            io.in_save, io.count = True, 0
            t0 = time.time()
            engine.save_checkpoint(save_dir, client_state={"data_step": data_step})
            io.in_save = False
            counts.append(io.count)
            emit(ev="save_end", index=saves, step=step, dur=time.time() - t0, points=io.count)
            if victim and saves == target and plan["how"] == "io":
                # The drawn point was past this save's last one: die right after it.
                emit(ev="io_kill", point="after the save returned", n=io.count + 1)
                os.kill(os.getpid(), signal.SIGKILL)


# -- parent -------------------------------------------------------------------------------------

class Job:
    """Two rank processes, their events on a queue, their output in files."""

    def __init__(self, ctx, plan: dict, logdir: str) -> None:
        from dist import free_port

        self.events = queue.Queue()
        self.all = []
        self.procs, self.readers, self.logs = [], [], []
        port = free_port()
        for rank in range(2):
            log_path = os.path.join(logdir, f"job{plan['job']:03d}_rank{rank}.log")
            self.logs.append(log_path)
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=child_entry, args=(plan, rank, port, send, log_path), daemon=True)
            p.start()
            send.close()  # the rank holds the only writer: its death ends the reader
            self.procs.append(p)
            t = threading.Thread(target=self._read, args=(rank, recv), daemon=True)
            t.start()
            self.readers.append(t)

    def _read(self, rank: int, conn) -> None:
        while True:
            try:
                ev = conn.recv()
            except Exception:  # EOF: the rank is dead (maybe mid-send: a torn message)
                break
            ev["rank"] = rank
            self.events.put(ev)
        self.events.put({"ev": "exit", "rank": rank})

    def next_event(self, deadline: float):
        try:
            ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        self.all.append(ev)
        return ev

    def wait(self, rank: int, deadline: float):
        """The rank's exit code (-9: SIGKILL), or None if it still runs at the deadline."""
        self.procs[rank].join(timeout=max(0.0, deadline - time.monotonic()))
        return self.procs[rank].exitcode

    def kill(self, rank: int) -> None:
        if self.procs[rank].exitcode is None:
            self.procs[rank].kill()

    def finish(self) -> None:
        for r in range(2):
            self.kill(r)
            self.procs[r].join()
        for t in self.readers:
            t.join(timeout=10)
        while self.next_event(time.monotonic()) is not None:
            pass

    def of(self, rank: int, ev: str) -> list:
        return [e for e in self.all if e["rank"] == rank and e["ev"] == ev]

    def log_tail(self, rank: int, lines: int = 6) -> str:
        with open(self.logs[rank], errors="replace") as f:
            return "".join(f.readlines()[-lines:])


def error_line(path: str) -> str:
    """The survivor's last line naming an error (what it died of)."""
    with open(path, errors="replace") as f:
        hits = [l.strip() for l in f if "Error" in l]
    return hits[-1][:200] if hits else ""


def run_job(ctx, plan: dict, logdir: str, startup_s: float = 300) -> dict:
    """Start a job, kill its victim as planned, wait for both ranks; returns what happened."""
    job = Job(ctx, plan, logdir)
    out = {"kill": None}
    try:
        deadline = time.monotonic() + startup_s
        v = plan.get("victim")
        if plan.get("how") == "time":
            begun = None
            while begun is None:
                ev = job.next_event(deadline)
                if ev is None or (ev["ev"] == "exit" and ev["rank"] == v):
                    break
                if ev["rank"] == v and ev["ev"] == "save_begin" and ev["index"] == plan["save_index"]:
                    begun = ev
            if begun is not None:
                durs = [e["dur"] for e in job.of(v, "save_end")] or [plan["save_s"]]
                delay = plan["time_u"] * sum(durs) / len(durs)
                time.sleep(max(0.0, begun["t"] + delay - time.time()))
                job.kill(v)
                # As killed (later than drawn if the event reached us late).
                out["kill"] = {"delay_s": round(time.time() - begun["t"], 3), "save_s": round(sum(durs) / len(durs), 3)}
        if v is not None:
            out["victim_rc"] = job.wait(v, deadline)
            died = time.monotonic()
            # The survivor must see its peer gone and exit by itself.
            out["survivor_rc"] = job.wait(1 - v, time.monotonic() + COLLECTIVE_TIMEOUT_S + 45)
            out["survivor_s"] = round(time.monotonic() - died, 1)
        else:
            out["rcs"] = [job.wait(r, deadline) for r in range(2)]
    finally:
        job.finish()
    out["job"] = job
    return out


def draw_plan(rng: random.Random, resumed: bool) -> dict:
    how = rng.choice(["time", "io"])
    # A fresh job's first save has no previous checkpoint; a resumed job's has the one it loaded
    # (and under acco it may re-save that very tag: the step count can lag after a resume).
    plan = {"victim": rng.randrange(2), "how": how, "save_index": rng.choice([1, 2, 3] if resumed else [2, 3])}
    if how == "time":
        plan["time_u"] = rng.random()
    else:
        plan["io_u"], plan["io_when"] = rng.random(), rng.choice(["before", "after"])
    return plan


def check_resume(job, plan: dict, expect: dict) -> tuple:
    """Problems with a resumed job's load, against what the killed job left (empty: resumed), and
    which save it resumed: "new" (the killed one), "previous" (the complete one before it, maybe
    of the same tag), "either" (a re-saved tag whose two saves had the same weights), or None
    (not resumed)."""
    problems, which = [], []
    for r in range(2):
        errs = job.of(r, "load_error")
        if errs:
            problems.append(f"rank {r}: load_checkpoint raised CheckpointError: {errs[0]['error']}")
            continue
        loaded = job.of(r, "loaded")
        if not loaded:
            problems.append(f"rank {r}: never loaded; its log: {job.log_tail(r)}")
            continue
        got = loaded[0]
        if got["tag"] != expect["tag"] or f"global_step{got['step']}" != expect["tag"]:
            problems.append(f"rank {r}: loaded {got['tag']} at step {got['step']}, expected {expect['tag']}")
        else:
            matched = [label for label, digests in expect["candidates"] if digests[r] == got["digest"]]
            if not matched:
                problems.append(f"rank {r}: parameters after load differ from those logged before "
                                f"{' and '.join(l for l, _ in expect['candidates']) or 'any save'} of "
                                f"{expect['tag']}")
            # Both, when the killed save had the previous one's weights (zero1's re-save: nothing
            # changed in between): which of them the tag holds does not show.
            which.append(None if not matched else matched[0] if len(matched) == 1 else "either")
        # Every step after the load; 2 at least unless the job was killed in its first save.
        losses = [e["loss"] for e in job.of(r, "loss")]
        need = 1 if plan.get("save_index") == (2 if plan.get("resave") else 1) else 2
        if len(losses) < need or not all(isinstance(l, float) and math.isfinite(l) for l in losses):
            problems.append(f"rank {r}: the steps after the load gave losses {losses}")
    specific = sorted({w for w in which if w not in (None, "either")})
    if len(specific) > 1:
        problems.append(f"the ranks loaded different saves of {expect['tag']}: rank 0 {which[0]}, rank 1 {which[1]}")
    resumed = None if len(which) < 2 or None in which or len(specific) > 1 else specific[0] if specific else "either"
    return problems, (None if resumed is None else "new" if resumed == expect["new"]
                      else resumed if resumed == "either" else "previous")


def judge_kill(job, plan: dict, save_dir: str, res: dict) -> tuple:
    """What a killed job left: (expected resume, problems, details)."""
    v, k = plan["victim"], plan["save_index"]
    steps = {e["index"]: e["step"] for e in job.of(v, "save_begin")}
    problems, info = [], {}
    if k not in steps:
        return None, [f"the victim never began save {k}; its log: {job.log_tail(v)}"], info
    loaded = job.of(v, "loaded")
    new = f"global_step{steps[k]}"
    prev = f"global_step{steps[k - 1]}" if k > 1 else loaded[0]["tag"]
    info.update(new=new, prev=prev)
    io_kill = job.of(v, "io_kill")
    info["point"] = io_kill[0]["point"] if io_kill else None
    info["after_save"] = any(e["index"] == k for e in job.of(v, "save_end"))
    if res["victim_rc"] != -signal.SIGKILL:
        problems.append(f"victim rank {v} exited with {res['victim_rc']}, not by SIGKILL; its log: {job.log_tail(v)}")
    if res["survivor_rc"] is None:
        problems.append(f"survivor rank {1 - v} did not exit within {COLLECTIVE_TIMEOUT_S + 45}s of its "
                        "peer's death (killed)")
    elif res["survivor_rc"] == 0:
        problems.append(f"survivor rank {1 - v} exited 0")
    info["survivor"] = error_line(job.logs[1 - v])
    latest_path = os.path.join(save_dir, "latest")
    latest = None
    if os.path.isfile(latest_path):
        with open(latest_path) as f:
            latest = f.read().strip()
    info["latest"] = latest
    finished = [r for r in range(2) if any(e["index"] == k for e in job.of(r, "save_end"))]
    if latest not in (prev, new):
        problems.append(f"latest names {latest!r}, expected {prev} or {new}")
    elif finished and latest != new:
        problems.append(f"rank(s) {finished} returned from saving {new} but latest names {latest}")
    # What the checkpoint latest names may hold: the last complete save of that tag (this job's
    # last earlier save of it, or the one this job loaded) and, if latest names the killed save's
    # tag, the killed save itself. A tag is re-saved when the step count has not moved since its
    # previous save (under acco, or a user's second save at one step): the killed save is then
    # written beside the tag and swapped in whole, so the tag holds either the previous save of it
    # (killed before the swap) or the killed one (after it), never a mix. Once a rank returned from
    # the killed save, only the killed save. Each candidate: the digests each rank logged.
    candidates = []  # (label, {rank: digest})
    if loaded and loaded[0]["tag"] == latest:
        candidates.append(("loaded", {r: next((e["digest"] for e in job.of(r, "loaded")), None)
                                      for r in range(2)}))
    for i in sorted(steps):
        if i < k and f"global_step{steps[i]}" == latest:
            candidates.append((f"save {i}", {r: next((e["digest"] for e in job.of(r, "digest") if e["index"] == i),
                                                     None) for r in range(2)}))
    candidates = candidates[-1:]  # superseded: any earlier complete save of that tag
    if latest == new:
        if finished or prev != new:
            candidates = []  # latest was written by (or after the swap of) the killed save
        candidates.append((f"save {k}", {r: next((e["digest"] for e in job.of(r, "digest") if e["index"] == k),
                                                 None) for r in range(2)}))
    info["same_tag"] = prev == new
    return {"tag": latest, "candidates": candidates, "new": f"save {k}"}, problems, info


def run_mode(ctx, mode: str, trials: int, rng: random.Random, workdir: str, job_ids, resave: bool = False) -> list:
    results = []
    chain = 0
    save_dir = os.path.join(workdir, f"{mode}_chain{chain}")
    pending = None  # the killed trial whose resume the next job checks
    # A job killed in its first save has no save of its own to measure: the last job's numbers.
    measured = {"save_s": 0.5, "io_points": {"0": 20, "1": 10}}
    while pending is not None or len(results) < trials:
        plan = draw_plan(rng, pending is not None) if len(results) + (pending is not None) < trials else {}
        if resave and "save_index" in plan:
            plan["save_index"] *= 2  # the second save at the drawn save point (its tag re-saved)
        plan.update(mode=mode, save_dir=save_dir, resume=pending is not None, job=next(job_ids),
                    resave=resave, **measured)
        t0 = time.monotonic()
        res = run_job(ctx, plan, workdir)
        job = res["job"]
        if pending is not None:
            trial, pending = pending, None
            found, which = check_resume(job, plan, trial.pop("expect"))
            problems = trial["problems"] + found
            trial["which"] = which
            if plan.get("victim") is None and any(rc != 0 for rc in res["rcs"]):
                problems.append(f"the last job exited with {res['rcs']}; its log: {job.log_tail(0)}")
            trial.update(ok=not problems, problems=problems, resume_s=round(time.monotonic() - t0, 1))
            results.append(trial)
            print_trial(mode, trial)
            if problems:
                # This job's kill is not counted: start the mode over in a fresh directory.
                chain += 1
                save_dir = os.path.join(workdir, f"{mode}_chain{chain}")
                continue
        if plan.get("victim") is None:
            break
        ends = [job.of(r, "save_end") for r in range(2)]
        if ends[0] and ends[1]:
            measured = {"save_s": ends[plan["victim"]][-1]["dur"],
                        "io_points": {str(r): ends[r][-1]["points"] for r in range(2)}}
        expect, problems, info = judge_kill(job, plan, save_dir, res)
        trial = {"trial": len(results) + 1, "mode": mode, "job": plan["job"],
                 **{k: plan[k] for k in ("victim", "how", "save_index")},
                 "kill": res["kill"], **info, "victim_rc": res["victim_rc"],
                 "survivor_rc": res["survivor_rc"], "survivor_s": res["survivor_s"]}
        if expect is None:
            trial.update(ok=False, problems=problems, which=None)
            results.append(trial)
            print_trial(mode, trial)
            chain += 1
            save_dir = os.path.join(workdir, f"{mode}_chain{chain}")
            continue
        trial.update(which=None, expect=expect, problems=problems)
        pending = trial
    return results


def print_trial(mode: str, t: dict) -> None:
    if t.get("how") == "io":
        where = f"io:{t.get('point')}"
    else:
        k = t.get("kill") or {}
        where = f"time:{k.get('delay_s')}s of ~{k.get('save_s')}s save"
    if t.get("after_save"):
        where += " (after the save returned)"
    status = "OK  " if t["ok"] else "FAIL"
    print(f"{status} {mode:6s} #{t['trial']:02d} kill rank {t['victim']} in save {t['save_index']} "
          f"({t.get('new')}{', re-saving latest' if t.get('same_tag') else ''}) at {where}; "
          f"latest={t.get('latest')} -> resumed {t.get('which')}; "
          f"survivor rc={t.get('survivor_rc')} after {t.get('survivor_s')}s", flush=True)
    for p in t["problems"]:
        print(f"     problem: {p}", flush=True)


COLUMNS = [("trials", "trials"), ("resumed_ok", "resumed OK"), ("new", "resumed new"),
           ("previous", "resumed previous"), ("either", "resumed either"), ("same_tag", "re-saved latest tag"),
           ("in_save", "killed inside the save"), ("io_kills", "io-point kills"),
           ("time_kills", "random-time kills"), ("survivor_nonzero", "survivor exited non-zero"),
           ("failed", "failed")]


def summarize(mode: str, rs: list) -> dict:
    return {"mode": mode, "trials": len(rs), "resumed_ok": sum(r["ok"] for r in rs),
            "new": sum(r["ok"] and r["which"] == "new" for r in rs),
            "previous": sum(r["ok"] and r["which"] == "previous" for r in rs),
            "either": sum(r["ok"] and r["which"] == "either" for r in rs),
            "same_tag": sum(bool(r.get("same_tag")) for r in rs),
            "in_save": sum(not r.get("after_save") for r in rs),
            "io_kills": sum(r["how"] == "io" for r in rs),
            "time_kills": sum(r["how"] == "time" for r in rs),
            "survivor_nonzero": sum(r.get("survivor_rc") not in (None, 0) for r in rs),
            "failed": sum(not r["ok"] for r in rs)}


def print_table(summary: list) -> None:
    print("\n" + "mode    " + " | ".join(title for _, title in COLUMNS))
    for row in summary:
        print(f"{row['mode']:7s} " + " | ".join(f"{row[k]:{len(title)}d}" for k, title in COLUMNS))


def parse_seeds(spec: str) -> list:
    """``"0-9"`` (a range, both ends included), ``"3,77,1000"``, or a mix: ``"0-4,77"``."""
    seeds = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="kills per mode (per seed)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=None, help="draws of victims, kinds and points (default: random)")
    ap.add_argument("--seeds", default=None, help="run every mode once per seed, e.g. 0-19 or 3,77: "
                    "a table per seed, failures by seed, and the totals")
    ap.add_argument("--resave", action="store_true", help="save twice at every save point, flushing "
                    "between, and kill in a second save: a re-saved tag in every trial, whose weights "
                    "changed under acco (past its first step) and demo")
    ap.add_argument("--json", default=None, help="write every trial and the summary here")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and logs")
    args = ap.parse_args(argv)
    if args.seeds is not None:
        seeds = parse_seeds(args.seeds)
    else:
        seeds = [args.seed if args.seed is not None else random.SystemRandom().randrange(10 ** 6)]
    # Before the fork server starts: its ranks inherit them.
    os.environ.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    workdir = tempfile.mkdtemp(prefix="kill_during_save_")
    print(f"seed(s) {args.seeds or seeds[0]}; checkpoints and logs in {workdir}", flush=True)
    job_ids = iter(range(10 ** 6))
    t0 = time.monotonic()
    modes = args.modes.split(",")
    by_seed = {}
    for seed in seeds:
        rng = random.Random(seed)  # a seed draws the same trials whatever the other seeds run
        seed_dir = os.path.join(workdir, f"seed{seed}") if len(seeds) > 1 else workdir
        os.makedirs(seed_dir, exist_ok=True)
        if len(seeds) > 1:
            print(f"\n-- seed {seed}", flush=True)
        results = {mode: run_mode(ctx, mode, args.trials, rng, seed_dir, job_ids, args.resave) for mode in modes}
        summary = [summarize(mode, rs) for mode, rs in results.items()]
        print_table(summary)
        by_seed[seed] = {"summary": summary, "trials": results}
    totals = [summarize(mode, [r for s in by_seed.values() for r in s["trials"][mode]]) for mode in modes]
    failed = sum(r["failed"] for r in totals)
    if len(seeds) > 1:
        print(f"\n== totals over {len(seeds)} seeds ({args.seeds})", end="")
        print_table(totals)
        bad = {seed: {row["mode"]: row["failed"] for row in s["summary"] if row["failed"]}
               for seed, s in by_seed.items()}
        bad = {seed: modes_ for seed, modes_ in bad.items() if modes_}
        print("\nfailed trials by seed: " + (", ".join(f"{seed}: " + " ".join(f"{m} {n}" for m, n in ms.items())
                                                     for seed, ms in bad.items()) or "none"))
    print(f"\n{failed} failed trial(s); {time.monotonic() - t0:.0f}s; seed(s) {args.seeds or seeds[0]}")
    if args.json:
        with open(args.json, "w") as f:
            out = ({"seed": seeds[0], **by_seed[seeds[0]]} if args.seeds is None
                   else {"seeds": seeds, "summary": totals, "by_seed": by_seed})
            json.dump(out, f, indent=1)
    if failed or args.keep:
        print(f"kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
