"""Free space in regions of bytes, handed out best fit and merged on release: what both the host
pool's slabs (`engine/pool.py`) and the disk tier's file (`engine/disk.py`) are carved from.

A region is a number the caller chooses (a slab's, or 0 for the one file). Free extents never
merge across regions. Best fit: the smallest free extent that holds a request, ties going to the
lowest region, then the lowest offset, found by bisection (the pool's first step can have a slab
per tensor, thousands of them).
"""

from __future__ import annotations

import bisect


class ExtentMap:
    """The free extents of any number of regions."""

    __slots__ = ("_by_size", "_starts", "_ends", "free_bytes")

    def __init__(self) -> None:
        self._by_size: list[tuple[int, int, int]] = []  # (length, region, offset), sorted: best fit first
        self._starts: dict[tuple[int, int], int] = {}  # (region, offset) -> length
        self._ends: dict[tuple[int, int], int] = {}  # (region, end) -> offset
        self.free_bytes = 0

    def take(self, size: int) -> tuple[int, int] | None:
        """(region, offset) of `size` bytes from the smallest free extent that holds them; None if
        none does."""
        extents = self._by_size
        index = bisect.bisect_left(extents, (size, -1, -1))
        if index == len(extents):
            return None
        length, region, offset = extents.pop(index)
        del self._starts[(region, offset)]
        del self._ends[(region, offset + length)]
        self.free_bytes -= length
        if length > size:
            self._add(region, offset + size, length - size)
        return region, offset

    def give(self, region: int, offset: int, size: int) -> tuple[int, int]:
        """`size` bytes at `offset` of `region` are free again, merged with the free extents on
        either side; returns the merged extent as (start, end)."""
        start, end = offset, offset + size
        before = self._ends.get((region, start))  # a free extent ending where this one starts
        if before is not None:
            self._remove(region, before, start - before)
            start = before
        after = self._starts.get((region, end))  # a free extent starting where this one ends
        if after is not None:
            self._remove(region, end, after)
            end += after
        self._add(region, start, end - start)
        return start, end

    def remove(self, region: int, start: int, end: int) -> None:
        """The free extent [start, end) of `region` is no longer space to hand out (the end of a
        file given back, a slab freed)."""
        self._remove(region, start, end - start)

    def _add(self, region: int, offset: int, length: int) -> None:
        self._starts[(region, offset)] = length
        self._ends[(region, offset + length)] = offset
        bisect.insort(self._by_size, (length, region, offset))
        self.free_bytes += length

    def _remove(self, region: int, offset: int, length: int) -> None:
        del self._starts[(region, offset)]
        del self._ends[(region, offset + length)]
        extents = self._by_size
        extents.pop(bisect.bisect_left(extents, (length, region, offset)))
        self.free_bytes -= length
