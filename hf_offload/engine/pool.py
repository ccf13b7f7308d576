"""Host buffers reused across steps, because a fresh pinned allocation costs milliseconds.

Reuse needs no event: every copy into or out of a pooled buffer runs on the one copy stream,
in the order it was enqueued, so a buffer handed out again is written only after every earlier
copy that touched it has run.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class HostPool:
    def __init__(self, streams) -> None:
        self._streams = streams
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.free_bytes = 0
        self.owned_bytes = 0
        self.allocations = 0

    def acquire(self, nbytes: int, limit: int) -> torch.Tensor:
        """A buffer of exactly `nbytes`; a new one only if the pool then owns at most `limit`
        bytes, after giving back free buffers of other sizes if need be."""
        free = self._free.get(nbytes)
        if free:
            self.free_bytes -= nbytes
            return free.pop()
        if self.owned_bytes + nbytes > limit:
            self.trim()
        buffer = self._streams.host_buffer(nbytes)
        self.allocations += 1
        self.owned_bytes += nbytes
        return buffer

    def trim(self) -> None:
        """Give every free buffer back to the system."""
        self.owned_bytes -= self.free_bytes
        self.free_bytes = 0
        self._free.clear()

    def release(self, buffer: torch.Tensor) -> None:
        self._free[buffer.numel()].append(buffer)
        self.free_bytes += buffer.numel()
