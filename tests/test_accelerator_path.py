"""The accelerator code path (`AcceleratorStreams`) executed on the CPU.

Every other CPU test swaps `AcceleratorStreams` for the simulated streams, so without this file
the code a GPU runs (torch.Stream / torch.Event / torch.accelerator calls, the pinned-memory
fallback) would run for the first time on a GPU. Here torch.Stream and
torch.accelerator.current_stream are replaced by stand-ins that log what the engine asks of
them; CPU copies complete at once, so this checks the calls and their order, not overlap
(the race checker in tests/test_races.py does that).
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import assert_same_step, batch, enable_sim, tiny_model, train_step, twin

import hf_offload.engine.offloader as offloader_module
from hf_offload.engine import ordering
from hf_offload.engine import streams as streams_module


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return True


class FakeAccelerator:
    """What torch.Stream and torch.accelerator.current_stream answer, with a log of the calls."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.compute = FakeStream(self, "compute")
        self.current = self.compute

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    def new_stream(self, device=None) -> FakeStream:
        assert isinstance(device, torch.device), device
        return FakeStream(self, "copy")


class FakeStream:
    def __init__(self, accelerator: FakeAccelerator, name: str) -> None:
        self.accelerator, self.name = accelerator, name
        self.entered_from: list[FakeStream] = []

    def record_event(self) -> FakeEvent:
        self.accelerator.log.append(("record", self.name))
        return FakeEvent(self)

    def wait_event(self, event: FakeEvent) -> None:
        self.accelerator.log.append(("wait", self.name, event.stream.name))

    def __enter__(self) -> FakeStream:
        self.entered_from.append(self.accelerator.current)
        self.accelerator.current = self
        self.accelerator.log.append(("enter", self.name))
        return self

    def __exit__(self, *exc_info) -> None:
        self.accelerator.current = self.entered_from.pop()
        self.accelerator.log.append(("exit", self.name))


@pytest.fixture
def accelerator(monkeypatch) -> FakeAccelerator:
    fake = FakeAccelerator()
    monkeypatch.setattr(torch, "Stream", fake.new_stream)
    monkeypatch.setattr(torch.accelerator, "current_stream", fake.current_stream)
    # CPU tensors through the accelerator path instead of the simulated streams.
    monkeypatch.setattr(offloader_module, "streams_for", streams_module.AcceleratorStreams)
    copies = []
    original_copy = torch.UntypedStorage.copy_

    def logged_copy(dst, src, non_blocking=False):
        if fake.current.name == "copy":
            copies.append(non_blocking)
            fake.log.append(("copy", fake.current.name))
        return original_copy(dst, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.UntypedStorage, "copy_", logged_copy)
    fake.copies = copies
    return fake


def assert_designed_orderings(accelerator: FakeAccelerator) -> None:
    log = accelerator.log
    # Every byte copy ran inside the copy stream's context, without blocking the host.
    assert accelerator.copies and all(accelerator.copies)
    assert log.count(("copy", "copy")) == len(accelerator.copies)
    # Each batch of copies is preceded by the copy stream waiting on a compute event, and each
    # batch's completion is waited on by the compute stream (before sources are released or
    # restored tensors used).
    batches = [i for i, entry in enumerate(log) if entry == ("enter", "copy")]
    assert batches
    for start in batches:
        assert log[start - 2 : start] == [("record", "compute"), ("wait", "copy", "compute")], log[start - 3 : start]
    assert log.count(("wait", "compute", "copy")) >= len(batches)
    # Never a device- or stream-wide synchronize: only events.
    assert {entry[0] for entry in log} == {"record", "wait", "enter", "exit", "copy"}


@pytest.mark.parametrize("removed", ["before_offload_copies", "before_restore_copies"])
def test_the_ordering_check_catches_a_missing_wait(accelerator, monkeypatch, removed):
    """Companion: with one of the copy stream's waits removed, the check above fails."""
    monkeypatch.setattr(ordering, removed, lambda streams, compute: None)
    model = tiny_model("llama")
    enable_sim(model)
    train_step(model, batch())
    with pytest.raises(AssertionError):
        assert_designed_orderings(accelerator)


def test_accelerator_path_is_exact_and_issues_the_designed_orderings(accelerator, caplog):
    plain = tiny_model("llama")
    offloaded = twin(plain)
    enable_sim(offloaded)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for seed in range(2):
            assert_same_step(plain, offloaded, batch(seed=seed))
    stats = offloaded.activation_offloading_stats()
    assert stats.offloaded_tensors > 0 and stats.restored_tensors >= stats.offloaded_tensors
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0

    assert_designed_orderings(accelerator)
    # The CPU cannot pin memory: the pool fell back to pageable buffers and said so once.
    pageable = [r for r in caplog.records if "pinned host memory unavailable" in r.getMessage()]
    assert len(pageable) == 1


def test_trimming_the_pool_survives_a_backend_without_host_cache(accelerator, monkeypatch):
    """The pool gives its free buffers back (and asks torch to release its cache of them) when it
    would grow past max_host_bytes mid-training; torch raises there without an accelerator."""
    calls = []

    def no_host_cache():
        calls.append(1)
        raise RuntimeError("Cannot access accelerator device when none is available.")

    monkeypatch.setattr(torch.accelerator, "empty_host_cache", no_host_cache, raising=False)
    streams = streams_module.AcceleratorStreams(torch.device("cpu"))
    streams.empty_host_cache()  # logged at debug level, never raised
    assert calls == [1]
