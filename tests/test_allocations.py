"""No parameter-sized temporary in any mode's step: an allocation audit of two steps per mode.

Persistent buffers (the formulas of docs/benchmarks.md, "Memory per GPU") are allocated when the engine
is built; what a step allocates beyond them must be bounded by chunk and bucket sizes, never by
the model, except the step buffers a mode's formula names (``STEP_BUFFERS``). A
``TorchDispatchMode`` on the training thread and on the comm worker's thread records every op's
newly allocated result (views, in-place results and ``torch.empty``, from which
``comm.temporary`` cuts its chunk buffers, aside) while the model's activations stay small: a
1024-wide GPT-2 of 2 layers on 32 tokens (26M parameters, shards of 13M elements at W = 2).
"""
import math
import traceback

import pytest
import torch

import workers
from dist import run_ranks
from ds_lowcomm.shard.buckets import BUCKET_BYTES

pytestmark = pytest.mark.integration

MODES = workers.STEP_MODES
#: step buffers of a shard's size that a mode's formula counts (docs/benchmarks.md, "Memory per GPU"), as
#: (allocating function, op, dtype): acco's estimate round writes the estimated parameters into a
#: shard in the model's dtype (p/W); DeMo's round builds the new δ beside the old one (4/S) and
#: its codec holds the tiled shard, the decoded sums and their counts, the dense decode (fp32)
STEP_BUFFERS = {
    "acco": {("modes/acco.py:update", "aten.empty_like.default", "torch.bfloat16")},
    "demo-overlap": {("modes/demo.py:run", "aten.mul.Tensor", "torch.float32"),
                     ("modes/dct.py:to_tiles", "aten.cat.default", "torch.float32"),
                     ("modes/dct.py:from_tiles", "aten.new_empty.default", "torch.float32"),
                     ("modes/dct.py:dense", "aten.zeros.default", "torch.float32"),
                     ("modes/dct.py:decode_mean", "aten.zeros.default", "torch.float32"),
                     ("modes/dct.py:decode_mean", "aten.zeros_like.default", "torch.float32")},
}
#: elements: the largest bounded step buffer, a parameter bucket's W copies (zero1's overlap
#: gathers BUCKET_BYTES of fp32 at a time); a shard here holds twice that
LIMIT = BUCKET_BYTES // 4


def _audit(rank, world):
    from torch.utils._python_dispatch import TorchDispatchMode

    import ds_lowcomm.comm.worker as worker

    found, limit = [], LIMIT

    class Audit(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format:
                return result
            held = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor)}
            for r in torch.utils._pytree.tree_leaves(result):
                if isinstance(r, torch.Tensor) and r.numel() > limit and r.untyped_storage().data_ptr() not in held:
                    ours = [f for f in traceback.extract_stack() if "/ds_lowcomm/" in f.filename]
                    where = f"{ours[-1].filename.split('/ds_lowcomm/')[-1]}:{ours[-1].name}" if ours else "-"
                    found.append((where, str(func), tuple(r.shape), str(r.dtype)))
            return result

    real_execute = worker.CommWorker._execute

    def audited(self, ticket, stream=None):
        with Audit():
            return real_execute(self, ticket, stream)

    results = {}
    for mode, options in MODES.items():
        model = workers.tiny_gpt2(n_layer=2, n_embd=1024)
        # One parameter's gradient is as large as the parameter: the largest one sets the bound.
        limit = max(LIMIT, max(p.numel() for p in model.parameters()))
        cfg = workers.config(mode.split("-")[0], bf16=True, **options)
        # One sequence per micro-batch: bf16 matmuls are slow on a CPU, and the step's buffers,
        # which this audits, do not depend on the batch.
        cfg["train_micro_batch_size_per_gpu"] = 1
        engine = workers.build_engine(cfg, model=model)
        workers.train(engine, 2, rank=rank)  # warm: first-step allocations
        found.clear()
        worker.CommWorker._execute = audited
        try:
            with Audit():
                workers.train(engine, 2, start=2, rank=rank)
        finally:
            worker.CommWorker._execute = real_execute
        results[mode] = (sorted(set(found)), engine.optimizer.mode.ctx.flat.layout.shard_size)
        engine.destroy()
    return results


@pytest.fixture(scope="module")
def audit():
    return run_ranks(_audit, 2, timeout=900)


@pytest.mark.parametrize("mode", MODES)
def test_no_parameter_sized_temporary(audit, mode):
    for rank, res in enumerate(audit):
        found, shard = res[mode]
        allowed = STEP_BUFFERS.get(mode, set())
        unexpected = [f for f in found if (f[0], f[1], f[3]) not in allowed]
        assert unexpected == [], (rank, unexpected)
        # the formula's step buffers: never more than a shard (DeMo's tiles: padded to whole tiles)
        assert all(math.prod(f[2]) <= 1.05 * shard for f in found), (rank, found, shard)
