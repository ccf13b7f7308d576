"""Which decoder layers to offload so that a step stays under a device-memory budget.

A pure function of the bytes each layer call saves this step, the budget, and how the engine
holds memory; no transformers, no tensors. The engine calls `plan` at the first decoder layer of
every forward pass, with each layer's bytes predicted from the bytes per token it saved in the
last step times this step's tokens (lengths vary from batch to batch).

Offloaded layers are always the earliest ones: their copies out and back have the most compute
to hide behind, while the last layers are needed first in backward. `resident_peak` replays the
engine's own accounting of decoder-layer activation bytes on the device (what kept layers saved,
the sources of copies in flight, the copies brought back ahead), event by event:

- forward, when layer j returns: the bytes of every kept layer up to j, plus layer j's batch of
  copies out (if offloaded) and layer j-1's (if offloaded; it is released only now);
- backward, when layer g's backward begins: the bytes of every kept layer up to g (those after g
  are done and freed), plus the copies brought back for g and for the `prefetch_layers` offloaded
  layers before it. A layer brings back its own copies and those of storages it saved again
  after an earlier layer offloaded them (deduplicated, such as the rotary cos/sin); those are
  `restore_bytes`, counted for every layer that shares them, so the prediction never falls
  short of what the engine counts (it counts such a copy once).

The engine measures `peak_resident_bytes` with these rules, so the statistics never report more
than a plan predicted when the bytes per layer were predicted right.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """`offloaded_layers` leading layer calls of the pass are offloaded; the rest stay."""

    offloaded_layers: int
    predicted_peak_bytes: int
    fits: bool  # False: even offloading every offloadable layer exceeds the budget


def resident_peak(
    layer_bytes: Sequence[int],
    offloaded_layers: int,
    prefetch_layers: int,
    restore_bytes: Sequence[int] | None = None,
) -> int:
    """The most decoder-layer activation bytes on the device at once when the first
    `offloaded_layers` layer calls are offloaded and the rest keep their activations.
    `restore_bytes[i]` (default `layer_bytes[i]`) is what layer i brings back in backward."""
    count = len(layer_bytes)
    restore_bytes = layer_bytes if restore_bytes is None else restore_bytes
    k = min(max(offloaded_layers, 0), count)
    peak = 0
    kept = 0
    for j, nbytes in enumerate(layer_bytes):
        if j >= k:
            kept += nbytes
        in_flight = (nbytes if j < k else 0) + (layer_bytes[j - 1] if 0 < j <= k else 0)
        peak = max(peak, kept + in_flight)
    # Backward, last layer first. `kept` holds the kept layers up to g (those after g were freed
    # as backward passed them); `ahead` the offloaded layers in [g - prefetch_layers, g].
    ahead = 0
    for g in range(count - 1, -1, -1):
        entering = g - prefetch_layers
        if g == count - 1:
            ahead = sum(restore_bytes[i] for i in range(max(entering, 0), min(g, k - 1) + 1))
        else:
            if entering >= 0 and entering < k:
                ahead += restore_bytes[entering]
            if g + 1 < k:
                ahead -= restore_bytes[g + 1]
        peak = max(peak, kept + ahead)
        if g >= k:
            kept -= layer_bytes[g]
    return peak


def plan(
    layer_bytes: Sequence[int],
    budget: int,
    *,
    offloadable_layers: int,
    prefetch_layers: int,
    restore_bytes: Sequence[int] | None = None,
) -> Plan:
    """The fewest leading layers to offload so that `resident_peak` stays within `budget`.

    `offloadable_layers` is how many of the leading layer calls may be offloaded at all (the last
    `keep_last_layers` never are). When no choice fits, every offloadable layer is offloaded:
    a step is never refused, it only uses more memory than the budget.
    """
    limit = min(max(offloadable_layers, 0), len(layer_bytes))
    # The kept layers alone are resident at the end of forward: no smaller k can fit.
    first = 0
    suffix = sum(layer_bytes)
    while first < limit and suffix > budget:
        suffix -= layer_bytes[first]
        first += 1
    for k in range(first, limit + 1):
        peak = resident_peak(layer_bytes, k, prefetch_layers, restore_bytes)
        if peak <= budget:
            return Plan(k, peak, True)
    return Plan(limit, resident_peak(layer_bytes, limit, prefetch_layers, restore_bytes), False)


@dataclass(frozen=True)
class TierPlan:
    """`disk_layers` leading offloaded layer calls put their copies on disk, the rest of the
    offloaded ones in host memory."""

    disk_layers: int
    host_bytes: int  # the most host memory held at once: the host tier's copies and the staging
    staging_bytes: int  # of which kept free for the disk tier's staging buffers
    disk_bytes: int  # what the disk tier holds at the end of forward
    fits: bool  # False: the disk budget is short of what the host budget leaves to it, or host_short
    host_short: bool = False  # even with every layer on disk, the staging buffers exceed host_bytes


def place_tiers(
    layer_bytes: Sequence[int],
    *,
    offloaded_layers: int,
    host_bytes: int,
    disk_bytes: int,
    staging_layers: int,
) -> TierPlan:
    """Where the copies of the first `offloaded_layers` layer calls go: the fewest leading layers
    on disk such that the host tier's copies, plus staging buffers for `staging_layers` of the
    disk layers at once (copies out in forward being written, reads in backward being copied back),
    fit in `host_bytes`.

    The leading layers go to disk because backward needs them last: their reads have the whole
    backward of the later layers to hide behind, while the last layers' copies, needed first, come
    back from host memory at once. `layer_bytes[i]` is the host bytes layer call i's copies take.
    A pure function: the engine plans each forward pass with it, and the memory simulator can
    place a step it has not run.
    """
    count = min(max(offloaded_layers, 0), len(layer_bytes))
    suffix = sum(layer_bytes[:count])  # host tier: layers [disk_layers, count)
    largest = 0  # the largest disk layer so far
    for disk_layers in range(count + 1):
        staging = staging_layers * largest
        if suffix + staging <= host_bytes:
            on_disk = sum(layer_bytes[:disk_layers])
            return TierPlan(disk_layers, suffix + staging, staging, on_disk, on_disk <= disk_bytes)
        if disk_layers < count:
            suffix -= layer_bytes[disk_layers]
            largest = max(largest, layer_bytes[disk_layers])
    staging = staging_layers * largest
    on_disk = sum(layer_bytes[:count])
    return TierPlan(count, staging, staging, on_disk, False, host_short=True)
