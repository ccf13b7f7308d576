"""docs/trl.md's GRPO table: the longest completion one GPU trains with GRPO, generation in it, per
GPU, tuning and way of generating, simulated; and the setups of Unsloth's published GRPO figures.

    python -m hf_offload.tools.benchmarks.grpo_table [--cells table unsloth] [--devices ...]

Each cell is `hf-offload estimate --trainer grpo --modes checkpointing+hf_offload+tiled` for that
setup (the command is printed with it): Qwen3-8B's shape, LoRA r=16 (PEFT's fp32 adapters on a bf16
base) or QLoRA (nf4, double quantization, bf16 compute and adapters), batch 1, 8 generations after a
512-token prompt, AdamW; generation as TRL 1.16 runs it by default (transformers' generate), vLLM
colocated (TRL's 0.3 of the GPU) without and with sleep mode, and with sleep mode at the largest
vllm_gpu_memory_utilization with which vLLM's share and the trainer's weights and optimizer state fit
while it generates (Unsloth's setups with sleep mode too).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import time
import warnings

from hf_offload.tools import cli

MODE = "checkpointing+hf_offload+tiled"
QLORA = ["--load-in-4bit", "--bnb-4bit-quant-type", "nf4", "--bnb-4bit-use-double-quant", "--bnb-4bit-compute-dtype",
         "bf16", "--lora-dtype", "bf16"]  # fmt: skip
QLORA_VLLM_VERSION = "0.30"  # the newest TRL 1.16 accepts (0.31) answers "Unknown quantization method: bitsandbytes"
GENERATION = {
    "generate": [],
    "vllm": ["--use-vllm"],
    "vllm_sleep": ["--use-vllm", "--vllm-enable-sleep-mode"],
}


def command(preset: str, device: str, tuning: str, generation: list[str], extra: list[str] = ()) -> list[str]:
    args = ["estimate", "--preset", preset, "--lora-rank", "16", "--trainer", "grpo", "--device", device,
            "--modes", MODE, *generation, *extra]  # fmt: skip
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
                found = cell(command("qwen3-8b", device, tuning, generation))
                yield (device, tuning, name), found
            utilization = largest_utilization(found)
            args = [*command("qwen3-8b", device, tuning, GENERATION["vllm_sleep"]), "--vllm-gpu-memory-utilization",
                    f"{utilization:g}"]  # fmt: skip
            yield (device, tuning, f"vllm_sleep_{utilization:g}"), cell(args)


def unsloth_cells():
    """Our figure for the setup of each of Unsloth's (published_generation.json's "grpo" points)."""
    qwen = command("qwen3-8b", "h100-80gb", "qlora", GENERATION["vllm_sleep"])
    yield ("unsloth-110k", "qwen3-8b qlora, vllm sleep, batch 4", ""), [
        *qwen, "--batch-size", "4", "--num-generations", "4", "--generation-batch-size", "8"]
    llama = command("llama-3.1-8b", "h100-80gb", "qlora", GENERATION["vllm_sleep"], ["--num-generations", "2"])
    yield ("unsloth-standby", "llama-3.1-8b qlora, 2 generations, vllm sleep", ""), llama
    yield ("unsloth-standby", "llama-3.1-8b qlora, 2 generations, vllm, no sleep", ""), command(
        "llama-3.1-8b", "h100-80gb", "qlora", GENERATION["vllm"], ["--num-generations", "2"])
    for name, generation in (("generate", []), ("vllm", ["--use-vllm"])):
        yield ("unsloth-20k-blog", f"llama-3.1-8b lora, 8 generations, 20K context, {name}", ""), [
            "estimate", "--preset", "llama-3.1-8b", "--lora-rank", "16", "--trainer", "grpo", "--modes", MODE,
            "--prompt-length", "256", "--completion-length", str(20480 - 256), "--device", "h100-80gb", *generation]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", choices=("table", "unsloth"), default=["table", "unsloth"])
    parser.add_argument("--devices", nargs="+", default=["rtx4090", "h100-80gb", "h200"])
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if "table" in args.cells:
        for key, found in table_cells(args.devices):
            print(json.dumps({"cell": list(key), **found}), flush=True)
    if "unsloth" in args.cells:
        for key, cell_args in unsloth_cells():
            found = cell(cell_args)
            print(json.dumps({"cell": list(key), **found}), flush=True)
            if "--vllm-enable-sleep-mode" in cell_args:
                # As the table's last column: sleep mode at the largest share that fits.
                utilization = largest_utilization(found)
                best = [*cell_args, "--vllm-gpu-memory-utilization", f"{utilization:g}"]
                print(json.dumps({"cell": [*key[:2], f"vllm_sleep_{utilization:g}"], **cell(best)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
