"""The accelerator code path (`AcceleratorStreams`) executed on the CPU.

Every other CPU test swaps `AcceleratorStreams` for the simulated streams, so without this file
the code a GPU runs (torch.Stream / torch.Event / torch.accelerator calls, pinned memory, the
copies) would run for the first time on a GPU. Here `hf_offload.tools.benchmarks.standin` replaces
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

from hf_offload.engine import ordering
from hf_offload.engine import streams as streams_module
from hf_offload.engine.offloader import ActivationOffloader
from hf_offload.engine.pool import HostPool
from hf_offload.tools.benchmarks.standin import StandInAccelerator, stand_in_accelerator


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
        original_copy = torch.Tensor.copy_

        def logged_copy(dst, src, non_blocking=False):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("hf_offload.engine"):
                pinned = {dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr()} & fake.pinned_storages
                fake.log.append(("copy", fake.current.name, non_blocking, bool(pinned), _ranges([dst]), _ranges([src])))
            return original_copy(dst, src, non_blocking=non_blocking)

        monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
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


def views_made_after_the_event(accelerator: StandInAccelerator):
    """`AcceleratorStreams.copy_async` as it was before the fix, in effect: a byte view of each
    copy's source made on the compute stream after the event the copy stream waits on."""
    copy_async = streams_module.AcceleratorStreams.copy_async

    def views_again(self, pairs):
        for _, source in pairs:
            if source.untyped_storage().data_ptr() not in accelerator.pinned_storages:  # a copy out
                streams_module.flat_bytes(source.untyped_storage())  # on the compute stream
        return copy_async(self, pairs)

    return views_again


def test_the_sanitizer_check_catches_a_view_made_after_the_event(accelerator, monkeypatch):
    """Companion: the order the H200's sanitizer run failed on, a byte view of each source made
    on the compute stream after the event the copy stream waits on (as `flat_bytes` was)."""
    monkeypatch.setattr(streams_module.AcceleratorStreams, "copy_async", views_made_after_the_event(accelerator))
    model = tiny_model("llama")
    enable_sim(model)
    with OperationLog(accelerator):
        train_step(model, batch())
    assert "aten.set_.source_Storage" in unordered_compute_accesses(accelerator)


class SanitizerReplay(TorchDispatchMode):
    """PyTorch's CUDA stream sanitizer (`torch.cuda._sanitizer`, what TORCH_CUDA_SANITIZER=1
    runs), replayed on the stand-in accelerator: every aten operation goes to its own
    EventHandler with the stand-in stream it ran on and the memory it read and wrote (parsed by
    its own ArgumentHandler rules), and so does every event record and wait. CPU tensors play
    device memory, except the pooled pinned buffers, which are host memory, as on a GPU.
    `errors` are the races it would report. (Private module: a test aid, not the package's.)"""

    def __init__(self, accelerator: StandInAccelerator) -> None:
        from torch.cuda import _sanitizer

        super().__init__()
        self.accelerator, self.sanitizer = accelerator, _sanitizer
        self.handler = _sanitizer.EventHandler()
        self.errors: list = []
        replay = self

        class DeviceArguments(_sanitizer.ArgumentHandler):
            def _handle_argument(self, value, is_write, metadata_only, name=None, is_output=False):
                if replay.on_device(value):
                    pointer = value.data_ptr() or id(value)
                    if is_write:
                        self.dataptrs_written.add(pointer)
                    elif not metadata_only:
                        self.dataptrs_read.add(pointer)
                    self.tensor_aliases.setdefault(pointer, [])
                    if name is not None:
                        self.tensor_aliases[pointer].append(name)
                    if is_output:
                        self.outputs.add(pointer)

        self.arguments = DeviceArguments

    def on_device(self, value) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.layout is torch.strided
            and value.untyped_storage().data_ptr() not in self.accelerator.pinned_storages
        )

    def stream(self) -> int:
        return 0 if self.accelerator.current.name == "compute" else 1

    def record(self, event_id: int, stream_name: str) -> None:
        self.handler._handle_event_record(event_id, 0 if stream_name == "compute" else 1)

    def wait(self, event_id: int, stream_name: str) -> None:
        self.handler._handle_event_wait(event_id, 0 if stream_name == "compute" else 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        is_factory = bool(self.sanitizer.FACTORY_FUNCTION_REGEX.match(func._schema.name))
        arguments = self.arguments()
        arguments.parse_inputs(func._schema, args, kwargs, is_factory=is_factory)
        inputs = {t.data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outputs = func(*args, **kwargs)
        for tensor in torch.utils._pytree.tree_leaves(outputs):
            # Fresh memory: what the CUDA allocator's trace would announce to the sanitizer.
            if self.on_device(tensor) and tensor.data_ptr() and tensor.data_ptr() not in inputs:
                self.handler._handle_memory_allocation(tensor.data_ptr())
        arguments.parse_outputs(func._schema, outputs, is_factory=is_factory)
        self.errors += self.handler._handle_kernel_launch(
            self.stream(),
            arguments.dataptrs_read - arguments.dataptrs_written,
            arguments.dataptrs_written,
            arguments.outputs,
            func._schema,
            arguments.tensor_aliases,
        )
        return outputs


@pytest.fixture
def sanitizer(accelerator, monkeypatch):
    replay = SanitizerReplay(accelerator)
    from hf_offload.tools.benchmarks.standin import StandInStream

    record_event, wait_event = StandInStream.record_event, StandInStream.wait_event

    def replayed_record(stream):
        event = record_event(stream)
        replay.record(event.id, stream.name)
        return event

    def replayed_wait(stream, event):
        wait_event(stream, event)
        replay.wait(event.id, stream.name)

    monkeypatch.setattr(StandInStream, "record_event", replayed_record)
    monkeypatch.setattr(StandInStream, "wait_event", replayed_wait)
    return replay


def sanitized_step(sanitizer, checkpointing: bool = False, **options) -> list:
    """One training step after a first one (the pool's buffers exist), under the sanitizer."""
    model = tiny_model("llama", num_hidden_layers=4)
    enable_sim(model, **options)
    if checkpointing:
        model.activation_checkpointing_enable()
    train_step(model, batch())
    with sanitizer:
        train_step(model, batch(seed=2))
    assert model.activation_offloading_stats().offloaded_tensors > 0
    return sanitizer.errors


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_cuda_stream_sanitizer_finds_no_race(sanitizer, checkpointing):
    assert sanitized_step(sanitizer, checkpointing) == []


def test_the_sanitizer_replay_catches_views_made_on_the_copy_stream(sanitizer, monkeypatch):
    """Companion: copies that make their byte views on the copy stream (as
    `UntypedStorage.copy_` does inside: a set_, a write for the sanitizer) race with the next
    layer's reads of a storage both layers save (the rotary cos/sin)."""

    def views_on_the_copy_stream(self, pairs):
        with self.copy_stream:
            for dst, src in pairs:
                if src.untyped_storage().data_ptr() not in sanitizer.accelerator.pinned_storages:  # a copy out
                    src = streams_module.flat_bytes(src.untyped_storage())
                    dst = streams_module.flat_bytes(dst.untyped_storage())[: src.numel()]  # host memory
                dst.copy_(src, non_blocking=True)

    monkeypatch.setattr(streams_module.AcceleratorStreams, "copy_async", views_on_the_copy_stream)
    errors = sanitized_step(sanitizer)
    assert any(str(error.previous_access.operator.name) == "aten::set_" for error in errors), errors


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


def test_the_sanitizer_replay_catches_a_view_made_after_the_event(sanitizer, monkeypatch):
    """Companion: the order the H200's sanitizer run failed on (a byte view of each source made
    on the compute stream after the event), seen by the replayed sanitizer too."""
    views_again = views_made_after_the_event(sanitizer.accelerator)
    monkeypatch.setattr(streams_module.AcceleratorStreams, "copy_async", views_again)
    errors = sanitized_step(sanitizer)
    assert any(str(error.current_access.operator.name) == "aten::copy_" for error in errors), errors
