"""Kernel launches per round under the GPU's chunk policy, counted on the CPU.

On a GPU every aten op a round issues is at least one kernel launch from Python, on the comm
worker's thread where the round runs there: a loop over 8 MiB chunks was about 2,000 launches per
acco step at 86M parameters, competing for the GIL with the training thread. Rounds must issue a
number of ops that does not grow with the model (up to the GPU's 64 MiB chunk). The test sets the
CPU's chunk to the GPU's (``memory.CHUNK_BYTES``, which :func:`ds_lowcomm.memory.step_chunk_bytes`
reads) and counts, with a ``TorchDispatchMode`` on each thread, the aten ops that launch a kernel
(views and allocations do not) in the rounds of a real 2-rank gloo run of each mode, at two model
sizes 32 times apart, the larger one's shard (4.2M elements) beyond the CPU's 8 MiB chunk.
"""
import pytest
import torch

from dist import run_ranks

pytestmark = pytest.mark.ranks

GAS, STEPS = 4, 4
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
#: the most kernel-launching aten ops a round may issue (a step's, for a synchronous mode)
MAX_OPS = 40
#: (DeMo's round, about 105-115 ops with its codec, and desloc's replica syncs still grow with
#: the model: not held here yet)
MODES = {
    "zero1": {"mode": "zero1"},
    "zero1-overlap": {"mode": "zero1", "zero1": {"overlap": True}},
    "acco": {"mode": "acco", "acco": {"accumulate_while_waiting": False, "balance": False}},
}


def _ops_per_round(rank, world, width):

    from torch.utils._python_dispatch import TorchDispatchMode

    import ds_lowcomm.comm.worker as worker_mod
    import workers
    from ds_lowcomm import memory
    from ds_lowcomm.modes import MODES as REGISTRY

    aten = torch.ops.aten
    NO_KERNEL = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
                 aten._unsafe_view.default, aten.lift_fresh.default}
    memory.CHUNK_BYTES = memory.DEVICE_CHUNK_BYTES  # the GPU's chunk policy
    per_round = []  # ops of each round the comm worker ran

    class Count(TorchDispatchMode):
        """Ops that launch a kernel (or a collective) on a GPU: views and allocations do not."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func not in NO_KERNEL:
                self.ops += 1
            return func(*args, **(kwargs or {}))

    real_execute = worker_mod.CommWorker._execute

    def counting(self, ticket, stream=None):
        count = Count()
        count.ops = 0
        with count:
            try:
                return real_execute(self, ticket, stream)
            finally:
                per_round.append(count.ops)

    worker_mod.CommWorker._execute = counting
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    try:
        for name, lowcomm in MODES.items():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
            cfg, ctx, _ = workers.mode_context(lowcomm, model, GAS, HP)
            grads, topo, worker, mode_cls = ctx.grads, ctx.topology, ctx.worker, REGISTRY[cfg.mode]
            asynchronous = worker is not None
            mode = mode_cls(ctx, cfg.mode_options)
            mode.bind_loop(False)
            g = torch.Generator().manual_seed(rank)
            per_round.clear()
            step_ops = []  # a synchronous mode's: the ops of each step (its round runs there)
            for t in range(STEPS):
                grads.attach()
                for m in range(GAS):
                    boundary = m == GAS - 1
                    mode.on_backward_start(boundary)
                    (model(torch.randn(4, width, generator=g)).square().mean() / GAS).backward()
                    grads.count(True, 1.0)
                    mode.on_micro_batch_end(boundary)
                if asynchronous:
                    mode.step()
                else:
                    count = Count()
                    count.ops = 0
                    with count:
                        mode.step()
                    step_ops.append(count.ops)
            mode.settle()
            if worker is not None:
                worker.close()
            out[name] = list(per_round) if asynchronous else step_ops
            topo.close(control=True)
    finally:
        worker_mod.CommWorker._execute = real_execute
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ops():
    return {width: run_ranks(_ops_per_round, 2, width)[0] for width in (512, 2900)}


@pytest.mark.parametrize("mode", MODES)
def test_ops_per_round_are_few_and_independent_of_the_model(ops, mode):
    small, large = ops[512][mode], ops[2900][mode]
    assert small and max(small) <= MAX_OPS, small
    # 32 times the parameters, the same launches
    assert max(large) == max(small), (small, large)
