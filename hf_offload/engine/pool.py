"""Host buffers reused across steps, sized to what they hold.

A fresh pinned allocation costs milliseconds (seconds for the tens of GiB a long sequence
offloads), so buffers are carved out of a few large host blocks ("slabs") that live across
steps. A request gets exactly its size, aligned to `ALIGNMENT` bytes (what `O_DIRECT` file I/O
needs of a buffer: the disk tier reads and writes these buffers directly), from the smallest free
extent that holds it (best fit); a released buffer goes back to its slab, merged with its free
neighbours. Offloaded tensors are allocated layer by layer in forward and released in reverse
order in backward, so carving behaves like a stack and leaves no holes.

How the slabs are sized:

- a request that no free extent holds gets a slab of exactly its size, so the first step ends with
  one slab per tensor, no byte wasted;
- a longer step than any before finds no extent that holds its requests: the wholly free slabs
  smaller than a request are given back and exact ones allocated, so the pool holds what the
  longest step needs, not a power of two above it (issue 25: at 640k tokens of an 8B model, 8 GiB
  buffers for 5 GiB inputs), nor the old slabs beside the new ones;
- steps of any length up to the longest seen are carved from those slabs without a new allocation
  (the steady state; shorter requests stack up in the first slab that holds them);
- a step that found room enough but in pieces (a release order far from a stack) makes the pool,
  once every buffer is back, replace its slabs with one slab of everything it owns, which then
  carves like a stack.

Reuse needs no event: every copy into or out of a pooled buffer runs on its device's one copy
stream, in the order it was enqueued, so a buffer handed out again is written only after every
earlier copy that touched it has run. The disk tier's reader and writer threads, which touch
buffers outside the copy stream, order themselves (`engine/disk.py`).
"""

from __future__ import annotations

import sys
import threading

import torch

from . import forks
from .extents import ExtentMap

# Bytes: a page, and the logical block size O_DIRECT asks alignment to on every common file system.
ALIGNMENT = 4096

# Views kept per slab for reuse (see `HostBuffer`); past this many the cache starts afresh.
_VIEW_CACHE_LIMIT = 4096


def rounded_size(nbytes: int) -> int:
    """The host bytes a storage of `nbytes` takes in the pool: its size rounded up to `ALIGNMENT`."""
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


class HostBuffer:
    """A pooled host buffer: `size` bytes at `offset` in a slab (`block`, a 1-D uint8 tensor
    over them), with the views last made of it kept for the next copy of the same size or layout:
    in steady training a layer's copies have the sizes and layouts they had the step before, the
    pool hands out the same extents again, and making a view costs more than the copy's own
    bookkeeping. Views of the slab tensor, so that they keep the slab's own storage (what CUDA's
    pinned-memory allocator tracks its blocks by)."""

    __slots__ = ("block", "size", "slab", "offset", "_bytes", "_layout", "_typed")

    def __init__(self, block: torch.Tensor, size: int, slab: _Slab | None = None, offset: int = 0) -> None:
        self.block, self.size, self.slab, self.offset = block, size, slab, offset
        self._bytes: torch.Tensor | None = None
        self._layout: tuple | None = None
        self._typed: torch.Tensor | None = None

    def view(self, nbytes: int) -> torch.Tensor:
        """Its first `nbytes` bytes."""
        view = self._bytes
        if view is None or view.numel() != nbytes:
            view = self._bytes = self.block[:nbytes]
        return view

    def typed(self, dtype: torch.dtype, shape: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
        """A tensor of this layout over its first bytes (the layout must be dense from offset 0)."""
        layout = (dtype, shape, stride)
        if self._layout != layout:
            self._typed = self.block.view(dtype).as_strided(shape, stride)
            self._layout = layout
        return self._typed  # type: ignore[return-value]

    def data_ptr(self) -> int:
        return self.block.data_ptr()


class _Slab:
    """One host allocation: its bytes in use and the views made of it (its free extents are in the
    pool's `ExtentMap`, under the slab's number)."""

    __slots__ = ("memory", "size", "number", "used", "views")

    def __init__(self, memory: torch.Tensor, size: int, number: int) -> None:
        self.memory, self.size, self.number = memory, size, number
        self.used = 0
        self.views: dict[tuple[int, int], HostBuffer] = {}

    def buffer(self, offset: int, size: int) -> HostBuffer:
        key = (offset, size)
        buffer = self.views.get(key)
        if buffer is None:
            if len(self.views) >= _VIEW_CACHE_LIMIT:
                self.views.clear()
            buffer = self.views[key] = HostBuffer(self.memory[offset : offset + size], size, self, offset)
        return buffer


class HostBudget:
    """Host memory for offloaded activations, in one place: the most they may take (`limit`,
    max_host_bytes) and what the pools hold of it now (`held`: buffers handed out, host copies and
    the disk tier's staging buffers alike). One per offloader, shared by its pools (one per device),
    which alone change `held` (`charge`), whatever thread gives a buffer back."""

    __slots__ = ("limit", "held", "_lock")

    def __init__(self, limit: int = sys.maxsize) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def has_room(self, nbytes: int) -> bool:
        return self.held + nbytes <= self.limit

    def charge(self, nbytes: int) -> None:
        """`nbytes` more held (fewer, if negative)."""
        with self._lock:
            self.held += nbytes


class HostPool:
    """The pooled host buffers of one device, charged to a `HostBudget` (its own, unlimited, if
    none is given). Made in one process, it is inert in a process forked from it (`forks`)."""

    def __init__(self, streams, budget: HostBudget | None = None) -> None:
        self._streams = streams
        self.budget = budget if budget is not None else HostBudget()
        self._owner = forks.this_process()
        self._slabs: dict[int, _Slab] = {}  # by number, in order of allocation
        self._free = ExtentMap()  # free extents of every slab, the region being the slab's number
        self._numbers = 0
        self.owned_bytes = 0
        self.allocations = 0
        self.in_use_bytes = 0
        # Since the pool was last idle (every buffer back): the most bytes in use at once, and
        # whether a request found no extent although the pool had free bytes enough.
        self._cycle_peak = 0
        self._cycle_start_bytes = 0  # what the pool owned when the cycle began
        self._cycle_short = False
        self._consolidate_to = 0  # when idle: replace the slabs by one of this many bytes
        # HostCopy.__del__ releases buffers on whatever thread drops the graph (autograd's
        # device threads included).
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        return self._free.free_bytes

    def acquire(self, size: int) -> HostBuffer:
        """A buffer of `size` bytes (a `rounded_size`), carved from a free extent, charged to the
        budget; a new slab only if none holds it, after giving back free slabs if the pool would
        then own more than the budget's limit. The caller decides whether the budget has room."""
        if not forks.made_here(self._owner):
            raise RuntimeError(
                "hf_offload: this host pool belongs to the process this one was forked from; its buffers are "
                "that process's memory"
            )
        with self._lock:
            if not self.in_use_bytes:
                if self._consolidate_to:
                    self._consolidate()
                self._cycle_start_bytes = self.owned_bytes
            buffer = self._carve(size)
            if buffer is None:
                if self.free_bytes >= size:
                    self._cycle_short = True  # room enough, in pieces: the slabs are outgrown
                # Wholly free slabs too small for this request are from shorter steps: a longer
                # one has begun, and keeping them beside its new slabs would hold both at once.
                outgrown = [slab for slab in self._slabs.values() if not slab.used and slab.size < size]
                if outgrown:
                    self._drop(outgrown)
                if self.owned_bytes + size > self.budget.limit:
                    self._trim()
                self._add_slab(size)
                buffer = self._carve(size)
                assert buffer is not None
            self.in_use_bytes += size
            self.budget.charge(size)
            if self.in_use_bytes > self._cycle_peak:
                self._cycle_peak = self.in_use_bytes
            return buffer

    def release(self, buffer: HostBuffer) -> None:
        if not forks.made_here(self._owner):
            return  # the buffer and its bookkeeping are the parent's
        with self._lock:
            slab = buffer.slab
            self.in_use_bytes -= buffer.size
            self.budget.charge(-buffer.size)
            if slab is None or slab.memory is None:
                return  # a slab already given back (cannot happen while a buffer is in use)
            slab.used -= buffer.size
            self._free.give(slab.number, buffer.offset, buffer.size)
            if not self.in_use_bytes:
                self._end_cycle()

    def trim(self) -> None:
        """Give every wholly free slab back (and the allocator's cache of them, where it keeps one)."""
        if not forks.made_here(self._owner):
            return
        with self._lock:
            self._trim()

    def _trim(self) -> None:
        idle = [slab for slab in self._slabs.values() if not slab.used]
        if not idle:
            return
        self._drop(idle)
        self._streams.empty_host_cache()

    def _end_cycle(self) -> None:
        # A step that found room enough but in pieces (the bytes it held at once were no more
        # than the pool owned when it began): one slab of everything owned now, which only
        # grows, so that a few steps of one shape converge. A longer step than any before needs
        # nothing of this: its new slabs are exact, and the outgrown ones were dropped. Never past
        # the host budget, unless one step's buffers alone exceeded it.
        if self._cycle_short and self._cycle_peak <= self._cycle_start_bytes:
            self._consolidate_to = min(self.owned_bytes, max(self.budget.limit, self._cycle_peak))
        self._cycle_peak = 0
        self._cycle_short = False

    def _consolidate(self) -> None:
        target = self._consolidate_to
        self._consolidate_to = 0
        if len(self._slabs) == 1 and next(iter(self._slabs.values())).size >= target:
            return
        self._drop(list(self._slabs.values()))
        self._streams.empty_host_cache()
        self._add_slab(target)

    def _add_slab(self, size: int) -> None:
        memory = self._allocate(size)
        slab = _Slab(memory, size, self._numbers)
        self._numbers += 1
        self._slabs[slab.number] = slab
        self._free.give(slab.number, 0, size)
        self.owned_bytes += size
        self.allocations += 1

    def _allocate(self, size: int) -> torch.Tensor:
        """`size` bytes aligned to ALIGNMENT. Pinned and meta memory come page-aligned; the CPU
        allocator's may not, and then a little more is asked for and the aligned part kept."""
        memory = self._streams.host_buffer(size)
        if memory.data_ptr() % ALIGNMENT == 0:
            return memory
        del memory
        memory = self._streams.host_buffer(size + ALIGNMENT)
        skip = -memory.data_ptr() % ALIGNMENT
        return memory[skip : skip + size]

    def _drop(self, slabs: list[_Slab]) -> None:
        """Give back wholly free slabs (each is then one free extent, its whole size)."""
        # Copies out of or into these slabs may still be queued on the copy stream: memory
        # handed back to the system (rather than to torch's caching host allocator, which
        # orders itself) must wait for them.
        self._streams.quiesce_host()
        for slab in slabs:
            self._free.remove(slab.number, 0, slab.size)
            self.owned_bytes -= slab.size
            slab.memory = None  # type: ignore[assignment]
            slab.views.clear()
            del self._slabs[slab.number]

    def _carve(self, size: int) -> HostBuffer | None:
        found = self._free.take(size)
        if found is None:
            return None
        number, offset = found
        slab = self._slabs[number]
        slab.used += size
        return slab.buffer(offset, size)
