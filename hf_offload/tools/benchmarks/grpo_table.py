"""docs/trl.md's GRPO table: the longest completion one GPU trains with GRPO, generation in it, per
GPU, tuning and way of generating, simulated; and the setups of Unsloth's published GRPO figures.

    python -m hf_offload.tools.benchmarks.grpo_table --out docs/img [--cells table unsloth] [--devices ...]

Each cell is `hf-offload estimate --trainer grpo --modes checkpointing+hf_offload+tiled` for that
setup (its command is kept with it): Qwen3-8B's shape with YaRN factor 4 over 32,768 positions
(131,072, as Qwen documents for long inputs; without it the model has 40,960), LoRA r=16 (PEFT's
fp32 adapters on a bf16 base) or QLoRA (nf4, double quantization, bf16 compute and adapters),
batch 1, 8 generations after a 512-token prompt, AdamW; generation as TRL 1.16 runs it by default
(transformers' generate), vLLM colocated (TRL's 0.3 of the GPU) without and with sleep mode, and
with sleep mode at the largest vllm_gpu_memory_utilization with which vLLM's share and the
trainer's weights and optimizer state fit while it generates (Unsloth's setups with sleep mode too).

Writes, under --out: grpo_table.jsonl (one cell a line, as simulated: the estimate's own answer,
the limit that set it, its command; a rerun keeps the cells already there with the same command)
and grpo_table.md (the tables docs/trl.md shows, rendered from the JSON lines alone).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import io
import json
import logging
import re
import time
import warnings
from pathlib import Path

from hf_offload.tools import cli
from hf_offload.tools.decode_time import grpo_points

MODE = "checkpointing+hf_offload+tiled"
QLORA = ["--load-in-4bit", "--bnb-4bit-quant-type", "nf4", "--bnb-4bit-use-double-quant", "--bnb-4bit-compute-dtype",
         "bf16", "--lora-dtype", "bf16"]  # fmt: skip
# Qwen's documented YaRN for Qwen3 past 32,768 tokens: factor 4 over the original 32,768 (131,072).
QWEN_YARN = ["--rope-scaling", "yarn:4:32768"]
QLORA_VLLM_VERSION = "0.30"  # the newest TRL 1.16 accepts (0.31) answers "Unknown quantization method: bitsandbytes"
GENERATION = {
    "generate": [],
    "vllm": ["--use-vllm"],
    "vllm_sleep": ["--use-vllm", "--vllm-enable-sleep-mode"],
}


def command(preset: str, device: str, tuning: str, generation: list[str], extra: list[str] = ()) -> list[str]:
    rope = QWEN_YARN if preset.startswith("qwen3") else []
    args = ["estimate", "--preset", preset, "--lora-rank", "16", "--trainer", "grpo", "--device", device,
            "--modes", MODE, *rope, *generation, *extra]  # fmt: skip
    if tuning == "qlora":
        args += QLORA
        if "--use-vllm" in generation:  # TRL's quantization="bitsandbytes": a vLLM release that still takes it
            args += ["--vllm-version", QLORA_VLLM_VERSION]
    return args


def estimate(args: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main([*args, "--json"]) == 0
    return json.loads(out.getvalue())


def largest_utilization(found: dict) -> float:
    """With sleep mode, the largest vllm_gpu_memory_utilization (two decimals) with which vLLM's share
    and the trainer's weights and optimizer state (and the library workspaces) fit the device while
    it generates, from a cell colocated at TRL's 0.3 (its share is 0.3 of the GPU's total)."""
    share, memory = found["vllm_share_bytes"], found["device_memory_bytes"]
    return int((memory - found["trainer_bytes"]) / (share / 0.3) * 100) / 100


def limit_name(entry: dict) -> str:
    """What set a cell's answer, in a few words, from the estimate's own JSON: the model's positions
    (with their rope scaling), vLLM's max_model_len, or memory (generation's KV cache, vLLM's, or
    the step's); the estimate's full reason stays in `limited_by`."""
    generation = entry["generation"]
    reason = generation["limited_by"] or ""
    answer, from_generation = entry["max_seq_len"], generation["max_seq_len_generation"]
    if answer is None:
        return "none fits: " + (reason or "the step")
    if from_generation is not None and answer < from_generation:
        return "memory: the step"
    if reason.startswith("the model's positions ("):
        source = reason[len("the model's positions ("):].split(")")[0]
        return ("rope scaling: " if " x " in source else "positions: ") + source
    if reason.startswith("vLLM's max_model_len"):
        what = reason.rsplit(": a row stops there", 1)[0]
        return "vllm max model len: " + what[len("vLLM's max_model_len") :].lstrip(", ")
    if reason.startswith("the generation batch's KV cache"):
        return "memory: generate's KV cache"
    if reason.startswith("one sequence in vLLM's KV cache"):
        needs = ""
        if "set vllm_max_model_length to " in reason:
            needs = "; needs vllm_max_model_length " + reason.split("set vllm_max_model_length to ")[1].split(" ")[0]
        return "memory: vLLM's KV cache (one sequence)" + needs
    return reason


def cell(args: list[str]) -> dict:
    started = time.perf_counter()
    result = estimate(args)
    entry = result["modes"][MODE]
    generation = entry["generation"]
    vllm = generation["vllm"]
    return {
        "vllm_share_bytes": None if vllm is None else vllm["share_bytes"],
        "device_memory_bytes": entry["max_seq"]["memory_bytes"] + generation["during_step_bytes"],
        "generation_peak_bytes": generation["peak_bytes"],
        "trainer_bytes": generation["trainer_resident_bytes"] + generation["workspace_bytes"],
        "command": "hf-offload " + " ".join(args),
        "max_seq_len": entry["max_seq_len"],
        "limited_by": generation["limited_by"],
        "limit": limit_name(entry),
        "max_seq_len_step": generation["max_seq_len_step"],
        "max_seq_len_generation": generation["max_seq_len_generation"],
        "vllm_releases": generation["vllm_releases"],
        "prompt_length": generation["prompt_length"],
        "during_step_gib": generation["during_step_bytes"] / 2**30,
        "generation_peak_gib": None if generation["peak_bytes"] is None else generation["peak_bytes"] / 2**30,
        "step_peak_gib": None if entry["max_seq"]["peak_bytes"] is None else entry["max_seq"]["peak_bytes"] / 2**30,
        "host_gib": None if entry["max_seq"]["host_bytes"] is None else entry["max_seq"]["host_bytes"] / 2**30,
        "cycle_seconds": None if generation["cycle"] is None else generation["cycle"]["seconds_range"],
        "generation_seconds": None if generation["cycle"] is None else generation["cycle"]["generation_seconds_range"],
        "training_seconds": None if generation["cycle"] is None else generation["cycle"]["training_seconds"],
        "simulated_seconds": time.perf_counter() - started,
    }


def table_cells(devices: list[str]):
    """Each (device, tuning): TRL's default generation, vLLM colocated without and with sleep mode,
    then sleep mode at the largest utilization that fits (found from the sleep cell)."""
    for device in devices:
        for tuning in ("lora", "qlora"):
            for name, generation in GENERATION.items():
                found = yield (device, tuning, name), command("qwen3-8b", device, tuning, generation)
            utilization = largest_utilization(found)
            args = [*command("qwen3-8b", device, tuning, GENERATION["vllm_sleep"]), "--vllm-gpu-memory-utilization",
                    f"{utilization:g}"]  # fmt: skip
            yield (device, tuning, "vllm_sleep_best"), args


def unsloth_cells():
    """Our figure for the setup of each of Unsloth's longest-context figures (published_generation.json's
    "grpo" points; their blog's 20K figure is a peak at a given length, which these longest-length cells
    do not answer); after each sleep-mode cell, sleep mode at the largest share that fits (as the
    table's last column)."""
    sleep = GENERATION["vllm_sleep"]
    setups = [
        (("unsloth-110k", "qwen3-8b qlora, vllm sleep, batch 4"),
         [*command("qwen3-8b", "h100-80gb", "qlora", sleep), "--batch-size", "4", "--num-generations", "4",
          "--generation-batch-size", "8"]),
        (("unsloth-standby", "llama-3.1-8b qlora, 2 generations, vllm sleep"),
         command("llama-3.1-8b", "h100-80gb", "qlora", sleep, ["--num-generations", "2"])),
        (("unsloth-standby", "llama-3.1-8b qlora, 2 generations, vllm, no sleep"),
         command("llama-3.1-8b", "h100-80gb", "qlora", GENERATION["vllm"], ["--num-generations", "2"])),
    ]  # fmt: skip
    for key, args in setups:
        found = yield key, args
        if "--vllm-enable-sleep-mode" in args:
            yield (key[0], key[1] + ", the largest share"), [
                *args, "--vllm-gpu-memory-utilization", f"{largest_utilization(found):g}"]


def run_cells(cells, done: dict[str, dict], write) -> None:
    """Simulate each cell the generator yields (a cell already in `done`, by its command, is
    kept), sending each answer back for the cells that depend on it."""
    found = None
    while True:
        try:
            key, args = cells.send(found)
        except StopIteration:
            return
        text = "hf-offload " + " ".join(args)
        found = done.get(text)
        if found is None:
            found = {"cell": list(key), **cell(args)}
            write(found)
        found["cell"] = list(key)


def versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in
            ("torch", "transformers", "peft", "trl", "bitsandbytes")}  # fmt: skip


DEVICE_NAMES = {"rtx4090": "RTX 4090 (24 GB)", "h100-80gb": "H100 80 GB", "h200": "H200 (141 GB)"}
COLUMNS = ("generate", "vllm", "vllm_sleep", "vllm_sleep_best")


def duration(seconds: float) -> str:
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def span(pair: list[float] | None) -> str:
    if pair is None:
        return "-"
    low, high = duration(pair[0]), duration(pair[1])
    if low == high:
        return low
    if low.split()[1] == high.split()[1]:
        return f"{low.split()[0]}-{high}"
    return f"{low}-{high}"


def short(limit: str) -> str:
    """A cell's limit as the table shows it: the figure that set it, without the estimate's reasoning
    (what to do about it stays in the cell's JSON)."""
    if limit.startswith("none fits: "):
        return "none: " + limit[len("none fits: ") :].split(" (sleep mode")[0].split("; ")[0]
    if limit.startswith(("vllm max model len:", "rope scaling:", "positions:")):
        tokens = re.findall(r"[0-9][0-9,]*", limit)[-1]
        scaled = " with " + limit.split(" x ")[1].split(" factor")[0] if " x " in limit else ""
        if limit.startswith("vllm max model len: derived"):
            return f"vLLM's max_model_len, derived from the positions{scaled}: {tokens}"
        if limit.startswith("vllm max model len"):
            return f"vllm_max_model_length {tokens}"
        return f"the model's positions{scaled}: {tokens}"
    return limit


def prompt_length(found: dict) -> int:
    """The cell's prompt: kept with it, or its command's --prompt-length, or the estimate's default (512)."""
    if found.get("prompt_length") is not None:
        return found["prompt_length"]
    words = found["command"].split()
    return int(words[words.index("--prompt-length") + 1]) if "--prompt-length" in words else 512


def shown(found: dict) -> str:
    """A cell as the table shows it: the completion, what set it, the GiB at generation's peak /
    at the step's peak (with what vLLM keeps beside the step: its whole share without sleep
    mode), and one generation batch's time."""
    words = found["command"].split()
    share = ""
    if "--vllm-gpu-memory-utilization" in words:
        share = " at " + words[words.index("--vllm-gpu-memory-utilization") + 1]
    if found["max_seq_len"] is None:
        return short(found["limit"]) + share
    gen = "-" if found["generation_peak_gib"] is None else f"{found['generation_peak_gib']:.1f}"
    step = "-" if found["step_peak_gib"] is None else f"{found['step_peak_gib']:.1f}"
    if found["vllm_share_bytes"] is not None and "--vllm-enable-sleep-mode" not in words:
        step += f" + {found['vllm_share_bytes'] / 2**30:.1f}"
    return (f"{found['max_seq_len']:,}{share} ({short(found['limit'])}; {gen} / {step} GiB; "
            f"{span(found['cycle_seconds'])})")  # fmt: skip


# Our cells' names -> the ids of Unsloth's points in published_generation.json.
UNSLOTH = {"unsloth-110k": "unsloth-qwen3-8b-grpo-qlora-110k",
           "unsloth-standby": "unsloth-llama-3.1-8b-grpo-qlora-standby"}  # fmt: skip


def beside_unsloth(found: dict) -> str:
    """Ours against each of Unsloth's figures for that setup: a context (prompt + completion) against
    their longest."""
    point = next(p for p in grpo_points() if p["id"] == UNSLOTH[found["cell"][0]])
    figures = point.get("figures") or [point["figure"]]
    if found["max_seq_len"] is None:
        return "-"
    context = found["max_seq_len"] + prompt_length(found)
    ratios = []
    for figure in figures:
        if figure["kind"] == "longest_tokens":
            ratios.append(f"{context:,} / {figure['value']:,}: {context / figure['value']:.2f}x")
    return "; ".join(ratios)


def render(lines: list[dict], meta: dict) -> str:
    """grpo_table.md from the JSON lines alone (cells of setups no longer in the table left out)."""
    lines = [row for row in lines if row["cell"][0] in DEVICE_NAMES or row["cell"][0] in UNSLOTH]
    out = [f"Simulated {meta['date']} by `python -m hf_offload.tools.benchmarks.grpo_table` with "
           + ", ".join(f"{name} {version}" for name, version in meta["versions"].items()) + "; vLLM modelled, not run. "
           "Each cell: the longest completion (tokens), what set it, the GiB at generation's peak / at the step's "
           "peak (+ vLLM's share where it stays beside the step), one generation batch's time; -: not simulated."]
    table = [row for row in lines if len(row["cell"]) == 3 and row["cell"][0] in DEVICE_NAMES]
    if table:
        out += ["", "| GPU | tuning | transformers' `generate` (TRL's default) | vLLM colocated (0.3, TRL's default) "
                "| vLLM colocated, sleep mode (0.3) | vLLM colocated, sleep mode, the largest "
                "`vllm_gpu_memory_utilization` that fits |", "|---|---|---|---|---|---|"]
        for device in DEVICE_NAMES:
            for tuning in ("lora", "qlora"):
                cells = {row["cell"][2]: row for row in table if row["cell"][:2] == [device, tuning]}
                if cells:
                    out.append(f"| {DEVICE_NAMES[device]} | {'LoRA' if tuning == 'lora' else 'QLoRA'} | "
                               + " | ".join(shown(cells[c]) if c in cells else "-" for c in COLUMNS) + " |")
    unsloth = [row for row in lines if row["cell"][0] in UNSLOTH]
    if unsloth:
        out += ["", "| Unsloth's figure | our setup | ours (simulated) | ours (prompt + completion) / theirs |",
                "|---|---|---|---|"]
        for row in unsloth:
            point = next(p for p in grpo_points() if p["id"] == UNSLOTH[row["cell"][0]])
            published = ", ".join(f["as_published"] for f in point.get("figures") or [point["figure"]])
            out.append(f"| {published} ({point['gpu']}) | {row['cell'][1]} | {shown(row)} | {beside_unsloth(row)} |")
    out += ["", "Each cell's command and the vLLM releases it assumes:", ""]
    ordered = sorted(lines, key=lambda row: (row["cell"][0] in UNSLOTH, lines.index(row)))
    for row in ordered:
        releases = f" ({row['vllm_releases']})" if row.get("vllm_releases") else ""
        out.append(f"- {' / '.join(row['cell'])}{releases}: `{row['command']}`")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", choices=("table", "unsloth"), default=["table", "unsloth"])
    parser.add_argument("--devices", nargs="+", default=list(DEVICE_NAMES))
    parser.add_argument("--out", default="grpo_table_out", help="where grpo_table.jsonl and .md go")
    parser.add_argument("--render", action="store_true", help="only render grpo_table.md from grpo_table.jsonl")
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data, meta_path = out / "grpo_table.jsonl", out / "grpo_table.meta.json"
    kept = [json.loads(line) for line in data.read_text().splitlines()] if data.exists() else []
    if not args.render:
        done = {row["command"]: row for row in kept}
        lines: list[dict] = []

        def write(found: dict) -> None:
            print(json.dumps(found), flush=True)
            with data.open("a") as stream:
                stream.write(json.dumps(found) + "\n")

        if "table" in args.cells:
            run_cells(table_cells(args.devices), done, write)
        if "unsloth" in args.cells:
            run_cells(unsloth_cells(), done, write)
        lines = [json.loads(line) for line in data.read_text().splitlines()]
        meta_path.write_text(json.dumps({"date": datetime.date.today().isoformat(), "versions": versions()}) + "\n")
        kept = lines
    meta = json.loads(meta_path.read_text())
    (out / "grpo_table.md").write_text(render(kept, meta))
    print(f"wrote {out / 'grpo_table.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
