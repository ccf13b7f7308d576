"""The accelerator code path (`AcceleratorStreams`) executed on the CPU.

Every other CPU test swaps `AcceleratorStreams` for the simulated streams, so without this file
the code a GPU runs (torch.Stream / torch.Event / torch.accelerator calls, pinned memory, the
copies) would run for the first time on a GPU. Here `hf_offload.benchmarks.standin` replaces
torch.Stream, torch.accelerator.current_stream and the pinned allocation with stand-ins that log
what the engine asks of them; CPU copies complete at once, so this checks the calls and their
order, not overlap (the race checker in tests/test_races.py does that). Three properties:

- the designed orderings: each batch of copies waits on a compute event, and compute waits on
  each batch before sources are released or restored tensors used;
- what the CUDA stream sanitizer checks: between recording the event the copy stream waits on
  and the copy itself, no operation on the compute stream touches the copy's source or
  destination (it failed on the H200 when a byte view of the source was made there);
- no synchronisation in a step after the first: no pinned allocation, stream or event
  synchronize/query, host-cache release or pageable copy, and no more `.item()` calls than the
  same step without offloading makes.

Each check has a companion that reintroduces the fault and shows the check fails.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import pytest
import torch
from conftest import assert_same_step, batch, enable_sim, tiny_model, train_step, twin
from torch.utils._python_dispatch import TorchDispatchMode

from hf_offload.benchmarks.standin import StandInAccelerator, stand_in_accelerator
from hf_offload.engine import ordering
from hf_offload.engine import streams as streams_module
from hf_offload.engine.offloader import ActivationOffloader
from hf_offload.engine.pool import HostPool


def _ranges(values) -> list[tuple[int, int]]:
    ranges = []
    for value in values:
        if isinstance(value, torch.Tensor) and value.layout is torch.strided and value.device.type != "meta":
            storage = value.untyped_storage()
        elif isinstance(value, torch.UntypedStorage):
            storage = value
        elif isinstance(value, torch.TypedStorage):
            storage = value.untyped_storage()
        else:
            continue
        if storage.nbytes():
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return ranges


class OperationLog(TorchDispatchMode):
    """Every aten operation, with the stand-in stream it ran on and the memory it touched."""

    def __init__(self, accelerator: StandInAccelerator) -> None:
        super().__init__()
        self.accelerator = accelerator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        flat = [*args, *kwargs.values(), *(result if isinstance(result, (tuple, list)) else (result,))]
        self.accelerator.log.append(("op", self.accelerator.current.name, str(func), _ranges(flat)))
        return result


@pytest.fixture
def accelerator(monkeypatch) -> Iterator[StandInAccelerator]:
    """The stand-in accelerator, with every storage copy the engine makes logged: which stream,
    whether non-blocking, whether its host side was pinned, what it wrote and read. (Copies made
    by other code, such as copy.deepcopy of a model, are not the engine's.)"""
    with stand_in_accelerator() as fake:
        original_copy = torch.UntypedStorage.copy_

        def logged_copy(dst, src, non_blocking=False):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("hf_offload."):
                pinned = dst.data_ptr() in fake.pinned_storages or src.data_ptr() in fake.pinned_storages
                fake.log.append(("copy", fake.current.name, non_blocking, pinned, _ranges([dst]), _ranges([src])))
            return original_copy(dst, src, non_blocking=non_blocking)

        monkeypatch.setattr(torch.UntypedStorage, "copy_", logged_copy)
        yield fake


def copies(log) -> list[tuple]:
    return [entry for entry in log if entry[0] == "copy"]


def assert_designed_orderings(accelerator: StandInAccelerator) -> None:
    log = [entry for entry in accelerator.log if entry[0] != "op"]
    done = copies(log)
    # Every byte copy ran inside the copy stream's context, without blocking the host.
    assert done and all(stream == "copy" and non_blocking for _, stream, non_blocking, *_ in done)
    # Each batch of copies is preceded by the copy stream waiting on a compute event recorded
    # just before, and each batch's completion is waited on by the compute stream (before
    # sources are released or restored tensors used).
    batches = [i for i, entry in enumerate(log) if entry == ("enter", "copy")]
    assert batches
    for start in batches:
        record, wait = log[start - 2 : start]
        assert record[:2] == ("record", "compute") and wait[:3] == ("wait", "copy", "compute"), log[start - 3 : start]
        assert wait[3] == record[2]
    assert sum(1 for entry in log if entry[:3] == ("wait", "compute", "copy")) >= len(batches)
    # Never a device- or stream-wide synchronize: only events (and the pool's first buffers).
    assert {entry[0] for entry in log} == {"record", "wait", "enter", "exit", "copy", "pinned_alloc"}


def _overlaps(ranges, others) -> bool:
    return any(start < other_end and other_start < end for start, end in ranges for other_start, other_end in others)


def unordered_compute_accesses(accelerator: StandInAccelerator) -> list[str]:
    """Operations on the compute stream that touch a copy's source or destination after the
    compute event its copy stream waited on was recorded, and before the copy: what the CUDA
    stream sanitizer reports as a race."""
    log = accelerator.log
    recorded = {entry[2]: index for index, entry in enumerate(log) if entry[:2] == ("record", "compute")}
    found = []
    waited_for = None
    for index, entry in enumerate(log):
        if entry[:3] == ("wait", "copy", "compute"):
            waited_for = entry[3]
        elif entry[0] == "copy":
            assert waited_for is not None, "a copy without any wait on the compute stream before it"
            touched = entry[4] + entry[5]
            for _, stream, name, ranges in (e for e in log[recorded[waited_for] : index] if e[0] == "op"):
                if stream == "compute" and _overlaps(ranges, touched):
                    found.append(name)
    return found


def twin_models(checkpointing: bool = False):
    """A tiny Llama and its twin with offloading enabled (both checkpointed, if asked)."""
    plain = tiny_model("llama")
    offloaded = twin(plain)
    enable_sim(offloaded)
    if checkpointing:
        for model in (plain, offloaded):
            model.activation_checkpointing_enable()
    return plain, offloaded


def test_accelerator_path_is_exact_and_issues_the_designed_orderings(accelerator):
    plain, offloaded = twin_models()
    for seed in range(2):
        assert_same_step(plain, offloaded, batch(seed=seed))
    stats = offloaded.activation_offloading_stats()
    assert stats.offloaded_tensors > 0 and stats.restored_tensors >= stats.offloaded_tensors
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0
    assert_designed_orderings(accelerator)


@pytest.mark.parametrize("removed", ["before_offload_copies", "before_restore_copies"])
def test_the_ordering_check_catches_a_missing_wait(accelerator, monkeypatch, removed):
    """Companion: with one of the copy stream's waits removed, the check above fails."""
    monkeypatch.setattr(ordering, removed, lambda streams, compute: None)
    model = tiny_model("llama")
    enable_sim(model)
    train_step(model, batch())
    with pytest.raises(AssertionError):
        assert_designed_orderings(accelerator)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_nothing_touches_a_copy_on_the_compute_stream_after_its_event(accelerator, checkpointing):
    plain, offloaded = twin_models(checkpointing)
    with OperationLog(accelerator):
        assert_same_step(plain, offloaded, batch())
    assert copies(accelerator.log)
    assert any(entry[0] == "op" and entry[1] == "copy" for entry in accelerator.log)  # the copies' own views
    assert unordered_compute_accesses(accelerator) == []


def test_the_sanitizer_check_catches_a_view_made_after_the_event(accelerator, monkeypatch):
    """Companion: the order the H200's sanitizer run failed on, a byte view of each source made
    on the compute stream after the event the copy stream waits on (as `flat_bytes` was)."""
    copy_async = streams_module.AcceleratorStreams.copy_async

    def views_first(self, pairs, to_host):
        if to_host:
            for _, source in pairs:
                streams_module.flat_bytes(source)  # on the compute stream: not yet inside the copy stream
        return copy_async(self, pairs, to_host)

    monkeypatch.setattr(streams_module.AcceleratorStreams, "copy_async", views_first)
    model = tiny_model("llama")
    enable_sim(model)
    with OperationLog(accelerator):
        train_step(model, batch())
    assert "aten.set_.source_Storage" in unordered_compute_accesses(accelerator)


SYNCHRONISING = ("pinned_alloc", "synchronize", "query", "empty_host_cache", "item")


@pytest.fixture
def synchronisations(accelerator, monkeypatch):
    """Also log the synchronising calls the stand-ins do not see: device-wide synchronize,
    releasing the pinned cache, and `.item()` (a device-to-host read)."""
    log = accelerator.log
    for owner in (torch.accelerator, torch.cuda):
        monkeypatch.setattr(owner, "synchronize", lambda device=None: log.append(("synchronize", "device")))
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: log.append(("empty_host_cache",)))
    item = torch.Tensor.item

    def logged_item(tensor):
        log.append(("item",))
        return item(tensor)

    monkeypatch.setattr(torch.Tensor, "item", logged_item)
    return accelerator


def synchronising_calls(log) -> dict[str, int]:
    counts = dict.fromkeys([*SYNCHRONISING, "pageable_copy"], 0)
    for entry in log:
        if entry[0] in counts:
            counts[entry[0]] += 1
        elif entry[0] == "copy" and not (entry[2] and entry[3]):
            counts["pageable_copy"] += 1
    return counts


def steps_after_the_first(accelerator, plain, offloaded, steps=3) -> tuple[dict, dict]:
    """The synchronising calls of steps 2..`steps` of each model (the first fills the pool)."""
    train_step(plain, batch(seed=0))
    train_step(offloaded, batch(seed=0))
    calls = []
    for model in (plain, offloaded):
        start = len(accelerator.log)
        for seed in range(1, steps):
            train_step(model, batch(seed=seed))
        calls.append(synchronising_calls(accelerator.log[start:]))
    return calls[0], calls[1]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_no_synchronisation_in_a_step_after_the_first(synchronisations, checkpointing):
    plain, offloaded = twin_models(checkpointing)
    without, with_offloading = steps_after_the_first(synchronisations, plain, offloaded)
    assert offloaded.activation_offloading_stats().offloaded_tensors > 0
    assert with_offloading == without, "offloading added synchronising calls"
    assert with_offloading["pinned_alloc"] == with_offloading["pageable_copy"] == 0
    assert copies(synchronisations.log)  # the copies did run, all pinned and non-blocking


def test_the_synchronisation_check_catches_a_pool_that_allocates_every_step(synchronisations, monkeypatch):
    """Companion: a pool that forgets its buffers pins new host memory every step."""
    monkeypatch.setattr(HostPool, "release", lambda self, buffer: None)
    plain, offloaded = twin_models()
    _, with_offloading = steps_after_the_first(synchronisations, plain, offloaded)
    assert with_offloading["pinned_alloc"] > 0


def test_the_synchronisation_check_catches_pageable_copies_and_item(synchronisations, monkeypatch):
    """Companion: without pinned memory every copy is pageable (it blocks the host), and a
    stray `.item()` in the engine is counted against the same step without offloading."""

    def cannot_pin(nbytes):
        raise RuntimeError("no pinned memory")

    monkeypatch.setattr(streams_module, "pinned_empty", cannot_pin)

    exit_layer = ActivationOffloader.exit_layer

    def exit_with_item(self, group, name):
        torch.zeros(1).item()
        return exit_layer(self, group, name)

    monkeypatch.setattr(ActivationOffloader, "exit_layer", exit_with_item)
    plain, offloaded = twin_models()
    without, with_offloading = steps_after_the_first(synchronisations, plain, offloaded)
    assert with_offloading["pageable_copy"] > 0
    assert with_offloading["item"] > without["item"]


def test_pinned_memory_unavailable_falls_back_to_pageable_once(monkeypatch, caplog):
    """What a machine without pinnable memory (the CPU itself) gets: pageable buffers, one warning."""
    with stand_in_accelerator():

        def cannot_pin(nbytes):
            raise RuntimeError("pin_memory=True requires a CUDA or other accelerator backend")

        monkeypatch.setattr(streams_module, "pinned_empty", cannot_pin)
        plain, offloaded = twin_models()
        with caplog.at_level(logging.WARNING, logger="hf_offload"):
            for seed in range(2):
                assert_same_step(plain, offloaded, batch(seed=seed))
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
