"""The stream and event operations the engine issues, for a real accelerator and for the CPU.

The engine only ever does these things: ask for the compute stream, record an event on a
stream, make a stream wait for an event, enqueue copies on the copy stream (between 1-D uint8
byte views of equal size, or from a dense tensor into a host view of the same layout), and
allocate device and host buffers. Two implementations:

- `AcceleratorStreams`: CUDA first, and any device with `torch.Stream`/`torch.Event` support
  (XPU, NPU, ...) through the device-generic `torch.accelerator` API.
- `SimulatedStreams`: CPU tensors stand in for device tensors. With `schedule="eager"` every
  copy runs at once (what `simulate_on_cpu=True` uses). With `"lazy"` or `"random"` it is a race
  checker: copies queue up and run only when a wait forces them (or at random moments), and each
  copy is checked against the orderings the engine actually issued, so a missing wait or a
  source released too early corrupts the data and shows up as a wrong gradient.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import random
import weakref
from collections import deque
from collections.abc import Iterator

import torch

from . import forks

logger = logging.getLogger("hf_offload")

GARBAGE_BYTE = 0xFF  # all-ones bytes are NaN in every floating dtype


def flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage, for copying it as raw bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def pinned_empty(nbytes: int) -> torch.Tensor:
    """Page-locked host memory: what copies need to run asynchronously. Allocating it is slow and
    may synchronise the device, which is why the pool reuses buffers across steps."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def registered_host_empty(nbytes: int, cudart=None) -> torch.Tensor | None:
    """Page-locked host memory of exactly `nbytes` bytes, page-aligned: anonymous memory
    registered with CUDA (cudaHostRegister), unregistered when the last view of it is gone. None
    where CUDA's runtime cannot do it (then `pinned_empty` is the way).

    The mapping is shared (`mmap`'s default): after a fork the parent's pages stay where its DMA
    mappings point (a private mapping would be copied on the parent's next write); a forked child
    sees them but never writes them, nor unregisters them (the pool is inert there, `forks`).

    Why not `pinned_empty`: torch's caching host allocator rounds every pinned block up to a
    power of two (to reuse blocks across sizes), which would undo the pool's exact sizes: 150 GiB
    of layer inputs would take 256 GiB of pinned memory. CUDA copies from registered memory as
    from any pinned memory (asynchronously), and the pool orders its reuse and its release itself.
    """
    if cudart is None:
        try:
            cudart = torch.cuda.cudart()
        except (AssertionError, RuntimeError, AttributeError):
            return None
    if not hasattr(cudart, "cudaHostRegister"):
        return None
    memory = mmap.mmap(-1, nbytes)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    address = tensor.data_ptr()
    if int(cudart.cudaHostRegister(address, nbytes, 0)) != 0:
        return None
    # Before the memory is unmapped: the mapping lives as long as any view of the tensor.
    weakref.finalize(memory, _unregister, cudart, address, forks.this_process())
    return tensor


def _unregister(cudart, address: int, owner: int) -> None:
    # Only where it was registered: a forked child that drops its copy of the slab must neither
    # call into the parent's CUDA context nor undo the parent's registration.
    if forks.made_here(owner):
        cudart.cudaHostUnregister(address)


def empty_host_cache() -> None:
    """torch.accelerator.empty_host_cache, which torch 2.11 lacks; there the CUDA host
    allocator's own (private) call does the same. Best effort: it runs when the pool is trimmed
    mid-training, and a backend without a host cache must not end the run."""
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        return
    try:
        empty()
    except RuntimeError as error:
        logger.debug("hf_offload: could not release cached host memory: %s", str(error))


class AcceleratorStreams:
    """A dedicated copy stream beside the caller's compute stream on one accelerator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.Stream(device=device)
        self.pinned = True
        self.registered = True  # exact-size pinned memory (`registered_host_empty`) while it works

    def compute_stream(self):
        return torch.accelerator.current_stream(self.device)

    def record(self, stream):
        return stream.record_event()

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def copy_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Enqueue dst.copy_(src) for each pair on the copy stream. The pairs (byte views, or a
        dense tensor and a host view of the same layout) are made beforehand, on the compute
        stream and before the event the copy stream waited on: the copy stream only reads its
        sources and writes its destinations (a view made on it, a set_, would count as a write to
        the source for the CUDA stream sanitizer, racing with the next layer's reads of a storage
        it saves too)."""
        with self.copy_stream:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def shrink(self, storage: torch.UntypedStorage) -> None:
        """Free a storage's device memory in place: every tensor on it keeps the storage object."""
        storage.resize_(0)

    def regrow(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give a storage freed in place (`shrink`) device memory again, on the compute stream."""
        storage.resize_(nbytes)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        # Allocated on the compute stream, which owns the memory; the copy stream writes into it
        # only after waiting for the compute stream, and the compute stream reads it only after
        # waiting for the copy.
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def empty_host_cache(self) -> None:
        # torch caches freed pinned blocks itself; dropping our references alone frees nothing.
        empty_host_cache()

    def quiesce_host(self) -> None:
        """Wait for every copy queued on the copy stream: host memory the pool gives back to the
        system (registered memory) must not be unmapped under a copy still to run."""
        self.copy_stream.synchronize()

    def host_waiter(self, event):
        """What another thread calls to block until `event` has completed (the disk tier's writer,
        before it reads a buffer a copy out filled). It releases the GIL while it waits."""
        return event.synchronize

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        if self.pinned:
            if self.registered and self.device.type == "cuda":
                try:
                    buffer = registered_host_empty(nbytes)
                except (RuntimeError, OSError, ValueError) as error:
                    buffer = None
                    logger.debug("hf_offload: could not register host memory: %s", str(error))
                if buffer is not None:
                    return buffer
                self.registered = False  # once refused, torch's pinned allocator from then on
            try:
                return pinned_empty(nbytes)
            except RuntimeError as error:
                self.pinned = False
                # The message, not the exception: a handler that keeps log records (pytest's
                # caplog, a MemoryHandler) would keep its traceback's frames, and through them
                # the host copies being made, alive.
                logger.warning(
                    "hf_offload: pinned host memory unavailable (%s); using pageable memory, "
                    "so copies to the host block the CPU until they finish",
                    str(error),
                )
        return torch.empty(nbytes, dtype=torch.uint8)


class MetaStreams:
    """The streams of the meta device, whose tensors have shapes, dtypes and autograd but no data:
    the memory simulator (`hf-offload estimate`) runs whole training steps there. Every step of
    the engine runs as on an accelerator, but streams and events are markers and copies move
    nothing. Host buffers are meta tensors too; `host_buffer` is where the simulator tells them
    from device memory."""

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = "copy"

    def compute_stream(self) -> str:
        return "compute"

    def record(self, stream) -> None:
        return None

    def wait(self, stream, event) -> None:
        pass

    def copy_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def shrink(self, storage: torch.UntypedStorage) -> None:
        storage.resize_(0)

    def regrow(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        storage.resize_(nbytes)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    def quiesce_host(self) -> None:
        pass  # nothing is copied

    def host_waiter(self, event) -> None:
        return None

    def empty_host_cache(self) -> None:
        pass


class _SimStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.caught_up_to = 0  # the compute clock this stream has waited for

    def __repr__(self) -> str:
        return f"<simulated {self.name} stream>"


class _SimEvent:
    __slots__ = ("on_compute", "clock", "sequence")

    def __init__(self, on_compute: bool, clock: int, sequence: int) -> None:
        self.on_compute = on_compute
        self.clock = clock  # compute events: the compute clock when recorded
        self.sequence = sequence  # copy events: how many copies were queued before it


class _SimCopy:
    __slots__ = ("dst", "dst_offset", "src", "src_offset", "nbytes", "ordered")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, ordered: bool) -> None:
        # Weak: a copy must not keep its memory alive; the engine has to. (A host view's storage
        # is its pooled buffer's, which the pool keeps.)
        # The engine copies either byte views or a dense tensor into a view of the same layout:
        # both are one run of bytes, copied as such.
        self.dst = weakref.ref(dst.untyped_storage())
        self.src = weakref.ref(src.untyped_storage())
        self.dst_offset = dst.storage_offset() * dst.element_size()
        self.src_offset = src.storage_offset() * src.element_size()
        self.nbytes = dst.nbytes
        if src.nbytes != self.nbytes:
            raise ValueError(f"a copy of {src.nbytes} bytes into {self.nbytes}")
        self.ordered = ordered

    def run(self, violations: list[str]) -> None:
        dst, src = self.dst(), self.src()
        if dst is None:
            violations.append("a copy wrote into memory that had already been freed")
            return
        target = flat_bytes(dst)[self.dst_offset : self.dst_offset + self.nbytes]
        if self.ordered and src is not None:
            target.copy_(flat_bytes(src)[self.src_offset : self.src_offset + self.nbytes])
        else:
            target.fill_(GARBAGE_BYTE)


class SimulatedStreams:
    """CPU stand-in for a device with a compute stream and a copy stream (see module docstring).

    The compute stream is the CPU itself: it runs eagerly. The compute clock ticks whenever the
    engine asks for the compute stream or allocates a device buffer, i.e. whenever compute may
    have produced or released data since the engine last looked. A copy is *ordered* only if the
    copy stream has waited for a compute event recorded at the current clock; an unordered copy,
    a copy whose source was freed before it ran, writes garbage. A copy whose destination was
    freed before it ran is recorded in `violations`.
    """

    def __init__(self, schedule: str = "eager", seed: int = 0) -> None:
        if schedule not in ("eager", "lazy", "random"):
            raise ValueError(f"schedule must be 'eager', 'lazy' or 'random', got {schedule!r}")
        self.schedule = schedule
        self._random = random.Random(seed)
        self.compute = _SimStream("compute")
        self.copy_stream = _SimStream("copy")
        self.clock = 0
        self.queued: deque[_SimCopy] = deque()
        self.enqueued = 0
        self.executed = 0
        self.violations: list[str] = []
        self.pinned = False

    def compute_stream(self) -> _SimStream:
        self.clock += 1
        return self.compute

    def record(self, stream: _SimStream) -> _SimEvent:
        return _SimEvent(stream is self.compute, self.clock, self.enqueued)

    def wait(self, stream: _SimStream, event: _SimEvent) -> None:
        if stream is self.copy_stream and event.on_compute:
            stream.caught_up_to = max(stream.caught_up_to, event.clock)
        elif stream is self.compute and not event.on_compute:
            self._run_until(event.sequence)  # the eager compute stream cannot go on before it

    def copy_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        ordered = self.copy_stream.caught_up_to >= self.clock
        for dst, src in pairs:
            self.queued.append(_SimCopy(dst, src, ordered))
            self.enqueued += 1
        if self.schedule == "eager":
            self._run_until(self.enqueued)
        else:
            self._maybe_progress()

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        self.clock += 1
        return torch.full((nbytes,), GARBAGE_BYTE, dtype=torch.uint8)

    def shrink(self, storage: torch.UntypedStorage) -> None:
        storage.resize_(0)

    def regrow(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Like `device_buffer`: new device memory, garbage until a copy fills it."""
        self.clock += 1
        storage.resize_(nbytes)
        flat_bytes(storage).fill_(GARBAGE_BYTE)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), GARBAGE_BYTE, dtype=torch.uint8)

    def empty_host_cache(self) -> None:
        pass

    def synchronize(self) -> None:
        self._run_until(self.enqueued)

    def quiesce_host(self) -> None:
        self._run_until(self.enqueued)

    def host_waiter(self, event: _SimEvent) -> None:
        """The simulated copy stream is not thread-safe: the copies up to `event` run now, on the
        calling (training) thread, and the other thread has nothing to wait for."""
        self._run_until(event.sequence)
        return None

    def _maybe_progress(self) -> None:
        if self.schedule == "random" and self.queued and self._random.random() < 0.3:
            self._run_until(self.executed + self._random.randint(1, len(self.queued)))

    def _run_until(self, sequence: int) -> None:
        while self.executed < sequence:
            op = self.queued.popleft()
            self.executed += 1
            op.run(self.violations)


_simulation_schedule = {"schedule": "eager", "seed": 0}


@contextlib.contextmanager
def simulated_schedule(schedule: str, seed: int = 0) -> Iterator[None]:
    """Within this block, engines that start simulating (`simulate_on_cpu=True`) use the race
    checker with this schedule ("lazy" or "random") instead of running copies eagerly."""
    SimulatedStreams(schedule)  # validates
    previous = dict(_simulation_schedule)
    _simulation_schedule.update(schedule=schedule, seed=seed)
    try:
        yield
    finally:
        _simulation_schedule.update(previous)


# Set by `device_streams`: what gives a new device its streams instead of the default.
_streams_factory: list = []


@contextlib.contextmanager
def device_streams(factory) -> Iterator[None]:
    """Within this block, devices an engine meets for the first time get their streams from
    `factory(device)` instead of the default (`AcceleratorStreams` on an accelerator,
    `SimulatedStreams` on the CPU). The stand-in accelerator runs the accelerator code path on
    CPU tensors this way, and the memory simulator runs it on the meta device."""
    _streams_factory.append(factory)
    try:
        yield
    finally:
        _streams_factory.remove(factory)


def streams_for(device: torch.device):
    if _streams_factory:
        return _streams_factory[-1](device)
    if device.type == "cpu":
        return SimulatedStreams(**_simulation_schedule)
    return AcceleratorStreams(device)
