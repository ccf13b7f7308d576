"""Host buffers reused across steps, because a fresh pinned allocation costs milliseconds.

Buffers come in power-of-two sizes, so that sequences of varying length (dynamic padding) reuse
the same few sizes instead of piling up one free buffer per length; a request gets a slice of
the smallest buffer that holds it. Counted sizes are the real (rounded) ones.

Reuse needs no event: every copy into or out of a pooled buffer runs on its device's one copy
stream, in the order it was enqueued, so a buffer handed out again is written only after every
earlier copy that touched it has run.
"""

from __future__ import annotations

from collections import defaultdict

import torch

SMALLEST_BUFFER = 4096


def rounded_size(nbytes: int) -> int:
    return max(SMALLEST_BUFFER, 1 << (max(nbytes, 1) - 1).bit_length())


class HostBuffer:
    """A pooled host buffer (a 1-D uint8 tensor), with the views last made of it kept for the
    next copy of the same size or layout: in steady training a layer's copies have the sizes and
    layouts they had the step before, and making a view costs more than the copy's own
    bookkeeping. Views of the tensor, so that they keep the buffer's own storage (what CUDA's
    pinned-memory allocator tracks its blocks by)."""

    __slots__ = ("block", "size", "_bytes", "_layout", "_typed")

    def __init__(self, block: torch.Tensor, size: int) -> None:
        self.block, self.size = block, size
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


class HostPool:
    def __init__(self, streams) -> None:
        self._streams = streams
        self._free: dict[int, list[HostBuffer]] = defaultdict(list)
        self.free_bytes = 0
        self.owned_bytes = 0
        self.allocations = 0

    def acquire(self, size: int, limit: int) -> HostBuffer:
        """A buffer of `size` bytes (a `rounded_size`); a new one only if the pool then owns at
        most `limit` bytes, after giving back its free buffers if need be."""
        free = self._free.get(size)
        if free:
            self.free_bytes -= size
            return free.pop()
        if self.owned_bytes + size > limit:
            self.trim()
        buffer = HostBuffer(self._streams.host_buffer(size), size)
        self.allocations += 1
        self.owned_bytes += size
        return buffer

    def trim(self) -> None:
        """Give every free buffer back (and the allocator's cache of them, where it keeps one)."""
        if not self.free_bytes:
            return
        self.owned_bytes -= self.free_bytes
        self.free_bytes = 0
        self._free.clear()
        self._streams.empty_host_cache()

    def release(self, buffer: HostBuffer) -> None:
        self._free[buffer.size].append(buffer)
        self.free_bytes += buffer.size
