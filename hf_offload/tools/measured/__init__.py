"""What was measured on GPUs: one JSON file per run, with its date, hardware, versions and commit.
The one home of every measured figure: the device presets, the simulator's tests, the time model's
fit and the plots read them from here, and the docs cite the file.

    python -m hf_offload.tools.measured        # the H200's figures as markdown tables
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

H200 = "h200-2026-11-30.json"
# The modes whose peaks and times the simulator predicts (the others' offloading is not hf_offload's).
SIMULATED_MODES = ("none", "hf_offload", "checkpointing", "checkpointing+hf_offload")
# Steps whose time the time model predicts: no offloading, whose copies it leaves out.
TIMED_MODES = ("none", "checkpointing")


@cache
def load(name: str = H200) -> dict:
    """A run's file, as JSON: "date", "hardware", "versions", "commit", "setup", "ceilings", "steps"."""
    path = Path(__file__).with_name(name)
    if not path.is_file():
        known = sorted(p.name for p in Path(__file__).parent.glob("*.json"))
        raise ValueError(f"no measurements named {name!r}; known: {', '.join(known)}")
    return json.loads(path.read_text())


def steps(name: str = H200, modes: tuple[str, ...] = SIMULATED_MODES) -> list[dict]:
    """The run's steps in the given modes: {"model", "lora_rank", "mode", "seq_len", "peak_gib",
    "step_ms", ...}."""
    return [step for step in load(name)["steps"] if step["mode"] in modes]


def peaks_gib(name: str = H200) -> dict[tuple, float]:
    """(model, LoRA rank or None, mode, tokens) -> measured peak GiB, for the simulated modes."""
    return {(s["model"], s["lora_rank"], s["mode"], s["seq_len"]): s["peak_gib"] for s in steps(name)}


def step_seconds(name: str = H200) -> dict[tuple, float]:
    """(model, LoRA rank or None, mode, tokens) -> measured step seconds, for the timed modes."""
    return {(s["model"], s["lora_rank"], s["mode"], s["seq_len"]): s["step_ms"] / 1e3 for s in steps(name, TIMED_MODES)}


def provenance(name: str = H200) -> str:
    """Where and with what a run measured: one NVIDIA H200 (143771 MiB), 2026-11-30, torch ..., commit."""
    run = load(name)
    hardware, versions = run["hardware"], run["versions"]
    software = ", ".join(f"{package} {version}" for package, version in versions.items())
    return f"one {hardware['gpu']} ({hardware['memory_mib']} MiB), {run['date']}, {software}, commit {run['commit']}"


def markdown(name: str = H200) -> str:
    run = load(name)
    lines = [f"Measured on {provenance(name)} ({name}). {run['setup']}.", ""]
    lines += ["| what | measured |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in run["ceilings"].items() if key != "what"]
    lines += ["", "| model | tuning | mode | tokens | peak GiB | step ms | offloaded MiB | command |", "|---|" * 8]
    lines[-1] = "|---|---|---|---|---|---|---|---|"
    for step in run["steps"]:
        tuning = "full" if step["lora_rank"] is None else f"LoRA r={step['lora_rank']}"
        offloaded = "-" if step["offloaded_mib"] is None else f"{step['offloaded_mib']:g}"
        lines.append(
            f"| {step['model']} | {tuning} | {step['mode']} | {step['seq_len']} | {step['peak_gib']:.2f} "
            f"| {step['step_ms']:g} | {offloaded} | `{step['command']}` |"
        )
    return "\n".join(lines)
