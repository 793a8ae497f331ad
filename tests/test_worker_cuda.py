"""The comm worker's CUDA protocol, with recording fakes of CUDA's streams and events (the CPU
cannot run them; what is recorded is the order of the calls, never a result).

What a round on CUDA must do so that the GPU overlaps it and the host never waits for the GPU:
the submitting thread records a ready event on the training stream before the round is queued;
the worker thread sets its device, makes its side stream wait on that event and runs the round
with the side stream current; a done event is recorded on the side stream after the round, and
nobody synchronizes on it: ``wait`` makes the training stream wait on it, and ``poll`` asks it.
"""
import threading

import torch

from ds_lowcomm.comm import CommStats
from ds_lowcomm.round import Round
from ds_lowcomm.worker import CommWorker

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
    worker = CommWorker(CommStats(), torch.device("cuda", 0), asynchronous=True)
    ticket = worker.submit(Recorded())
    ready, done = ticket.ready_event.name, ticket.done_event.name
    # recorded on the submitting thread, on the training stream, before submit returned
    assert [e for e in LOG if e[0] == "MainThread"] == [("MainThread", "record", ready, "training")]
    ticket.result(timeout=10)  # the round has been enqueued
    assert not worker.poll(ticket)  # ... but the GPU has not finished it
    ticket.done_event.finished = True
    assert worker.poll(ticket)
    worker.wait(ticket)
    assert LOG[-1] == ("MainThread", "wait_event", "training", done)
    assert not [e for e in LOG if e[1] == "synchronize"], LOG  # the host never waited for the GPU
    comm = [entry[1:] for entry in LOG if entry[0] == "ds_lowcomm-comm"]
    assert comm == [("set_device", "cuda:0"), ("wait_event", "side", ready), ("run", "side"),
                    ("record", done, "side")], LOG
    worker.close()  # ... except at the end: nothing the side stream writes is freed under it
    assert LOG[-1] == ("MainThread", "synchronize", "side")
