"""Counters for one training step, and the public snapshot built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a saved tensor stayed on the device instead of being offloaded.
KEEP_REASONS = (
    "parameter",
    "leaf",  # an input that requires grad: autograd's AccumulateGrad keeps it on the device until backward
    "too_small",
    "kept_layer",
    "kept_for_budget",  # its layer stayed on the device: the device-memory budget had room for it
    "duplicate",
    "unsupported",
    "over_budget",  # offloading it would have taken host memory past max_host_bytes
    "no_host_memory",  # the host buffer could not be allocated
)


@dataclass
class StepCounters:
    """Counted from the first layer of a forward pass after a backward, until the next such."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    restored_tensors: int = 0
    restored_on_demand: int = 0
    restored_ahead: int = 0
    layers_offloaded: int = 0
    max_layer_offloaded_bytes: int = 0
    peak_forward_held_bytes: int = 0
    peak_backward_held_bytes: int = 0
    max_device_bytes: int | None = None
    layer_activation_bytes: int = 0
    peak_resident_bytes: int = 0
    layers_kept_for_budget: int = 0
    planned_peak_bytes: int | None = None
    plan_tokens: int | None = None
    disk_offloaded_tensors: int = 0
    disk_offloaded_bytes: int = 0
    layers_on_disk: int = 0
    planned_disk_layers: int | None = None
    recompute_offloaded_tensors: int = 0
    recompute_offloaded_bytes: int = 0
    recompute_restored_tensors: int = 0
    recompute_kept_bytes: int = 0
    early_releases: int = 0
    kept_tensors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KEEP_REASONS, 0))
    kept_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KEEP_REASONS, 0))

    def keep(self, reason: str, nbytes: int) -> None:
        self.kept_tensors[reason] += 1
        self.kept_bytes[reason] += nbytes


@dataclass
class LifetimeCounters:
    """Counted since offloading was enabled; proves when the engine did no work at all."""

    layer_scopes: int = 0
    pack_calls: int = 0
    unpack_calls: int = 0


@dataclass(frozen=True)
class OffloadStats:
    """What the offloader did in the last training step (forward passes up to one backward).

    `duplicate` tensors share a storage already offloaded in the same forward pass: no second
    copy was made, and their bytes count under `kept_bytes["duplicate"]`.

    `restored_ahead` copies were brought back while a later layer's backward ran (prefetch);
    `restored_on_demand` ones only when their own layer's backward began. `peak_*_held_bytes`
    is the most device memory the engine itself kept referenced: sources of copies in flight
    in forward, copies brought back ahead in backward. `layer_activation_bytes` is what the
    decoder layers saved in the step, offloaded or kept (each storage once; parameters and
    tensors under min_offload_bytes not included), and `peak_resident_bytes` the most of it on
    the device at once, by the engine's accounting: what kept layers saved, plus the copies'
    sources in flight and the copies brought back ahead. With a device-memory budget,
    `max_device_bytes` is the budget in force for the step ("auto" resolved),
    `layers_kept_for_budget` how many offloadable layers the plan kept on the device,
    `planned_peak_bytes` the peak the plan predicted for `plan_tokens` tokens.
    `host_bytes_held`, `live_host_copies` and the `pool_*` fields are read now, not at the end
    of the step; `pool_allocations` counts host slabs ever allocated (buffers are carved
    from them and reused, not allocated again).

    With the disk tier (`disk_dir`): `disk_offloaded_tensors`/`_bytes` of the offloaded ones went
    to disk, from `layers_on_disk` layer calls (`planned_disk_layers` is the plan's number, None
    while the first step measures); `disk_bytes_written`/`_read` this step (whole aligned
    extents), `disk_write_gbps`/`disk_read_gbps` the rate of those transfers (bytes over the
    seconds each took, from the copy out's end to the last byte), `disk_wait_seconds` how long
    forward and backward waited on the disk (0 when the disk hid behind compute), `disk_bytes_held` the
    file's bytes in use now, `disk_io` "O_DIRECT" or "buffered".
    """

    mode: str
    offloaded_tensors: int
    offloaded_bytes: int
    kept_tensors: dict[str, int]
    kept_bytes: dict[str, int]
    restored_tensors: int
    restored_on_demand: int
    restored_ahead: int
    layers_offloaded: int
    max_layer_offloaded_bytes: int
    peak_forward_held_bytes: int
    peak_backward_held_bytes: int
    max_device_bytes: int | None
    layer_activation_bytes: int
    peak_resident_bytes: int
    layers_kept_for_budget: int
    planned_peak_bytes: int | None
    plan_tokens: int | None
    host_bytes_held: int
    live_host_copies: int
    pool_bytes: int
    pool_free_bytes: int
    pool_allocations: int
    max_host_bytes: int
    total_layer_scopes: int
    total_pack_calls: int
    total_unpack_calls: int
    # The disk tier (None, or 0, without disk_dir).
    disk_dir: str | None = None
    disk_io: str | None = None
    max_disk_bytes: int | None = None
    disk_offloaded_tensors: int = 0
    disk_offloaded_bytes: int = 0
    layers_on_disk: int = 0
    planned_disk_layers: int | None = None
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    disk_write_gbps: float | None = None
    disk_read_gbps: float | None = None
    disk_wait_seconds: float = 0.0
    disk_bytes_held: int = 0
    # Inside checkpointed layers' recompute (`engine.recompute`): storages saved for the attention's
    # backward that waited on the host while the MLP's backward ran, and were brought back; what stayed
    # because the layer's total was under `recompute.RECOMPUTE_OFFLOAD_BYTES` (or got no host memory).
    recompute_offloaded_tensors: int = 0
    recompute_offloaded_bytes: int = 0
    recompute_restored_tensors: int = 0
    recompute_kept_bytes: int = 0
    # Layers whose copies to the host let go of their device sources before the next layer's attention
    # ran, not at its end (`ActivationOffloader.release_before_attention`, long context only).
    early_releases: int = 0

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def summary(self) -> str:
        lines = [
            f"mode: {self.mode}",
            f"offloaded: {self.offloaded_tensors} tensors, {_human(self.offloaded_bytes)}"
            f" from {self.layers_offloaded} layer calls",
        ]
        for reason in KEEP_REASONS:
            if self.kept_tensors[reason]:
                lines.append(f"kept ({reason}): {self.kept_tensors[reason]} tensors, {_human(self.kept_bytes[reason])}")
        if self.restored_tensors:
            lines.append(
                f"brought back: {self.restored_ahead} copies ahead of need, {self.restored_on_demand} on demand"
            )
        if self.recompute_offloaded_tensors:
            lines.append(
                f"inside the checkpoints' recompute: {self.recompute_offloaded_tensors} storages, "
                f"{_human(self.recompute_offloaded_bytes)} waited on the host for the attention's backward"
            )
        lines.append(
            f"device memory held by the engine at most: {_human(self.peak_forward_held_bytes)} in forward, "
            f"{_human(self.peak_backward_held_bytes)} in backward"
        )
        lines.append(f"decoder-layer activations on the device at most: {_human(self.peak_resident_bytes)}")
        if self.max_device_bytes is not None:
            layers = self.layers_offloaded + self.layers_kept_for_budget
            if self.planned_peak_bytes is None:
                plan = "first step: every layer offloaded while the bytes per layer are measured"
            else:
                plan = (
                    f"offloaded the first {self.layers_offloaded} of {layers} offloadable layer calls, kept "
                    f"{self.layers_kept_for_budget} on the device; predicted peak {_human(self.planned_peak_bytes)}"
                    f" for {self.plan_tokens if self.plan_tokens is not None else 'an unknown number of'} tokens"
                )
            lines.append(f"device-memory budget {_human(self.max_device_bytes)}: {plan}")
        if self.disk_dir is not None:
            lines.append(
                f"disk tier ({self.disk_dir}, {self.disk_io}): {self.disk_offloaded_tensors} tensors, "
                f"{_human(self.disk_offloaded_bytes)} from {self.layers_on_disk} layer calls; written "
                f"{_human(self.disk_bytes_written)}{_rate(self.disk_write_gbps)}, read {_human(self.disk_bytes_read)}"
                f"{_rate(self.disk_read_gbps)}; compute waited {self.disk_wait_seconds:.3f} s on the disk"
            )
        lines.append(f"host memory held now: {_human(self.host_bytes_held)} in {self.live_host_copies} copies")
        lines.append(f"host buffer pool: {_human(self.pool_bytes)} ({_human(self.pool_free_bytes)} free)")
        return "\n".join(lines)


def _rate(gbps: float | None) -> str:
    return "" if gbps is None else f" at {gbps:.2f} GB/s"


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        value /= 1024
    raise AssertionError("unreachable")
