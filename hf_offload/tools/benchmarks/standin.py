"""Stand-ins for an accelerator's streams and events, so that the engine's accelerator code path
(`AcceleratorStreams`) runs on CPU tensors.

Every other CPU run of the engine uses the simulated streams, whose code differs from what a
GPU runs. Within `stand_in_accelerator()`, `torch.Stream`, `torch.accelerator.current_stream`
and the pinned host allocation are replaced by stand-ins that log what the engine asks of them
and otherwise do nothing (CPU copies complete at once), and devices of type "cpu" get
`AcceleratorStreams`. The CPU-overhead benchmark (`layer_overhead`) times the engine this way,
and the tests read the log to check the calls and their order.

Log entries are tuples: ("record", stream, event id), ("wait", stream, event's stream, event id),
("enter", stream), ("exit", stream), ("query", stream), ("synchronize", stream),
("pinned_alloc", nbytes), and whatever the tests add themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hf_offload.engine import streams as streams_module


class StandInEvent:
    __slots__ = ("stream", "id")

    def __init__(self, stream: StandInStream, event_id: int) -> None:
        self.stream, self.id = stream, event_id

    def query(self) -> bool:
        self.stream.accelerator.log.append(("query", self.stream.name))
        return True

    def synchronize(self) -> None:
        self.stream.accelerator.log.append(("synchronize", self.stream.name))


class StandInStream:
    def __init__(self, accelerator: StandInAccelerator, name: str) -> None:
        self.accelerator, self.name = accelerator, name
        self.entered_from: list[StandInStream] = []

    def record_event(self) -> StandInEvent:
        accelerator = self.accelerator
        accelerator.events += 1
        accelerator.log.append(("record", self.name, accelerator.events))
        return StandInEvent(self, accelerator.events)

    def wait_event(self, event: StandInEvent) -> None:
        self.accelerator.log.append(("wait", self.name, event.stream.name, event.id))

    def synchronize(self) -> None:
        self.accelerator.log.append(("synchronize", self.name))

    def query(self) -> bool:
        self.accelerator.log.append(("query", self.name))
        return True

    def __enter__(self) -> StandInStream:
        self.entered_from.append(self.accelerator.current)
        self.accelerator.current = self
        self.accelerator.log.append(("enter", self.name))
        return self

    def __exit__(self, *exc_info) -> None:
        self.accelerator.current = self.entered_from.pop()
        self.accelerator.log.append(("exit", self.name))


class StandInAccelerator:
    """What torch.Stream, torch.accelerator.current_stream and pinned allocation answer."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events = 0
        self.compute = StandInStream(self, "compute")
        self.current = self.compute
        self.pinned_storages: set[int] = set()  # data_ptrs of the "pinned" host buffers handed out

    def current_stream(self, device=None) -> StandInStream:
        return self.current

    def new_stream(self, device=None) -> StandInStream:
        if not isinstance(device, torch.device):
            raise TypeError(f"torch.Stream(device=...) expects a torch.device, got {device!r}")
        return StandInStream(self, "copy")

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self.log.append(("pinned_alloc", nbytes))
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_storages.add(buffer.untyped_storage().data_ptr())
        return buffer


@contextlib.contextmanager
def stand_in_accelerator() -> Iterator[StandInAccelerator]:
    """Run the engine's accelerator code path on CPU tensors within this block (engines created
    inside it, with `simulate_on_cpu=True`, get `AcceleratorStreams` for the CPU device)."""
    accelerator = StandInAccelerator()
    patches = [
        (torch, "Stream", accelerator.new_stream),
        (torch.accelerator, "current_stream", accelerator.current_stream),
        (streams_module, "pinned_empty", accelerator.pinned_empty),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        with streams_module.device_streams(streams_module.AcceleratorStreams):
            yield accelerator
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
