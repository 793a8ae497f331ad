"""The comm worker's CUDA protocol, with recording fakes of CUDA's streams and events (the CPU
cannot run them; what is recorded is the order of the calls, never a result).

What a round on CUDA must do so that the GPU overlaps it and the host never waits for the GPU:
the submitting thread records a ready event on the training stream before the round is queued;
the worker thread sets its device, makes its side stream wait on that event and runs the round
with the side stream current; a done event is recorded on the side stream after the round, and
nobody synchronizes on it: ``wait`` makes the training stream wait on it, and ``poll`` asks it.
"""
import pytest
import threading

import torch

from ds_lowcomm.comm.collectives import CommStats
from ds_lowcomm.comm.round import Round
from ds_lowcomm.comm.worker import CommWorker

pytestmark = pytest.mark.unit

LOG = []
_local = threading.local()


def _log(*what):
    LOG.append((threading.current_thread().name, *what))


class FakeStream:
    def __init__(self, device=None, name="side"):
        self.name = name

    def wait_event(self, event):
        _log("wait_event", self.name, event.name)

    def synchronize(self):
        _log("synchronize", self.name)


TRAINING = FakeStream(name="training")


def current_stream(device=None):
    return getattr(_local, "stream", TRAINING)


class stream_context:
    def __init__(self, s):
        self.s = s

    def __enter__(self):
        self.prev, _local.stream = current_stream(), self.s

    def __exit__(self, *exc):
        _local.stream = self.prev


class FakeEvent:
    count = 0

    def __init__(self, *a, **k):
        FakeEvent.count += 1
        self.name, self.finished = f"event{FakeEvent.count}", False

    def record(self, stream=None):
        _log("record", self.name, (stream or current_stream()).name)

    def query(self):
        return self.finished

    def synchronize(self):
        _log("synchronize", self.name)


class Recorded(Round):
    def pack(self):
        pass

    def run(self):
        _log("run", current_stream().name)

    def install(self):
        pass


def test_cuda_round_protocol(monkeypatch):
    LOG.clear()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: _log("set_device", str(d)))
    worker = CommWorker(CommStats(), torch.device("cuda", 0))
    ticket = worker.submit(Recorded())
    ready, done = ticket.ready_event.name, ticket.done_event.name
    # recorded on the submitting thread, on the training stream, before submit returned
    assert [e for e in LOG if e[0] == "MainThread"] == [("MainThread", "record", ready, "training")]
    ticket.result(timeout=10)  # the round has been enqueued
    assert not worker.poll(ticket)  # ... but the GPU has not finished it
    ticket.done_event.finished = True
    assert worker.poll(ticket)
    worker.wait(ticket)
    assert LOG[-2] == ("MainThread", "wait_event", "training", done)  # between two timing events
    assert not [e for e in LOG if e[1] == "synchronize"], LOG  # the host never waited for the GPU
    comm = [entry[1:] for entry in LOG if entry[0] == "ds_lowcomm-comm"]
    assert comm == [("set_device", "cuda:0"), ("wait_event", "side", ready), ("run", "side"),
                    ("record", done, "side")], LOG
    worker.close()  # ... except at the end: nothing the side stream writes is freed under it
    assert LOG[-1] == ("MainThread", "synchronize", "side")


def test_cuda_wait_is_timed_on_the_device(monkeypatch):
    """``wait`` brackets the training stream's wait with two timing events; their elapsed time
    (the stream held by the round) counts as exposed communication once both have completed,
    read without waiting for them."""
    LOG.clear()
    elapsed_ms = {}

    events = {}

    class TimedEvent(FakeEvent):
        def __init__(self, enable_timing=False, **k):
            super().__init__()
            self.timing = enable_timing
            events[self.name] = self

        def elapsed_time(self, end):
            assert self.timing and end.timing and self.finished and end.finished
            return elapsed_ms[(self.name, end.name)]

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", TimedEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    stats = CommStats()
    worker = CommWorker(stats, torch.device("cuda", 0))
    waits = []
    for ms in (250.0, 40.0):
        ticket = worker.submit(Recorded())
        ticket.result(timeout=10)
        n = len(LOG)
        worker.wait(ticket)
        before, after = LOG[n][2], LOG[n + 2][2]
        assert LOG[n:n + 3] == [("MainThread", "record", before, "training"),
                                ("MainThread", "wait_event", "training", ticket.done_event.name),
                                ("MainThread", "record", after, "training")]
        elapsed_ms[(before, after)] = ms
        waits.append((before, after))
    assert stats.device_wait_seconds == 0.0  # not completed: nothing read, nothing waited for
    events[waits[0][0]].finished = events[waits[0][1]].finished = True
    worker.count_device_waits()
    assert stats.device_wait_seconds == 0.25
    events[waits[1][0]].finished = events[waits[1][1]].finished = True
    worker.count_device_waits()
    assert stats.device_wait_seconds == 0.25 + 0.04
    assert stats.exposed_comm_seconds == stats.host_wait_seconds + 0.29
    assert not [e for e in LOG if e[1] == "synchronize"], LOG
    worker.close()


def test_cuda_inline_rounds_are_issued_on_the_submitting_thread(monkeypatch):
    """With NCCL (collectives that return once enqueued) rounds are issued inline: ``submit`` runs
    the round at once on the thread that submits it, onto the side stream, after the side stream
    waited for the ready event; no thread of the worker's own, so every collective of the rank
    comes from one thread in program order. The ticket is resolved on return (the round is
    enqueued), not finished (``poll`` asks the done event); the host never waits for the GPU."""
    LOG.clear()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    threads = threading.active_count()
    worker = CommWorker(CommStats(), torch.device("cuda", 0), inline=True)
    assert threading.active_count() == threads  # no thread started
    tickets = [worker.submit(Recorded()) for _ in range(2)]
    assert all(t.done() for t in tickets)
    assert {entry[0] for entry in LOG} == {"MainThread"}, LOG
    for i, t in enumerate(tickets):
        ready, done = t.ready_event.name, t.done_event.name
        assert LOG[4 * i:4 * i + 4] == [("MainThread", "record", ready, "training"),
                                        ("MainThread", "wait_event", "side", ready),
                                        ("MainThread", "run", "side"),
                                        ("MainThread", "record", done, "side")], LOG
    assert current_stream().name == "training"  # the training stream is current again
    assert not worker.poll(tickets[0])
    tickets[0].done_event.finished = True
    assert worker.poll(tickets[0])
    worker.wait(tickets[1])
    assert ("MainThread", "wait_event", "training", tickets[1].done_event.name) in LOG
    assert not [e for e in LOG if e[1] == "synchronize"], LOG
    worker.close()
    assert LOG[-1] == ("MainThread", "synchronize", "side")


def test_inline_rounds_need_cuda():
    with pytest.raises(ValueError, match="inline rounds need CUDA"):
        CommWorker(CommStats(), torch.device("cpu"), inline=True)


def test_rounds_go_inline_only_where_no_group_blocks():
    """The rule the optimizer applies on CUDA: inline unless a shard or replica group's
    collectives block the calling thread (gloo, ``native`` False); a group of one blocks nothing."""
    from types import SimpleNamespace

    from ds_lowcomm.comm.topology import Topology

    def topo(shard, replica):
        return Topology(4, 0, 2, SimpleNamespace(native=shard), None if replica is None else
                        SimpleNamespace(native=replica), control=SimpleNamespace(native=False))

    assert not topo(True, True).blocking_collectives and not topo(True, None).blocking_collectives
    assert topo(False, None).blocking_collectives and topo(True, False).blocking_collectives
