"""A 2-rank run that ends as most user scripts do: no ``engine.destroy()``, no
``destroy_process_group``. Run by test_fault.py, a process per rank.

    python ends_without_teardown.py RESULT_PREFIX end    # acco's last round and a preemption
        guard's all-reduce in flight, asynchronous saves on (their own group); each rank writes
        what was still there after ds_lowcomm's exit handler to RESULT_PREFIX<rank>.json
    python ends_without_teardown.py RESULT_PREFIX raise  # rank 0 raises with a round in flight
        that rank 1, alive but stopped, never joins; rank 0 prints the time it raised at
"""
import atexit
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

GROUPS = {}  # name -> ds_lowcomm's process group, filled once the engine exists


def _report() -> None:
    """Registered before ds_lowcomm is imported, so run after its exit handler (atexit is LIFO)."""
    from torch.distributed import distributed_c10d

    registered = sorted(name for name, group in GROUPS.items() if group in distributed_c10d._world.pg_map)
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("ds_lowcomm"))
    with open(f"{sys.argv[1]}{os.environ['RANK']}.json", "w") as f:
        json.dump({"groups_registered": registered, "threads_alive": threads,
                   "imported_before": "ds_lowcomm.integration.engine" in IMPORTED_BEFORE}, f)


IMPORTED_BEFORE = set(sys.modules)
if sys.argv[2] == "end":
    atexit.register(_report)

import workers  # noqa: E402
from ds_lowcomm.integration.preemption import PreemptionGuard  # noqa: E402

rank = int(os.environ["RANK"])
engine = workers.build_engine(workers.config("acco", collective_timeout_s=60.0, async_save=True))
topology = engine.optimizer.topology
GROUPS.update(shard=topology.shard.group, control=topology.control.group, save=engine.checkpointer._group)
guard = PreemptionGuard(topology.control.group)
for step in range(3):
    workers.train(engine, 1, start=step, rank=rank)
    guard.poll()
if sys.argv[2] == "raise":
    if rank == 1:
        time.sleep(120)  # alive, never joining rank 0's next round (the test kills it)
    workers.train(engine, 1, start=3, rank=rank)  # its round waits for rank 1
    print(f"raising at {time.time()}", flush=True)
    raise RuntimeError("a bug in the script")
print("trained", flush=True)
