"""Run a function on N real processes forming a gloo group (DeepSpeed's CPU accelerator)."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable, List, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: imported once by the fork server that every group of ranks is forked from: a fresh process
#: with no threads and no process group, without the ~5 s of imports a spawned rank pays on 2 cores
PRELOAD = ["torch", "torch.distributed", "deepspeed", "transformers.models.gpt2.modeling_gpt2",
           "ds_lowcomm", "workers"]


def _context(fresh: bool):
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: on the first group only
    return ctx


def _entry(fn, rank, world, port, args, results, extra_env):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    os.environ.update(extra_env or {})
    try:
        import torch

        torch.set_num_threads(1)
        # Pickled here: tensors sent through the queue as-is would be shared memory that dies
        # with this process.
        results.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException as err:  # report to the parent, which fails the test
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 300,
              env: Optional[dict] = None) -> List[Any]:
    """``fn(rank, world, *args)`` on ``world`` new processes; returns results by rank.

    Ranks are forked from a fork server that has imported ``PRELOAD``; with ``env`` they are
    spawned instead (fresh interpreters), since such variables may act at import or at start-up.
    Raises if any rank raised, or if the group does not finish within ``timeout`` seconds.
    """
    ctx = _context(fresh=env is not None or os.environ.get("DIST_SPAWN") == "1")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, results, env)) for r in range(world)]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}: {value}")
            if errors:
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout}s; finished ranks: {sorted(out)}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world)]
