"""What was measured on GPUs: one JSON file per run, with its date, hardware, versions and commit;
and what others measured and published (`published.json`: each figure with its source, setup and
whether it was re-read). The one home of every measured figure: the device presets, the
simulator's tests, the time model's fit and the plots read them from here, and the docs cite the
file.

    python -m hf_offload.tools.measured              # the H200's figures as markdown tables
    python -m hf_offload.tools.measured --published  # the published figures, with their sources
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

H200 = "h200-2026-11-30.json"
PUBLISHED = "published.json"
# What a published figure is (published.json's "figure_kinds" says each in words).
FIGURE_KINDS = ("step_seconds", "peak_gib", "peak_gb", "trained_tokens", "longest_tokens")
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


def published_points(name: str = PUBLISHED) -> list[dict]:
    """The published points: {"id", "source": {"title", "url", "version", "read", "note"}, "model",
    "preset" (a --preset shape, or None with "config": transformers config options of the model's
    shape), "gpus", "gpu", "device" (a --device preset or None), "seq_len", "setup": {...},
    "figures": [{"kind", "value", ...}]}, checked for what every reader relies on."""
    points = load(name)["points"]
    seen = set()
    for point in points:
        where = f"{name}: point {point.get('id')!r}"
        if point["id"] in seen:
            raise ValueError(f"{where} appears twice")
        seen.add(point["id"])
        source = point["source"]
        if not (source.get("title") and source.get("url") and isinstance(source.get("read"), bool)):
            raise ValueError(f"{where} needs a source with a title, a url and read: true or false")
        if not source["read"] and "not re-read" not in source.get("note", ""):
            raise ValueError(f"{where} was not read at its source: its note must say 'not re-read' and why")
        if point.get("preset") is None and not isinstance(point.get("config"), dict):
            raise ValueError(f"{where} needs a preset or a config (the model's shape)")
        for figure in point["figures"]:
            if figure["kind"] not in FIGURE_KINDS:
                raise ValueError(f"{where} has a figure of kind {figure['kind']!r}; known: {', '.join(FIGURE_KINDS)}")
    return points


def published_point(point_id: str, name: str = PUBLISHED) -> dict:
    points = {point["id"]: point for point in published_points(name)}
    if point_id not in points:
        raise ValueError(f"no published point {point_id!r}; known: {', '.join(points)}")
    return points[point_id]


def published_markdown(name: str = PUBLISHED) -> str:
    """Every published figure as a markdown table, one row a figure, with its source."""
    run = load(name)
    lines = [f"Published measurements ({name}), sources read on {run['checked']}. {run['how']}", ""]
    lines += ["| point | model | GPUs | tokens | figure | as published | source | re-read |", "|---|" * 8]
    lines[-1] = "|---|---|---|---|---|---|---|---|"
    for point in published_points(name):
        source = point["source"]
        tokens = "-" if point["seq_len"] is None else f"{point['seq_len']:,}"
        for figure in point["figures"]:
            value = figure.get("as_published") or f"{figure['value']:,}"
            if "memory_gb" in figure:
                value = f"{figure['memory_gb']} GB: {figure['value']:,} tokens"
            lines.append(
                f"| {point['id']} | {point['model']} | {point['gpus']} x {point['gpu']} | {tokens} | {figure['kind']} "
                f"| {value} | [{source['title']}]({source['url']}), {source['version']} | "
                f"{'yes' if source['read'] else 'no'} |"
            )
    return "\n".join(lines)
