"""2 ranks time ``predict_sync_s`` on the link they run behind, then an all-reduce of the size it
predicted; run by test_auto.py inside a rate-limited network namespace. Prints one JSON line.

    python probe_on_link.py NUMEL
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from dist import run_ranks  # noqa: E402


def _probe(rank, world, numel):
    import torch
    import torch.distributed as dist

    from ds_lowcomm.auto import predict_sync_s

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    control = dist.new_group(list(range(world)), backend="gloo")
    start = time.perf_counter()
    predicted = predict_sync_s(group, numel, torch.device("cpu"), control)
    cost = time.perf_counter() - start
    # the reference: the all-reduce itself, back to back so that a token bucket's burst is spent
    # by the first and the second runs at the link's rate
    t = torch.zeros(numel)
    timed = []
    for _ in range(2):
        dist.barrier(group=control)
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        timed.append(time.perf_counter() - start)
    return {"predicted": predicted, "cost": cost, "timed": timed[-1]}


if __name__ == "__main__":
    print(json.dumps(run_ranks(_probe, 2, int(sys.argv[1]))), flush=True)
