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


class HostPool:
    def __init__(self, streams) -> None:
        self._streams = streams
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.free_bytes = 0
        self.owned_bytes = 0
        self.allocations = 0

    def acquire(self, nbytes: int, limit: int) -> torch.Tensor:
        """A whole buffer of `rounded_size(nbytes)` bytes; a new one only if the pool then owns
        at most `limit` bytes, after giving back its free buffers if need be."""
        size = rounded_size(nbytes)
        free = self._free.get(size)
        if free:
            self.free_bytes -= size
            return free.pop()
        if self.owned_bytes + size > limit:
            self.trim()
        buffer = self._streams.host_buffer(size)
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

    def release(self, buffer: torch.Tensor) -> None:
        self._free[buffer.numel()].append(buffer)
        self.free_bytes += buffer.numel()
