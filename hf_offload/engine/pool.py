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

import bisect
import threading

import torch

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
    """One host allocation and its free extents (by start and by end, for merging)."""

    __slots__ = ("memory", "size", "number", "free_start", "free_end", "used", "views")

    def __init__(self, memory: torch.Tensor, size: int, number: int) -> None:
        self.memory, self.size, self.number = memory, size, number
        self.free_start: dict[int, int] = {0: size}  # offset -> length
        self.free_end: dict[int, int] = {size: 0}  # end -> offset
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


class HostPool:
    def __init__(self, streams) -> None:
        self._streams = streams
        self._slabs: dict[int, _Slab] = {}  # by number, in order of allocation
        # Free extents of every slab, best fit first: (length, slab number, offset).
        self._extents: list[tuple[int, int, int]] = []
        self._numbers = 0
        self.free_bytes = 0
        self.owned_bytes = 0
        self.allocations = 0
        self.in_use_bytes = 0
        # Since the pool was last idle (every buffer back): the most bytes in use at once, and
        # whether a request found no extent although the pool had free bytes enough.
        self._cycle_peak = 0
        self._cycle_start_bytes = 0  # what the pool owned when the cycle began
        self._cycle_short = False
        self._limit = 0  # the limit of the last request
        self._consolidate_to = 0  # when idle: replace the slabs by one of this many bytes
        # HostCopy.__del__ releases buffers on whatever thread drops the graph (autograd's
        # device threads included).
        self._lock = threading.Lock()

    def acquire(self, size: int, limit: int) -> HostBuffer:
        """A buffer of `size` bytes (a `rounded_size`), carved from a free extent; a new slab only
        if none holds it, after giving back free slabs if the pool would then own more than
        `limit` bytes."""
        with self._lock:
            self._limit = limit
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
                if self.owned_bytes + size > limit:
                    self._trim()
                self._add_slab(size)
                buffer = self._carve(size)
                assert buffer is not None
            self.in_use_bytes += size
            if self.in_use_bytes > self._cycle_peak:
                self._cycle_peak = self.in_use_bytes
            return buffer

    def release(self, buffer: HostBuffer) -> None:
        with self._lock:
            slab = buffer.slab
            self.in_use_bytes -= buffer.size
            if slab is None or slab.memory is None:
                return  # a slab already given back (cannot happen while a buffer is in use)
            slab.used -= buffer.size
            self._free_extent(slab, buffer.offset, buffer.size)
            if not self.in_use_bytes:
                self._end_cycle()

    def trim(self) -> None:
        """Give every wholly free slab back (and the allocator's cache of them, where it keeps one)."""
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
            self._consolidate_to = min(self.owned_bytes, max(self._limit, self._cycle_peak))
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
        bisect.insort(self._extents, (size, slab.number, 0))
        self.owned_bytes += size
        self.free_bytes += size
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
        dropped = {slab.number for slab in slabs}
        # Copies out of or into these slabs may still be queued on the copy stream: memory
        # handed back to the system (rather than to torch's caching host allocator, which
        # orders itself) must wait for them.
        self._streams.quiesce_host()
        for slab in slabs:
            self.owned_bytes -= slab.size
            self.free_bytes -= slab.size
            slab.memory = None  # type: ignore[assignment]
            slab.views.clear()
        for number in dropped:
            del self._slabs[number]
        self._extents = [extent for extent in self._extents if extent[1] not in dropped]

    def _carve(self, size: int) -> HostBuffer | None:
        extents = self._extents
        index = bisect.bisect_left(extents, (size, -1, -1))
        if index == len(extents):
            return None
        length, number, offset = extents.pop(index)
        slab = self._slabs[number]
        del slab.free_start[offset]
        del slab.free_end[offset + length]
        if length > size:
            rest = offset + size
            slab.free_start[rest] = length - size
            slab.free_end[offset + length] = rest
            bisect.insort(extents, (length - size, number, rest))
        slab.used += size
        self.free_bytes -= size
        return slab.buffer(offset, size)

    def _free_extent(self, slab: _Slab, offset: int, size: int) -> None:
        extents, number = self._extents, slab.number
        self.free_bytes += size
        start, end = offset, offset + size
        before = slab.free_end.pop(start, None)  # a free extent ending where this one starts
        if before is not None:
            length = start - before
            del slab.free_start[before]
            extents.pop(bisect.bisect_left(extents, (length, number, before)))
            start = before
        after = slab.free_start.pop(end, None)  # a free extent starting where this one ends
        if after is not None:
            del slab.free_end[end + after]
            extents.pop(bisect.bisect_left(extents, (after, number, end)))
            end += after
        slab.free_start[start] = end - start
        slab.free_end[end] = start
        bisect.insort(extents, (end - start, number, start))
