"""A round's verdict that reaches the host late, as on a GPU, changes nothing but when it is
recorded.

On a GPU a round's verdict (its norm, skip and counts) is copied to pinned memory with an event,
and the host reads it only once the event has completed: the optimizer records it (loss scale,
skip count, the norm DeepSpeed reports) at a later micro-batch, never waiting for the device
inside a step. The CPU's copy is ready at once, so this test stands in a recording fake for the
CUDA event (the one thing the CPU cannot run): each round's copy reports "not landed" to its first
``LATE`` queries. Against the same run with copies that land at once, on real 2-rank DeepSpeed
engines with a non-finite gradient at step 2 on rank 0: the same losses and parameters bit for
bit, verdicts recorded later during training with no host wait for them, and after ``settle()``
the same skip count and norm.
"""
import pytest

import workers
from dist import run_ranks

pytestmark = pytest.mark.integration

STEPS, LATE = 5, 3
MODES = ("zero1-overlap", "acco")


class LateEvent:
    """A CUDA event's host side, for a copy that lands after ``LATE`` queries (or a wait)."""

    def __init__(self) -> None:
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > LATE

    def synchronize(self) -> None:
        self.queries = LATE + 1


def _run(rank, world, late):
    from ds_lowcomm.comm.round import StepRound

    if late:
        real_stage = StepRound.stage

        def stage(self, verdict):
            real_stage(self, verdict)
            self._staged_event = LateEvent()

        StepRound.stage = stage
    out = {}
    for mode in MODES:
        engine = workers.build_engine(workers.config(mode.split("-")[0], **workers.STEP_MODES[mode]))
        norms, skipped = [], []
        losses = []
        for step in range(STEPS):
            losses += workers.train(engine, 1, start=step, rank=rank,
                                    poison={(2, 0): float("nan")} if rank == 0 else None)
            norms.append(engine.get_global_grad_norm())
            skipped.append(engine.comm_stats()["skipped_steps"])
        waits_in_training = engine.comm_stats()["verdict_waits"]
        engine.optimizer.settle()
        stats = engine.comm_stats()
        out[mode] = dict(losses=losses, norms=norms, skipped=skipped, waits=waits_in_training,
                         final=(engine.get_global_grad_norm(), stats["skipped_steps"]),
                         digest=workers.params_digest(engine))
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs():
    return {late: run_ranks(_run, 2, late) for late in (False, True)}


@pytest.mark.parametrize("mode", MODES)
def test_late_verdicts_are_recorded_later_and_train_the_same(runs, mode):
    for rank in range(2):
        now, late = runs[False][rank][mode], runs[True][rank][mode]
        assert repr(late["losses"]) == repr(now["losses"]) and late["digest"] == now["digest"], rank  # (a NaN step)
        assert now["skipped"][-1] == 1  # the poisoned step was skipped
        # later: the skip reached the count at a later step than where the copy landed at once
        assert late["skipped"] != now["skipped"] and late["skipped"][-1] <= now["skipped"][-1], (late, now)
        assert late["waits"] == 0  # never a host wait for a verdict inside training
        assert late["final"] == now["final"], (late["final"], now["final"])
