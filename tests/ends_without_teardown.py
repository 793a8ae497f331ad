"""A 2-rank run that ends as most user scripts do: no ``engine.destroy()``, no
``destroy_process_group``, acco's last round in flight and a preemption guard's all-reduce pending.
Run by test_fault.py, a process per rank; each rank writes what was still alive after ds_lowcomm's
exit handler to ``RESULT_PREFIX<rank>.json``.

    python ends_without_teardown.py RESULT_PREFIX
"""
import atexit
import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(__file__))

GROUPS = {}  # name -> ds_lowcomm's process group, filled once the engine exists


def _report() -> None:
    """Registered before ds_lowcomm is imported, so run after its exit handler (atexit is LIFO)."""
    from torch.distributed import distributed_c10d

    alive = sorted(name for name, group in GROUPS.items() if group in distributed_c10d._world.pg_map)
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("ds_lowcomm"))
    with open(f"{sys.argv[1]}{os.environ['RANK']}.json", "w") as f:
        json.dump({"groups_alive": alive, "threads_alive": threads,
                   "imported_before": "ds_lowcomm.integration.engine" in IMPORTED_BEFORE}, f)


IMPORTED_BEFORE = set(sys.modules)
atexit.register(_report)

import workers  # noqa: E402
from ds_lowcomm.integration.preemption import PreemptionGuard  # noqa: E402

engine = workers.build_engine(workers.config("acco"))
topology = engine.optimizer.topology
GROUPS.update(shard=topology.shard.group, control=topology.control.group)
guard = PreemptionGuard(topology.control.group)
for step in range(3):
    workers.train(engine, 1, start=step, rank=int(os.environ["RANK"]))
    guard.poll()
print("trained", flush=True)
