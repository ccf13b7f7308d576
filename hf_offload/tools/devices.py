"""What the tools need of an accelerator that simulation cannot give: its rates, its usable memory,
and the workspaces its libraries allocate through PyTorch's caching allocator."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class Device:
    name: str
    tflops: float  # sustained dense bf16 matmul TFLOP/s
    link_gbps: float  # host link, pinned memory, GB/s per direction
    memory_gib: float  # device memory a training step can use
    memory_tbps: float  # device memory bandwidth, TB/s (datasheet)
    source: str  # where the numbers come from
    # cuBLAS's workspace per handle, which PyTorch allocates through its caching allocator (so it
    # counts in max_memory_allocated): 32 MiB on Hopper, 4096 KiB x 2 + 16 KiB x 8 before it
    # (PyTorch's default CUBLAS_WORKSPACE_CONFIG per architecture).
    cublas_workspace_bytes: int = 4 * MIB * 2 + 16 * 1024 * 8

    @property
    def workspace_bytes(self) -> int:
        """Library workspaces live through a training step: one cuBLAS workspace for each thread
        that runs matmuls, the forward's and the autograd engine's device thread. It is what every
        simulated H200 peak was short of the measured one (0.06-0.07 GiB), not measured alone."""
        return 2 * self.cublas_workspace_bytes


# Vendor datasheet figures are derated to what a sustained workload gets, using the ratios our
# H200 showed: 789 of 989 dense bf16 TFLOP/s on an 8192^3 matmul (0.80), 55 of 64 GB/s per
# direction on PCIe gen 5 x16 (0.86), and 139 of 140.4 GiB usable (about 1.4 GiB to the CUDA
# context and allocator).
DATASHEET_COMPUTE_DERATING = 0.80
DATASHEET_LINK_DERATING = 0.86
RESERVED_GIB = 1.4
HOPPER_CUBLAS_WORKSPACE = 32 * MIB


def _from_datasheet(name: str, tflops: float, link_gbps: float, memory_mib: int, memory_tbps: float, what: str,
                    **extra) -> Device:  # fmt: skip
    """A device preset from vendor figures, derated as above."""
    return Device(
        name,
        round(tflops * DATASHEET_COMPUTE_DERATING),
        round(link_gbps * DATASHEET_LINK_DERATING, 1),
        round(memory_mib / 1024 - RESERVED_GIB, 1),
        memory_tbps,
        f"datasheet ({what}), derated",
        **extra,
    )


DEVICES = {
    "h200": Device(
        "h200",
        789.0,
        55.0,
        139.0,
        4.8,
        "measured on our H200: bf16 8192^3 matmul, pinned copies each way, 143771 MiB total; "
        "memory bandwidth from the datasheet",
        cublas_workspace_bytes=HOPPER_CUBLAS_WORKSPACE,
    ),
    "h100-80gb": _from_datasheet(
        "h100-80gb", 989.4, 64, 81559, 3.35, "H100 SXM 80GB: 989 TFLOP/s bf16 dense, PCIe gen 5 x16, 81559 MiB",
        cublas_workspace_bytes=HOPPER_CUBLAS_WORKSPACE,
    ),  # fmt: skip
    "a100-80gb": _from_datasheet(
        "a100-80gb", 312, 32, 81920, 2.04, "A100 80GB: 312 TFLOP/s bf16 dense, PCIe gen 4 x16, 81920 MiB"
    ),
    "a100-40gb": _from_datasheet(
        "a100-40gb", 312, 32, 40960, 1.56, "A100 40GB: 312 TFLOP/s bf16 dense, PCIe gen 4 x16, 40960 MiB"
    ),
    "l40s": _from_datasheet("l40s", 362, 32, 46068, 0.864, "L40S: 362 TFLOP/s bf16 dense, PCIe gen 4 x16, 46068 MiB"),
    "rtx4090": _from_datasheet(
        "rtx4090",
        165.2,
        32,
        24564,
        1.008,
        "RTX 4090: 165 TFLOP/s bf16 dense with fp32 accumulate, PCIe gen 4 x16, 24564 MiB",
    ),
}


def format_devices() -> str:
    """The `--device` presets as a markdown table."""
    lines = [
        "| device | sustained bf16 matmul TFLOP/s | host link GB/s per direction | usable memory GiB "
        "| memory TB/s | cuBLAS workspace MiB | source |",
        "|---|---|---|---|---|---|---|",
    ]
    for device in DEVICES.values():
        lines.append(
            f"| {device.name} | {device.tflops:g} | {device.link_gbps:g} | {device.memory_gib:g} "
            f"| {device.memory_tbps:g} | {device.cublas_workspace_bytes / MIB:g} | {device.source} |"
        )
    lines.append(
        f"Datasheet figures are derated to the H200's measured ratios: compute x{DATASHEET_COMPUTE_DERATING:g}, "
        f"host link x{DATASHEET_LINK_DERATING:g}, memory less {RESERVED_GIB:g} GiB."
    )
    return "\n".join(lines)


# The step time from a simulated step's counts at a device's rates, with three constants fitted to
# the ten step times measured on the H200 (2026-11-30; docs/estimate.md has the table, worst
# error 3.9%): matmuls run at the device's measured matmul rate; causal attention, half of the
# sequence square flop_counter counts, at 0.68 of it; the ops without FLOPs (casts, norms,
# activations, adds, copies) are memory-bound: the bytes they read and write, at 0.46 of the
# datasheet bandwidth (small kernels, each launched on its own).
MATMUL_EFFICIENCY = 1.00
ATTENTION_EFFICIENCY = 0.68
MEMORY_EFFICIENCY = 0.46


def compute_seconds(device: Device, matmul_flops: float, attention_flops: float, *, tflops: float | None = None,
                    efficiency: float | None = None) -> float:  # fmt: skip
    rate = (tflops or device.tflops) * 1e12 * (efficiency or MATMUL_EFFICIENCY)
    return matmul_flops / rate + 0.5 * attention_flops / (rate * ATTENTION_EFFICIENCY / MATMUL_EFFICIENCY)


def step_seconds(device: Device, matmul_flops: float, attention_flops: float, traffic_bytes: float, *,
                 tflops: float | None = None, efficiency: float | None = None) -> float:  # fmt: skip
    """Seconds of one step on `device`, offloading's copies not included (they overlap compute
    where they hide: `estimate` says per layer whether they do)."""
    memory = traffic_bytes / (device.memory_tbps * 1e12 * MEMORY_EFFICIENCY)
    return compute_seconds(device, matmul_flops, attention_flops, tflops=tflops, efficiency=efficiency) + memory
