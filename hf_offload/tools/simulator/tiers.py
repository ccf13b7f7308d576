"""Host memory and disk for a simulated step: where the offloaded layer inputs go, whether the
two tiers hold them, the longest length they hold, and whether the disk's time hides.

Placement is the engine's own: `hf_offload.internal.place_layers` is `planner.place_tiers` with
the engine's staging, on the host bytes each layer call's copies took in the simulated step (the
engine plans its next pass from the same numbers). A step fits the tiers when that plan fits:
the host-memory layers plus staging buffers for two disk layers within the host budget, the rest
within the disk budget. Where they do not, the engine would keep what fits neither on the device;
the estimate counts such a length as not fitting instead (it does not simulate that device peak).

The disk's time, a pipeline at the disk's rate (`disk_gbps`, one rate for writes and reads):
- forward: a disk layer's copies are written while the layers after it run their forward, with
  staging for two layers at once, so the writes keep up when one layer's write takes no longer
  than one layer's forward compute;
- backward: the disk layers are the leading ones, needed last; their reads start
  `prefetch_layers + 1` layers ahead of need and follow one another, so they keep up when one
  layer's read takes no longer than one layer's backward compute (its recompute included).
The time the disk adds when it does not keep up, about: for each disk layer, what its write
takes beyond a layer's forward plus what its read takes beyond a layer's backward. Compute per
layer is the time model's (`devices.compute_seconds`) share of layer 0's FLOPs; the host link's
copies run beside the disk and are judged on their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hf_offload.internal import TierPlan, place_layers

from .step import StepResult

# A disk tier's rate when none is given: the low end of one NVMe drive's sustained direct I/O
# (docs/tiers.md: 2-7 GB/s; this project's virtio disk measured 1.5-2.1).
DEFAULT_DISK_GBPS = 2.0


def layer_places(plan: TierPlan, offloaded_layers: int, layers: int) -> list[str]:
    """For each layer call, where its offloaded inputs live: "disk", "host" or "device" (a layer
    not offloaded, such as the last one, kept)."""
    return [
        "disk" if index < plan.disk_layers else "host" if index < offloaded_layers else "device"
        for index in range(layers)
    ]


def stored(step: StepResult) -> bool:
    """The step's copies fit host memory and disk (a step without hf_offload stores nothing)."""
    return step.tiers is None or step.tiers.fits


def longest_stored(
    short: StepResult, long_: StepResult, *, host_bytes: int, disk_bytes: int, granularity: int, limit: int
) -> int | None:
    """The longest multiple of `granularity` (up to `limit`) whose layer inputs the two tiers hold,
    from each layer call's host bytes at two lengths (each grows linearly with the tokens); None
    when the steps have no tiers or no length fits. A prediction: the search simulates the length."""
    if short.layer_host_bytes is None or long_.layer_host_bytes is None:
        return None
    if len(short.layer_host_bytes) != len(long_.layer_host_bytes):
        return None
    span = long_.seq_len - short.seq_len
    lines = [(a, (b - a) / span) for a, b in zip(short.layer_host_bytes, long_.layer_host_bytes, strict=True)]
    offloaded = long_.offloaded_layers or 0

    def fits(seq_len: int) -> bool:
        layer_bytes = [max(round(a + slope * (seq_len - short.seq_len)), 0) for a, slope in lines]
        return place_layers(layer_bytes, offloaded, host_bytes=host_bytes, disk_bytes=disk_bytes).fits

    low, high = 0, limit // granularity + 1  # in grid steps: low fits (or is 0), high does not
    if fits(high * granularity):
        return (high - 1) * granularity
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * granularity) else (low, middle)
    return low * granularity or None


@dataclass
class DiskTime:
    """One disk layer's transfer against one layer's compute, at the disk's rate."""

    gbps: float
    layer_bytes: int  # the largest disk layer's
    write_seconds: float
    read_seconds: float
    forward_seconds: float  # one layer's forward compute
    backward_seconds: float  # one layer's backward compute, recompute included
    exposed_seconds: float  # what the disk adds to the step, about (0 when hidden)

    @property
    def hidden(self) -> bool:
        return self.write_seconds <= self.forward_seconds and self.read_seconds <= self.backward_seconds


def disk_time(step: StepResult, gbps: float, layer_seconds: Callable[[tuple[str, ...]], float]) -> DiskTime | None:
    """The disk's time model (module docstring) for `step`'s tier plan; None with no layer on disk.
    `layer_seconds(phases)` is one decoder layer's compute time in those phases."""
    plan = step.tiers
    if plan is None or not plan.disk_layers or not step.layer_host_bytes:
        return None
    layer_bytes = max(step.layer_host_bytes[: plan.disk_layers])
    transfer = layer_bytes / (gbps * 1e9)
    forward = layer_seconds(("forward",))
    backward = layer_seconds(("backward", "recompute"))
    exposed = plan.disk_layers * (max(transfer - forward, 0.0) + max(transfer - backward, 0.0))
    return DiskTime(gbps, layer_bytes, transfer, transfer, forward, backward, exposed)
