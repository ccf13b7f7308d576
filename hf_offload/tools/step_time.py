"""A simulated step's seconds beyond the fitted time model's compute (`devices.TimeModel`): which
attention kernel runs, the sequence-parallel exchanges, and under ZeRO-3 offload the weights'
traffic over the host link and the optimizer's step on the host.

The time model was fitted to ten H200 steps of at most 32k tokens, whose attention ran as SDPA
dispatched it there (torch 2.11.0+cu130 on sm90: cuDNN's attention kernels where the runtime
cuDNN is newer than 9.15, else FlashAttention 2's; the run did not record which). Published step
times of 0.5M to 15M tokens on H100s (`measured/published.json`) say two things about it:

- cuDNN's kernels at a million tokens run at the fitted rate: TRL's Qwen3-8B step at 1M on 8 H100
  (373 s) is predicted within a few percent by the H200 fit alone (held out);
- FlashAttention 2's kernels on Hopper run slower, by the factor below, fitted to two published
  FlashAttention 2 steps and checked on the others (`python -m hf_offload.tools.benchmarks.published`).

Attention's efficiency by sequence length shows in none of them past 32k (the kernels' rate is
flat there); by head dimension, the fit's points have 64 and 128, the published ones 128 only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hf_offload.tools.devices import TIME_MODEL, Device, TimeModel

GB = 1e9

SDPA = "sdpa"
FLASH_ATTENTION_2 = "flash_attention_2"
# Attention seconds relative to what the time model's fit ran, on Hopper (compute capability 9.x).
# FlashAttention 2 has no Hopper-specific kernel (no wgmma, no TMA): fitted (1.695) to TRL's 606 s
# (SDPA's flash backend, Qwen3-8B, 1M tokens on 8 H100) and ALST's 16:50 (flash_attention_2,
# Llama-3.1-8B, 500K on one H100); held out, ALST's 3.7M, 1.1M and 15M steps come within 4%
# (docs/published.md). Elsewhere no published step separates the kernels: every kernel at the
# fitted rate (unmeasured).
HOPPER_ATTENTION_SLOWDOWN = {SDPA: 1.0, FLASH_ATTENTION_2: 1.70}
# Names of the attention a setup runs -> the kernel class timed. FlashAttention 3 and cuDNN's
# kernels run at about the same rate on Hopper (flash-attention's own benchmark, issue #1310 on
# an H20: head dimension 128, causal forward, 107.8 TFLOP/s each); not fitted here.
KERNELS = {
    "sdpa": SDPA,
    "sdpa_cudnn": SDPA,
    "flash_attention_3": SDPA,
    "sdpa_flash": FLASH_ATTENTION_2,
    "flash_attention_2": FLASH_ATTENTION_2,
}

# ZeRO-3's optimizer step on the host (DeepSpeed's CPU Adam) reads and writes each trainable
# parameter's float32 master weight and two AdamW states (24 bytes), reads its float32 gradient
# (4) and writes its bf16 weight (2): memory-bound. The host's memory bandwidth it gets is
# assumed, not measured: 50 to 200 GB/s, against 307 GB/s for one socket of an H100 server's
# Xeon 8468 (als244/ml_dataflow's README). It runs after the backward, with nothing to hide behind.
HOST_OPTIMIZER_BYTES_PER_PARAMETER = 30
HOST_MEMORY_GBPS = (50.0, 200.0)


def attention_slowdown(kernel: str, device: Device) -> float:
    """How much longer attention takes with `kernel` on `device` than in the time model's fit."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(KERNELS)}")
    if device.compute_capability[0] != 9:
        return 1.0
    return HOPPER_ATTENTION_SLOWDOWN[KERNELS[kernel]]


@dataclass(frozen=True)
class StepTime:
    """One step's seconds by part; `seconds` is the estimate, `low` and `high` its range under the
    assumptions above (the host's optimizer step at the fast and slow end of its bandwidth)."""

    compute: float  # the time model: matmuls, attention (at the kernel's rate), memory-bound ops
    attention: float  # of which attention
    slowdown: float  # the kernel's attention seconds over the fit's (attention_slowdown)
    exchange: float  # Ulysses's all-to-alls (each stands between projections and attention)
    weights: float  # ZeRO-3's gathers over the host link (prefetched: only what compute does not hide)
    host_optimizer: tuple[float, float]  # the optimizer's step on the host, fast and slow end
    kernel: str

    @property
    def exposed_weights(self) -> float:
        """Each unit's gather overlaps the unit before's compute; what is left over shows."""
        return max(self.weights - self.compute, 0.0)

    @property
    def low(self) -> float:
        return self.compute + self.exchange + self.exposed_weights + self.host_optimizer[0]

    @property
    def high(self) -> float:
        return self.compute + self.exchange + self.exposed_weights + self.host_optimizer[1]

    @property
    def seconds(self) -> float:
        return (self.low + self.high) / 2


def step_time(device: Device, compute: Mapping, traffic_bytes: float, *, kernel: str = SDPA,
              sp_sent_bytes: int = 0, params_gathered_bytes: int = 0, host_trainable_parameters: int = 0,
              link_gbps: float | None = None, tflops: float | None = None, efficiency: float | None = None,
              model: TimeModel = TIME_MODEL) -> StepTime:  # fmt: skip
    """A step's time from its simulated counts: `compute` and `traffic_bytes` as the time model
    takes them, what Ulysses sent, and with ZeRO-3 offload the weights gathered from the host and
    the trainable parameters the host's optimizer steps (0 without offload)."""
    matmul, attention, memory = model.parts(device, compute, traffic_bytes, tflops=tflops)
    scale = 1.0 if efficiency is None else model.matmul / efficiency
    slowdown = attention_slowdown(kernel, device)
    attention = scale * attention * slowdown / model.attention
    seconds = scale * matmul / model.matmul + attention + memory / model.memory
    link = (link_gbps or device.link_gbps) * GB
    optimizer_bytes = host_trainable_parameters * HOST_OPTIMIZER_BYTES_PER_PARAMETER
    return StepTime(
        compute=seconds,
        attention=attention,
        slowdown=slowdown,
        exchange=sp_sent_bytes / (device.peer_gbps * GB),
        weights=params_gathered_bytes / link,
        host_optimizer=tuple(optimizer_bytes / (rate * GB) for rate in reversed(HOST_MEMORY_GBPS)),
        kernel=kernel,
    )
