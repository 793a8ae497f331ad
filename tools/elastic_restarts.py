"""Elastic restarts measured: 4 ranks as 2 torchrun agents, one agent killed at a random step.

Each trial starts two ``torchrun`` agents of 2 ranks each on this machine (c10d rendezvous, ``--nnodes
1:2``, ``--max-restarts 3``) running ``examples/train.py --save-every S --resume auto``; at a random
step one agent and its workers get SIGKILL (a node lost). The survivor's workers fail on the dead
peers' closed sockets, its agent re-forms the job at 2 ranks, and they resume from the newest
complete checkpoint (saved at 4 ranks: every mode reshards on load) and must finish. The survivor's
agent hosts the rendezvous store (``is_host``): a job whose store dies cannot re-form, so on a
cluster the store lives on a host that stays.

Per trial: whether the survivor finished (exit 0, the last step reached), the seconds from the
kill to the first step after the restart, and the steps lost (the step at the kill minus the step
resumed from; at most the save interval).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python tools/elastic_restarts.py --kills 20 \\
        --modes zero1,acco,demo,desloc [--save-every 5] [--seed S] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train.py")
CONFIGS = {"zero1": "zero1", "acco": "acco_zero1", "demo": "demo_zero1", "desloc": "desloc_zero1"}
MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--eval-iters", "1"]
#: c10d's rendezvous settings for a quick re-form: the survivor waits this long for late joiners
RDZV_CONF = "last_call_timeout=2,join_timeout=120,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
STEP = re.compile(r"^step (\d+)/(\d+) \|")
RESUMED = re.compile(r"^resumed from .* at step (\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """One torchrun agent (a "node" of 2 ranks) in its own process group; its output read on a
    thread, each line with the time it arrived."""

    def __init__(self, port: int, run_id: str, args, hosts_store: bool) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
               "--rdzv-conf", f"{RDZV_CONF},is_host={str(hosts_store).lower()}", "--max-restarts", "3", SCRIPT, *MODEL,
               "--deepspeed", CONFIGS[args.mode], "--max-steps", str(args.max_steps), "--eval-every", "0",
               "--log-every", "1", "--save-every", str(args.save_every), "--save-dir", args.save_dir,
               "--resume", "auto"]
        # torch's c10d rendezvous shares one TCP store with the workers across rounds, so a
        # restarted worker can read the previous round's addresses (pytorch/pytorch#135712):
        # each round gets its own store.
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines = []  # (time, line)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def kill(self) -> None:
        """SIGKILL to the agent and its workers (torchrun starts each worker in its own session)."""
        workers = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in [self.proc.pid, *map(int, workers)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def last_step(agents) -> int:
    steps = [int(m.group(1)) for a in agents for _, line in list(a.lines) if (m := STEP.match(line))]
    return max(steps, default=0)


def trial(mode: str, kill_at: int, args) -> dict:
    save_dir = tempfile.mkdtemp(prefix=f"elastic_{mode}_")
    targs = argparse.Namespace(mode=mode, max_steps=args.max_steps, save_every=args.save_every, save_dir=save_dir)
    port, run_id = free_port(), f"{mode}{random.randrange(1 << 30)}"
    survivor = Agent(port, run_id, targs, hosts_store=True)
    victim = Agent(port, run_id, targs, hosts_store=False)
    deadline = time.time() + args.timeout
    while last_step([survivor, victim]) < kill_at:
        if time.time() > deadline or survivor.proc.poll() is not None:
            victim.kill()
            survivor.kill()
            shutil.rmtree(save_dir, ignore_errors=True)
            return {"mode": mode, "kill_at": kill_at, "finished": False, "error": "never reached the kill step",
                    "tail": [line for _, line in (survivor.lines + victim.lines)[-12:]]}
        time.sleep(0.02)
    at_kill = last_step([survivor, victim])
    t_kill = time.time()
    victim.kill()
    try:
        code = survivor.proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        survivor.kill()
        code = "timeout"
    survivor.thread.join(timeout=5)
    after = [(t, line) for t, line in survivor.lines if t > t_kill]
    resumes = [(t, int(m.group(1))) for t, line in after if (m := RESUMED.match(line))]
    resumed = [step for _, step in resumes]
    # the first step printed after the resume (not one the dying workers printed after the kill)
    first = next((t for t, line in after if resumes and t >= resumes[0][0] and STEP.match(line)), None)
    final = last_step([survivor])
    shutil.rmtree(save_dir, ignore_errors=True)
    return {"mode": mode, "kill_at": at_kill, "exit": code, "finished": code == 0 and final == args.max_steps,
            "resumed_from": resumed[0] if resumed else None,
            "steps_lost": at_kill - resumed[0] if resumed else None,
            "seconds_to_first_step": round(first - t_kill, 1) if first else None,
            "tail": [line for _, line in survivor.lines[-12:]] if code != 0 else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="trials per mode")
    ap.add_argument("--modes", default=",".join(CONFIGS))
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300, help="seconds a phase may take before the trial fails")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    results = []
    for mode in args.modes.split(","):
        for k in range(args.kills):
            r = trial(mode, rng.randint(args.save_every + 1, args.max_steps - 10), args)
            results.append(r)
            print(json.dumps(r), flush=True)
    print("\n| mode | finished | steps lost (max) | seconds from kill to first step (median, max) |")
    print("|---|---|---|---|")
    for mode in args.modes.split(","):
        rs = [r for r in results if r["mode"] == mode]
        lost = [r["steps_lost"] for r in rs if r.get("steps_lost") is not None]
        secs = sorted(r["seconds_to_first_step"] for r in rs if r.get("seconds_to_first_step") is not None)
        med = secs[len(secs) // 2] if secs else None
        print(f"| {mode} | {sum(r['finished'] for r in rs)} of {len(rs)} | {max(lost, default='-')} | "
              f"{med}, {max(secs, default='-')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["finished"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
