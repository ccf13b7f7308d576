"""The simulator's prediction beside every peak a GPU measures, so that each GPU run also records
how well `hf-offload estimate` predicts it.

`simulator_for(model, device)` simulates the model a benchmark measures: the same config,
dtype and LoRA adapters (rank, targets, dtype), and the measured device's cuBLAS workspace. The
bench and the GPU scripts then fill `Record.simulated_peak_bytes` with `annotate`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hf_offload.internal import unwrap_model
from hf_offload.tools.devices import DEVICES, HOPPER_CUBLAS_WORKSPACE, Device
from hf_offload.tools.modes import parse_mode
from hf_offload.tools.simulator import NOT_SIMULATED, Simulator, Training
from hf_offload.tools.simulator.four_bit import four_bit_of


def device_for(device: torch.device) -> Device:
    """The rates of the device preset closest to `device`, with its own cuBLAS workspace."""
    preset = DEVICES["h200"]
    if device.type != "cuda":
        return preset
    major, _minor = torch.cuda.get_device_capability(device)
    workspace = HOPPER_CUBLAS_WORKSPACE if major >= 9 else Device("", 0, 0, 0, 0, "").cublas_workspace_bytes
    return replace(preset, name=torch.cuda.get_device_name(device), cublas_workspace_bytes=workspace)


def training_of(model, *, device: torch.device, batch_size: int = 1, min_offload_bytes: int | None = None) -> Training:
    """The simulator's `Training` for the model a benchmark steps (forward and backward, no
    optimizer, as the bench measures)."""
    base = unwrap_model(model)
    options = {}
    peft_config = getattr(model, "peft_config", None)
    if peft_config:
        adapter = next(iter(peft_config.values()))
        targets = adapter.target_modules
        adapters = [p for name, p in model.named_parameters() if "lora_" in name]
        options = dict(
            lora_rank=adapter.r,
            lora_targets=targets if isinstance(targets, str) else tuple(sorted(targets)),
            lora_dtype=adapters[0].dtype if adapters else base.dtype,
        )
    if min_offload_bytes is not None:
        options["min_offload_bytes"] = min_offload_bytes
    if device.type == "cuda":  # what tiling's default slices are sized to, read as the product reads it
        options["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    dtype = base.dtype
    quantized = four_bit_of(base)
    if quantized is not None:  # a 4-bit base: its BitsAndBytesConfig, in the dtype it was loaded in
        options["four_bit"], dtype = quantized
    return Training(dtype=dtype, optimizer_states=0, batch_size=batch_size, device=device_for(device), **options)


def simulator_for(model, *, device: torch.device, batch_size: int = 1, min_offload_bytes: int | None = None):
    training = training_of(model, device=device, batch_size=batch_size, min_offload_bytes=min_offload_bytes)
    return Simulator(unwrap_model(model).config, training)


def simulatable(mode: str) -> bool:
    parsed = parse_mode(mode)
    return parsed.base not in NOT_SIMULATED and not parsed.budget


def annotate(records, simulator: Simulator) -> None:
    """Fill `simulated_peak_bytes` of every record that ran, in a mode the simulator runs (the
    budget modes read a real device's free memory at each step, which a simulation cannot)."""
    for record in records:
        if record is None or record.status != "ok" or not simulatable(record.mode):
            continue
        record.simulated_peak_bytes = simulator.run(record.mode, record.seq_len).peak_bytes


def fidelity(record) -> str:
    """"measured / simulated", as a ratio, or "-"."""
    if record.simulated_peak_bytes is None or record.peak_device_bytes is None:
        return "-"
    return f"{record.peak_device_bytes / record.simulated_peak_bytes:.3f}"
