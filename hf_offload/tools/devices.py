"""What the tools need of an accelerator that simulation cannot give: its rates, its usable memory,
which attention kernel it runs, and the workspaces its libraries allocate through PyTorch's
caching allocator; and the time model that turns a simulated step's counts into seconds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_offload.tools import measured

if TYPE_CHECKING:
    import torch

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
    # Sustained float32 matmul TFLOP/s without TF32 (PyTorch's default for matmuls): PEFT's
    # float32 adapters run there.
    fp32_tflops: float = 0.0
    compute_capability: tuple[int, int] = (9, 0)  # what SDPA's kernel choice depends on
    # GPU to GPU within a node (NVLink), GB/s per direction: what sequence parallelism's all-to-alls
    # run at; 0: none, they go through the host link.
    peer_link_gbps: float = 0.0
    # The machine it usually comes in: its host memory per GPU (GiB), how many GPUs it has, and
    # where the figure comes from (a vendor's system specification, or an assumption).
    host_memory_gib: float = 64.0
    gpus_per_node: int = 1
    host_source: str = "assumed: a workstation with 64 GiB"

    @property
    def node_host_memory_gib(self) -> float:
        return self.host_memory_gib * self.gpus_per_node

    @property
    def peer_gbps(self) -> float:
        return self.peer_link_gbps or self.link_gbps

    @property
    def workspace_bytes(self) -> int:
        """Library workspaces live through a training step: one cuBLAS workspace for each thread
        that runs matmuls, the forward's and the autograd engine's device thread. It is what every
        simulated H200 peak was short of the measured one (0.06-0.07 GiB), not measured alone."""
        return 2 * self.cublas_workspace_bytes

    def matmul_tflops(self, dtype: torch.dtype, tflops: float | None = None) -> float:
        """The sustained rate of a matmul in `dtype` (`tflops` overrides the half-precision one,
        and scales the float32 one with it)."""
        import torch  # here: `hf-offload estimate` reads the presets before it needs torch

        scale = 1.0 if tflops is None else tflops / self.tflops
        if dtype in (torch.float32, torch.float64):
            return (self.fp32_tflops or self.tflops / 16) * scale
        return self.tflops * scale


# Vendor datasheet figures are derated to what a sustained workload gets, using the ratios our
# H200 showed (hf_offload/tools/measured/): 789 of 989 dense bf16 TFLOP/s on an 8192^3 matmul
# (0.80), 55 of 64 GB/s per direction on PCIe gen 5 x16 (0.86), and 139 of 140.4 GiB usable
# (about 1.4 GiB to the CUDA context and allocator). Float32 rates are the datasheets' non-tensor
# figures, derated the same way (not measured).
DATASHEET_COMPUTE_DERATING = 0.80
DATASHEET_LINK_DERATING = 0.86
RESERVED_GIB = 1.4
HOPPER_CUBLAS_WORKSPACE = 32 * MIB
# NVLink per GPU and direction (SXM parts, datasheet: 900 and 600 GB/s both ways together), derated
# as the host link is (not measured: our H200 is alone): sequence parallelism's all-to-alls.
NVLINK4_GBPS = round(450 * DATASHEET_LINK_DERATING, 1)
NVLINK3_GBPS = round(300 * DATASHEET_LINK_DERATING, 1)

# The host memory of the machines the GPUs come in, per GPU (what one rank's process may take of
# it: hf_offload's pool and, under ZeRO-3 offload, its share of the weights and optimizer).
DGX_H100 = dict(host_memory_gib=2048 / 8, gpus_per_node=8,
                host_source="NVIDIA DGX H100 datasheet: 2 TB system memory for 8 GPUs")
DGX_H200 = dict(host_memory_gib=2048 / 8, gpus_per_node=8,
                host_source="NVIDIA DGX H200 datasheet: 2 TB system memory for 8 GPUs")
DGX_A100_640 = dict(host_memory_gib=2048 / 8, gpus_per_node=8,
                    host_source="NVIDIA DGX A100 640GB datasheet: 2 TB system memory for 8 GPUs")
DGX_A100_320 = dict(host_memory_gib=1024 / 8, gpus_per_node=8,
                    host_source="NVIDIA DGX A100 320GB datasheet: 1 TB system memory for 8 GPUs")
SERVER_8_GPUS = dict(host_memory_gib=1024 / 8, gpus_per_node=8,
                     host_source="assumed: an 8-GPU PCIe server with 1 TiB")
WORKSTATION_64 = dict(host_memory_gib=64, gpus_per_node=1, host_source="assumed: a workstation with 64 GiB "
                      "(the low end of the 64-128 GiB such a card is usually built with)")
DESKTOP_32 = dict(host_memory_gib=32, gpus_per_node=1, host_source="assumed: a desktop with 32 GiB")
GCP_G2_96 = dict(host_memory_gib=384 / 8, gpus_per_node=8,
                 host_source="Google Cloud g2-standard-96: 8 L4 GPUs, 384 GB memory")
AWS_G5_48 = dict(host_memory_gib=768 / 8, gpus_per_node=8,
                 host_source="AWS g5.48xlarge: 8 A10G GPUs, 768 GiB memory")


def _from_datasheet(name: str, tflops: float, fp32_tflops: float, link_gbps: float, memory_mib: int,
                    memory_tbps: float, capability: tuple[int, int], what: str, **extra) -> Device:  # fmt: skip
    """A device preset from vendor figures, derated as above."""
    return Device(
        name,
        round(tflops * DATASHEET_COMPUTE_DERATING),
        round(link_gbps * DATASHEET_LINK_DERATING, 1),
        round(memory_mib / 1024 - RESERVED_GIB, 1),
        memory_tbps,
        f"datasheet ({what}), derated",
        fp32_tflops=round(fp32_tflops * DATASHEET_COMPUTE_DERATING, 1),
        compute_capability=capability,
        **extra,
    )


def _h200() -> Device:
    run = measured.load(measured.H200)
    ceilings = run["ceilings"]
    link = min(ceilings["device_to_pinned_host_gbps"], ceilings["pinned_host_to_device_gbps"])
    return Device(
        "h200",
        float(ceilings["bf16_matmul_tflops"]),
        float(round(link)),
        round(run["hardware"]["memory_mib"] / 1024 - RESERVED_GIB, 1),
        4.8,
        f"measured on our H200 ({measured.H200}: bf16 8192^3 matmul, pinned copies each way, "
        f"{run['hardware']['memory_mib']} MiB total); memory bandwidth and float32 rate from the datasheet",
        cublas_workspace_bytes=HOPPER_CUBLAS_WORKSPACE,
        fp32_tflops=round(67 * DATASHEET_COMPUTE_DERATING, 1),
        compute_capability=(9, 0),
        peer_link_gbps=NVLINK4_GBPS,
        **DGX_H200,
    )


DEVICES = {
    "h200": _h200(),
    "h100-80gb": _from_datasheet(
        "h100-80gb", 989.4, 66.9, 64, 81559, 3.35, (9, 0),
        "H100 SXM 80GB: 989 TFLOP/s bf16 dense, 67 float32, PCIe gen 5 x16, 81559 MiB, NVLink 4",
        cublas_workspace_bytes=HOPPER_CUBLAS_WORKSPACE, peer_link_gbps=NVLINK4_GBPS, **DGX_H100,
    ),
    "a100-80gb": _from_datasheet(
        "a100-80gb", 312, 19.5, 32, 81920, 2.04, (8, 0),
        "A100 80GB: 312 TFLOP/s bf16 dense, 19.5 float32, PCIe gen 4 x16, 81920 MiB, NVLink 3",
        peer_link_gbps=NVLINK3_GBPS, **DGX_A100_640,
    ),
    "a100-40gb": _from_datasheet(
        "a100-40gb", 312, 19.5, 32, 40960, 1.56, (8, 0),
        "A100 40GB: 312 TFLOP/s bf16 dense, 19.5 float32, PCIe gen 4 x16, 40960 MiB, NVLink 3",
        peer_link_gbps=NVLINK3_GBPS, **DGX_A100_320,
    ),
    "l40s": _from_datasheet(
        "l40s", 362, 91.6, 32, 46068, 0.864, (8, 9),
        "L40S: 362 TFLOP/s bf16 dense, 91.6 float32, PCIe gen 4 x16, 46068 MiB", **SERVER_8_GPUS,
    ),
    "rtx4090": _from_datasheet(
        "rtx4090", 165.2, 82.6, 32, 24564, 1.008, (8, 9),
        "RTX 4090: 165 TFLOP/s bf16 dense with fp32 accumulate, 82.6 float32, PCIe gen 4 x16, 24564 MiB",
        **WORKSTATION_64,
    ),
    # The GPUs of Unsloth's context-length table (8-80 GB) that people own or rent. GeForce cards
    # multiply bf16 with fp32 accumulate at half their fp16-accumulate tensor rate (NVIDIA's Ampere,
    # Ada and Blackwell GeForce whitepapers), which is what PyTorch's bf16 matmuls run; memory is
    # nvidia-smi's total for the card where it is commonly reported, else the nominal size.
    "rtx4060": _from_datasheet(
        "rtx4060", 30.2, 15.1, 16, 8188, 0.272, (8, 9),
        "RTX 4060 8GB: 30.2 TFLOP/s bf16 dense with fp32 accumulate, 15.1 float32, PCIe gen 4 x8, 8188 MiB",
        **DESKTOP_32,
    ),
    "rtx3060": _from_datasheet(
        "rtx3060", 25.5, 12.7, 32, 12288, 0.360, (8, 6),
        "RTX 3060 12GB: 25.5 TFLOP/s bf16 dense with fp32 accumulate, 12.7 float32, PCIe gen 4 x16, 12288 MiB",
        **DESKTOP_32,
    ),
    "rtx4060ti-16gb": _from_datasheet(
        "rtx4060ti-16gb", 44.1, 22.1, 16, 16380, 0.288, (8, 9),
        "RTX 4060 Ti 16GB: 44.1 TFLOP/s bf16 dense with fp32 accumulate, 22.1 float32, PCIe gen 4 x8, 16380 MiB",
        **DESKTOP_32,
    ),
    "rtx5090": _from_datasheet(
        "rtx5090", 209.5, 104.8, 64, 32607, 1.792, (12, 0),
        "RTX 5090: 209.5 TFLOP/s bf16 dense with fp32 accumulate, 104.8 float32, PCIe gen 5 x16, 32607 MiB",
        cublas_workspace_bytes=HOPPER_CUBLAS_WORKSPACE,  # PyTorch's default from compute capability 9 up
        **WORKSTATION_64,
    ),
    "l4": _from_datasheet(
        "l4", 121, 30.3, 32, 23034, 0.300, (8, 9),
        "L4: 121 TFLOP/s bf16 dense (242 with sparsity), 30.3 float32, PCIe gen 4 x16, 23034 MiB", **GCP_G2_96,
    ),
    "a10g": _from_datasheet(
        "a10g", 70, 35, 32, 23028, 0.600, (8, 6),
        "A10G, AWS's variant of the A10 (no NVIDIA datasheet; AWS's and Baseten's published figures): 70 "
        "TFLOP/s bf16 dense, 35 float32, PCIe gen 4 x16, 23028 MiB", **AWS_G5_48,
    ),
    "a6000": _from_datasheet(
        "a6000", 154.8, 38.7, 32, 49140, 0.768, (8, 6),
        "RTX A6000: 154.8 TFLOP/s bf16 dense (309.7 with sparsity), 38.7 float32, PCIe gen 4 x16, 49140 MiB",
        **WORKSTATION_64,
    ),
}  # fmt: skip


def format_devices() -> str:
    """The `--device` presets as a markdown table."""
    lines = [
        "| device | sustained bf16 matmul TFLOP/s | float32 TFLOP/s | host link GB/s per direction "
        "| usable memory GiB | memory TB/s | compute capability | cuBLAS workspace MiB "
        "| host GiB per GPU (GPUs) | source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for device in DEVICES.values():
        capability = ".".join(map(str, device.compute_capability))
        lines.append(
            f"| {device.name} | {device.tflops:g} | {device.fp32_tflops:g} | {device.link_gbps:g} "
            f"| {device.memory_gib:g} | {device.memory_tbps:g} | {capability} "
            f"| {device.cublas_workspace_bytes / MIB:g} | {device.host_memory_gib:g} ({device.gpus_per_node}) "
            f"| {device.source}; host: {device.host_source} |"
        )
    lines.append(
        f"Datasheet figures are derated to the H200's measured ratios: compute x{DATASHEET_COMPUTE_DERATING:g}, "
        f"host link x{DATASHEET_LINK_DERATING:g}, memory less {RESERVED_GIB:g} GiB."
    )
    return "\n".join(lines)


# -- the time model ---------------------------------------------------------------------------------

MATMUL, ATTENTION = "matmul", "attention"


@dataclass(frozen=True)
class TimeModel:
    """A step's seconds from its simulated counts: matmul FLOPs at `matmul` of the device's rate
    for their dtype (bf16/fp16 or float32); attention FLOPs, counted as the kernel computes them
    (a causal kernel half the square, one given a mask all of it), at `attention` of that rate;
    the bytes the FLOP-less ops (casts, norms, activations, adds, copies) read and write at
    `memory` of the memory bandwidth (small kernels, each launched on its own). Offloading's
    copies are not in it: where they hide, the step takes this long."""

    matmul: float
    attention: float
    memory: float

    def parts(self, device: Device, compute: Mapping, traffic_bytes: float, *,
              tflops: float | None = None) -> tuple[float, float, float]:  # fmt: skip
        """Seconds of matmuls, attention and memory-bound ops at efficiency 1 (the fit's basis)."""
        matmul = attention = 0.0
        for (kind, dtype), flops in compute.items():
            seconds = flops / (device.matmul_tflops(dtype, tflops) * 1e12)
            if kind == ATTENTION:
                attention += seconds
            else:
                matmul += seconds
        return matmul, attention, traffic_bytes / (device.memory_tbps * 1e12)

    def compute_seconds(self, device: Device, compute: Mapping, *, tflops: float | None = None,
                        efficiency: float | None = None) -> float:  # fmt: skip
        matmul, attention, _memory = self.parts(device, compute, 0, tflops=tflops)
        scale = 1.0 if efficiency is None else self.matmul / efficiency
        return scale * (matmul / self.matmul + attention / self.attention)

    def seconds(self, device: Device, compute: Mapping, traffic_bytes: float, *, tflops: float | None = None,
                efficiency: float | None = None) -> float:  # fmt: skip
        """Seconds of one step on `device`, offloading's copies not included (they overlap compute
        where they hide: `estimate` says per layer whether they do). `efficiency` overrides the
        matmuls' (and attention's in proportion)."""
        _matmul, _attention, memory = self.parts(device, compute, traffic_bytes, tflops=tflops)
        return self.compute_seconds(device, compute, tflops=tflops, efficiency=efficiency) + memory / self.memory


def fit_time_model(points: Iterable[tuple[tuple[float, float, float], float]]) -> TimeModel:
    """The efficiencies that best predict measured step times: `points` are (parts, seconds),
    `parts` what `TimeModel.parts` gives for a step. Least squares of the relative errors, linear
    in the three inverse efficiencies."""
    import torch

    rows = torch.tensor([[part / seconds for part in parts] for parts, seconds in points], dtype=torch.float64)
    used = [column for column in range(rows.shape[1]) if rows[:, column].any()]  # a part none has: efficiency 1
    solution = torch.linalg.lstsq(rows[:, used], torch.ones((rows.shape[0], 1), dtype=torch.float64))
    inverse = [1.0] * rows.shape[1]
    for column, value in zip(used, solution.solution.flatten().tolist(), strict=True):
        inverse[column] = value
    if any(value <= 0 for value in inverse):
        raise ValueError(f"the measured times give a non-positive inverse efficiency: {inverse}")
    return TimeModel(*(1 / value for value in inverse))


# Fitted to the ten step times measured on the H200 (hf_offload/tools/measured/;
# `python -m hf_offload.tools.benchmarks.time_model` fits it and predicts each point from a fit to
# the other nine: worst error 7.1%; docs/estimate.md has the table).
TIME_MODEL = TimeModel(matmul=1.02, attention=0.68, memory=0.47)
MATMUL_EFFICIENCY = TIME_MODEL.matmul
ATTENTION_EFFICIENCY = TIME_MODEL.attention
MEMORY_EFFICIENCY = TIME_MODEL.memory


def compute_seconds(device: Device, compute: Mapping, *, tflops: float | None = None,
                    efficiency: float | None = None) -> float:  # fmt: skip
    return TIME_MODEL.compute_seconds(device, compute, tflops=tflops, efficiency=efficiency)


def step_seconds(device: Device, compute: Mapping, traffic_bytes: float, *, tflops: float | None = None,
                 efficiency: float | None = None) -> float:  # fmt: skip
    return TIME_MODEL.seconds(device, compute, traffic_bytes, tflops=tflops, efficiency=efficiency)
