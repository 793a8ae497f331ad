"""How often ds_lowcomm makes the host wait for the device in a training step, per mode and thread.

On a GPU every ``.item()``, ``.tolist()``, ``bool()``, ``float()`` or ``int()`` of a device tensor
stops the host until the GPU has caught up: kernels queued after it wait for the host, and an
overlapped mode loses its overlap. The CPU cannot see a sync, but it sees the calls: in two warm
steps of a real 2-rank run the test counts every such call whose caller is ds_lowcomm, by thread,
and holds each mode to its count, so that none can grow back unseen. ``tools/gpu_check.py call1``
takes the same inventory on a GPU with ``torch.cuda.set_sync_debug_mode``.

A round's verdict (norm, skip, counts) stays on the device and reaches the host as a copy that
the host reads once it has landed (``StepRound.read_verdict``): not a host wait, unless the
reader asked to wait for it, which ``comm_stats()["verdict_waits"]`` counts. The test counts the
two apart: a read inside ``read_verdict`` is the copy's; the waits come from the counter.

The target: none on any thread in ``acco``, ``zero1`` with overlap (inside a round or out). The
synchronous modes wait for the global norm's verdict on the training thread (skip the update or
not: the host decides, as DeepSpeed's step does), once per step. And no device-wide
``synchronize`` in any mode: DeepSpeed's throughput timer (0.19.8) makes one at every forward and
step unless its config says ``"synchronized": false``, which ds_lowcomm sets.
"""
import collections
import threading
import traceback

import pytest
import torch

import workers
from dist import run_ranks

pytestmark = pytest.mark.integration

MODES = workers.STEP_MODES
#: host waits per step on the training thread: the synchronous modes' verdict (it decides on the
#: host whether to update; a verdict wait); none in the overlapped ones
TRAINING_THREAD = {"zero1": 1, "zero1-overlap": 0, "acco": 0, "demo-overlap": 0, "desloc": 1}
#: the comm thread's reads, where a read stalls only communication: per round (DeMo's round
#: checks its encoding and decoding) and rounds per step. The round in flight when the count
#: starts may read inside it.
COMM_THREAD_READS = {"zero1": (0, 0), "zero1-overlap": (0, 0), "acco": (0, 0), "demo-overlap": (0, 0),
                     "desloc": (0, 0)}
#: verdict copies read per step once landed (not waits): a round's, for every round that carries
#: one (acco: its estimate round's counts too)
STAGED_READS = {"zero1": 1, "zero1-overlap": 1, "acco": 2, "demo-overlap": 1, "desloc": 1}
READS = ("item", "tolist", "__bool__", "__float__", "__int__")
WARM, COUNTED = 3, 2


def _count(rank, world):
    from deepspeed.accelerator import get_accelerator

    counts = {}
    for mode, options in MODES.items():
        engine = workers.build_engine(workers.config(mode.split("-")[0], bf16=True, **options))
        workers.train(engine, WARM, rank=rank)
        seen = collections.Counter()
        originals = {name: getattr(torch.Tensor, name) for name in READS}

        def recording(name):
            original = originals[name]

            def read(self, *a, **k):
                ours = [f for f in traceback.extract_stack()[:-1] if "/ds_lowcomm/" in f.filename]
                if ours:
                    where = f"{ours[-1].filename.split('/ds_lowcomm/')[-1]}:{ours[-1].lineno}"
                    thread = "staged" if ours[-1].name == "read_verdict" else threading.current_thread().name
                    seen[(thread, where, name)] += 1
                return original(self, *a, **k)
            return read

        accelerator, device_syncs = get_accelerator(), []
        synchronize = accelerator.synchronize

        def recording_synchronize(*a, **k):  # (a no-op on CPU, a wait for every stream on CUDA)
            device_syncs.append("".join(traceback.format_stack(limit=4)))
            return synchronize(*a, **k)

        for name in READS:
            setattr(torch.Tensor, name, recording(name))
        accelerator.synchronize = recording_synchronize
        waits = engine.optimizer.comm_stats()["verdict_waits"]
        try:
            workers.train(engine, COUNTED, start=WARM, rank=rank)
            seen[("verdict_waits", "-", "-")] = engine.optimizer.comm_stats()["verdict_waits"] - waits
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            accelerator.synchronize = synchronize
        # (named by where the first came from, for the failure's message)
        seen[("any", device_syncs[0] if device_syncs else "-", "synchronize")] = len(device_syncs)
        engine.destroy()
        counts[mode] = seen
    return counts


@pytest.fixture(scope="module")
def counts():
    return run_ranks(_count, 2, timeout=600)[0]


@pytest.mark.parametrize("mode", MODES)
def test_host_reads_per_step(counts, mode):
    per_thread = collections.Counter()
    for (thread, where, name), n in counts[mode].items():
        per_thread[thread] += n
    reads = sorted(counts[mode].items())
    assert per_thread.pop("any") == 0, reads  # no device-wide synchronize
    # (every verdict wait is the training thread's: the synchronous rounds run there)
    assert (per_thread.pop("MainThread", 0) + per_thread.pop("verdict_waits")) / COUNTED == TRAINING_THREAD[mode], reads
    # a landed copy read per round that carries a verdict (the round in flight at either end of
    # the count may be read inside it or not)
    staged = per_thread.pop("staged", 0)
    assert STAGED_READS[mode] * COUNTED - 1 <= staged <= STAGED_READS[mode] * COUNTED + 1, reads
    # (a round in flight at either end of the count may read inside it or not)
    per_round, rounds = COMM_THREAD_READS[mode]
    assert per_thread.pop("ds_lowcomm-comm", 0) <= per_round * (rounds * COUNTED + 1), reads
    assert not per_thread, reads
