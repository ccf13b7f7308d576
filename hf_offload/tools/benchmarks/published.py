"""Every published measurement (`hf_offload/tools/measured/published.json`) beside what the
simulator says for the nearest setup our stack runs, the ratio, and what differs.

    python -m hf_offload.tools.benchmarks.published                    # every point (minutes: long steps)
    python -m hf_offload.tools.benchmarks.published --points alst-1xh100-500k arctic-h100-32k-baseline
    python -m hf_offload.tools.benchmarks.published --quick            # one short point: a smoke test

Their setups on our simulator: full fine-tuning with AdamW; ZeRO-3's weights and optimizer on the
host (`Training.offload_params`); checkpoint offload as hf_offload's offloaded checkpointing with
every layer's input offloaded (ALST's and transformers' offload keep none on the device); ALST's
tiled MLP as sequence tiling of the MLP alone; Liger's kernels (ALST's model type
`liger`: its fused loss and RMSNorm everywhere) as tiling's loss with the final norm and tiled
norms (none keeps the logits or a whole-sequence float32 copy); Ulysses as `--sp`;
SDPA's flash kernel for every attention (memory), timed at the kernel's own rate
(`step_time.HOPPER_ATTENTION_SLOWDOWN`). Ring context parallelism and FSDP2 are not simulated: their
memory is not compared, their step time is timed as Ulysses over as many GPUs (each rank computes
the same share of the causal attention either way). Points whose setup our stack cannot run, or
their sources do not state, are listed with the reason instead of a number.

The step times also fit the one constant the H200's fit cannot give, FlashAttention 2's rate on
Hopper (`FIT`), and predict the others from it (held out): printed after the table.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from dataclasses import dataclass, field
from functools import cache

import torch

from hf_offload.tools import measured
from hf_offload.tools.devices import DEVICES, Device
from hf_offload.tools.presets import preset_config
from hf_offload.tools.simulator import Simulator, StepResult, Training
from hf_offload.tools.step_time import FLASH_ATTENTION_2, KERNELS, StepTime, step_time

GIB = 2**30
# The FlashAttention 2 steps the kernel's rate is fitted to; every other step time is held out.
FIT = ("trl-8xh100-qwen3-8b-1m-flash", "alst-1xh100-500k")
QUICK = ("arctic-h100-32k-baseline",)
# The H200's pageable copy rates (measured/h200-2026-11-30.json): ALST's checkpoint offload copies
# each layer's input with a synchronous `.to("cpu")` and back with `.to(device)`, on the compute stream.
PAGEABLE_GBPS = (16.4, 9.1)
NOT_SIMULATED_KINDS = {
    "longest_tokens": "a 4-bit (QLoRA) base: simulated by issue 29's `estimate --load-in-4bit`, beside this "
    "table in docs/qlora.md, not here",
}


@dataclass
class Nearest:
    """The setup our simulator runs for a published point."""

    preset: str
    mode: str
    training: Training
    kernel: str
    differs: list[str] = field(default_factory=list)  # what the simulation does not do as they did
    memory: bool = True  # whether our peak stands for theirs
    synchronous_copies: bool = False  # ALST's checkpoint offload: copies on the compute stream


def nearest(point: dict) -> Nearest | str:
    """Our stack's setup for `point`, or why there is none."""
    setup = point["setup"]
    if "4-bit" in setup.get("tuning", ""):
        return "a 4-bit (QLoRA) base: issue 29's simulator (docs/qlora.md)"
    parallel = setup.get("sequence_parallel") or {}
    kind = parallel.get("kind")
    if kind not in (None, "ulysses", "ring"):
        return f"its sequence parallelism ({kind}) has no counterpart here; the rest of its memory setup was not read"
    if point.get("device") is None or point["device"] not in DEVICES:
        return f"the GPU ({point['gpu']}) is not one of ours or not stated"
    if setup.get("checkpointing") is not True:
        return f"its recomputation ({setup.get('checkpointing')}) is not stated"
    attention = setup.get("attention")
    if attention not in KERNELS and attention != "not stated":
        return f"its attention kernel ({attention}) is not stated precisely enough to time"
    differs = []
    kernel = attention
    if attention == "not stated":
        kernel = "sdpa"
        differs.append("attention kernel not stated: timed as cuDNN's (the source's 1M figure is the cuDNN run's)")
    liger, tiled_mlp, offload = setup.get("liger", False), setup.get("tiled_mlp", False), setup["checkpoint_offload"]
    tiling = None
    mode = "checkpointing" + ("+hf_offload" if offload else "")
    if liger:
        # Liger's kernels replace every RMSNorm, the final one included, and the loss: tiling's loss
        # with the final norm, and the layers' norms tiled, keep no whole-sequence float32 copy either.
        differs.append(
            "Liger's fused loss and RMSNorm kernels stood in for by tiling's loss with the final norm and tiled norms "
            "(none keeps the logits or a whole-sequence float32 copy); Liger's RoPE kernel not simulated"
        )
        if not tiled_mlp:
            differs.append("Liger's SwiGLU kernel not simulated (transformers' MLP)")
    if liger or tiled_mlp:
        tiling = dict(mlp=tiled_mlp, norms=liger, projections=False, attention=False, loss=liger)
    if setup.get("loss") == "TRL's chunked NLL":
        tiling = dict(mlp=False, norms=False, projections=False, attention=False, loss=True)
        differs.append("TRL's chunked NLL loss as tiling's loss (both recompute each chunk's logits)")
    if tiling is not None:
        mode += "+tiled"
    if attention in ("flash_attention_2", "flash_attention_3"):
        differs.append(f"{attention}'s kernel: SDPA's flash kernel simulated (the same float32 backward buffers)")
    memory = True
    if setup.get("fsdp2") or kind == "ring":
        memory = False
        differs.append(
            f"FSDP2 and ring attention over {parallel['size']} GPUs not simulated: memory not compared; timed as "
            f"Ulysses over {parallel['size']} (the same share of the causal attention per GPU; ring's passes overlap "
            "compute, Ulysses's all-to-alls are added)"
        )
        differs.append("the optimizer steps on the GPUs, sharded by FSDP2 (simulated unsharded: its time is ~0.1 s)")
    offload_params = bool(setup.get("zero3_offload_optimizer"))
    if offload_params and not setup.get("zero3_offload_param"):
        world = point["gpus"]
        differs.append(
            f"ZeRO-3 keeps the weights partitioned on the {world} GPUs (1/{world} of the bf16 weights each) and "
            "gathers them over NVLink: simulated on the host, gathered over PCIe"
        )
    if offload_params:
        differs.append("DeepSpeed's CPU Adam on the host: its time assumed (step_time.HOST_MEMORY_GBPS)")
    if offload:
        differs.append("every layer's checkpoint input offloaded, as theirs (keep_last_layers=0)")
    synchronous = offload and setup.get("optimizer", "").startswith("DeepSpeed")
    if synchronous:
        differs.append("ALST's checkpoint copies run synchronously to pageable memory: their time added")
    if kind == "ulysses" and parallel["size"] > 8:
        differs.append(f"all-to-alls across {parallel['size'] // 8} nodes timed at NVLink's rate")
    training = Training(
        dtype=torch.bfloat16,
        optimizer_states=2,
        offload_params=offload_params,
        sp_size=parallel.get("size", 1),
        device=DEVICES[point["device"]],
        keep_last_layers=0 if offload else 1,
        tiling=tiling,
    )
    return Nearest(point["preset"], mode, training, kernel, differs, memory, synchronous)


@dataclass
class Row:
    point: str
    kind: str
    published: str
    ours: str = "-"
    ratio: float | None = None
    differs: str = ""
    check: str = ""  # "fit", "held out" for step times
    timed: tuple[float, float, float] | None = None  # (seconds besides attention, attention at 1x, measured)


_SIMULATORS: dict[tuple, Simulator] = {}
_STEPS: dict[tuple, StepResult] = {}  # points that share a setup (TRL's two kernels) share its step


def simulate(plan: Nearest, seq_len: int) -> StepResult:
    key = (plan.preset, plan.training)
    if (*key, plan.mode, seq_len) in _STEPS:
        return _STEPS[(*key, plan.mode, seq_len)]
    if key not in _SIMULATORS:
        _SIMULATORS.clear()  # one 8B model at a time: the points rarely share one
        _SIMULATORS[key] = Simulator(preset_config(plan.preset), plan.training)
    step = _STEPS[(*key, plan.mode, seq_len)] = _SIMULATORS[key].run(plan.mode, seq_len)
    return step


@cache
def parameters(preset: str) -> int:
    """What the host's optimizer steps in full fine-tuning: every parameter."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(preset_config(preset)).parameters())


def timing(step: StepResult, plan: Nearest) -> StepTime:
    trainable = parameters(plan.preset) if plan.training.offload_params else 0
    return step_time(
        plan.training.device,
        step.compute,
        step.traffic_bytes,
        kernel=plan.kernel,
        sp_sent_bytes=step.sp_sent_bytes,
        params_gathered_bytes=step.params_gathered_bytes,
        host_trainable_parameters=trainable,
    )


def synchronous_copy_seconds(step: StepResult, plan: Nearest) -> float:
    """ALST's checkpoint offload: each layer's input to pageable host memory and back, on the
    compute stream (one rank's tokens, in bf16)."""
    if not plan.synchronous_copies:
        return 0.0
    config = preset_config(plan.preset)
    layer_bytes = step.rank_seq_len * config.hidden_size * 2
    out, back = PAGEABLE_GBPS
    return config.num_hidden_layers * layer_bytes * (1 / (out * 1e9) + 1 / (back * 1e9))


def rows_for(point: dict, plan: Nearest | str | None = None) -> list[Row]:
    """One row per published figure of `point`, with our figure where the simulator has one
    (`plan`: the setup to simulate, by default `nearest(point)`)."""
    plan = nearest(point) if plan is None else plan
    rows = []
    step = None
    for figure in point["figures"]:
        published = figure.get("as_published") or f"{figure['value']:,}"
        if "memory_gb" in figure:
            published = f"{figure['value']:,} tokens in {figure['memory_gb']} GB"
        row = Row(point["id"], figure["kind"], published)
        rows.append(row)
        if figure["kind"] in NOT_SIMULATED_KINDS:
            row.differs = NOT_SIMULATED_KINDS[figure["kind"]]
            continue
        if isinstance(plan, str):
            row.differs = f"not simulated: {plan}"
            continue
        row.differs = "; ".join(plan.differs)
        if figure["kind"] in ("peak_gib", "peak_gb") and not plan.memory:
            continue
        if step is None:
            step = simulate(plan, point["seq_len"])
        device: Device = plan.training.device
        if figure["kind"] == "peak_gib":
            row.ours = f"{step.peak_bytes / GIB:.2f} GiB allocated"
            row.ratio = step.peak_bytes / GIB / figure["value"]
            row.differs = f"theirs: {figure['memory']}; " + row.differs
        elif figure["kind"] == "trained_tokens":
            row.ours = f"peak {step.peak_bytes / GIB:.2f} of {device.memory_gib:g} GiB"
            row.ratio = step.peak_bytes / GIB / device.memory_gib
        elif figure["kind"] == "step_seconds":
            timed = timing(step, plan)
            seconds = timed.seconds + synchronous_copy_seconds(step, plan)
            # The step as a line in the kernel's slowdown: all but attention, and attention at the fit's rate.
            row.timed = (seconds - timed.attention, timed.attention / timed.slowdown, float(figure["value"]))
            row.ours = f"{seconds:,.0f} s ({plan.kernel})"
            row.ratio = seconds / figure["value"]
            row.check = "fit" if point["id"] in FIT else "held out"
    return rows


def runs_flash_attention_2(point: dict) -> bool:
    return KERNELS.get(point["setup"].get("attention")) == FLASH_ATTENTION_2


def fit_slowdown(timed: list[tuple[float, float, float]]) -> float:
    """FlashAttention 2's attention slowdown that best predicts the measured seconds: least
    squares of the relative errors of `rest + k * attention`, from (rest, attention, measured)."""
    numerator = sum(attention / seconds * (1 - rest / seconds) for rest, attention, seconds in timed)
    denominator = sum((attention / seconds) ** 2 for _rest, attention, seconds in timed)
    if not denominator:
        raise ValueError("no attention seconds to fit FlashAttention 2's rate to")
    return numerator / denominator


def table(rows: list[Row]) -> str:
    lines = [
        "| point | figure | published | ours (simulated) | ours / published | what differs |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        check = f" ({row.check})" if row.check else ""
        lines.append(f"| {row.point} | {row.kind}{check} | {row.published} | {row.ours} | {ratio} | {row.differs} |")
    return "\n".join(lines)


def fit_lines(rows: list[Row], points: dict[str, dict]) -> list[str]:
    """The FlashAttention 2 rate fitted to `FIT`, and every step time predicted with it."""
    flash = {row.point: row.timed for row in rows if row.timed and runs_flash_attention_2(points[row.point])}
    fitted = [flash[name] for name in FIT if name in flash]
    if not fitted:
        return []
    slowdown = fit_slowdown(fitted)
    lines = [f"FlashAttention 2 on Hopper, attention's seconds over the fit's: {slowdown:.3f} (fit: {', '.join(FIT)}):"]
    for name, (rest, attention, seconds) in flash.items():
        predicted = rest + slowdown * attention
        label = "fit" if name in FIT else "held out"
        lines.append(f"  {name}: {predicted:,.0f} s, measured {seconds:,.0f} s, {predicted / seconds:.3f} ({label})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", metavar="ID", help="only these points (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}: a smoke test")
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore", FutureWarning)
    started = time.perf_counter()
    wanted = QUICK if args.quick else args.points
    points = {point["id"]: point for point in measured.published_points()}
    chosen = [measured.published_point(name) for name in wanted] if wanted else list(points.values())
    rows = []
    for point in chosen:
        began = time.perf_counter()
        rows.extend(rows_for(point))
        print(f"  {point['id']}: {time.perf_counter() - began:.0f} s", flush=True)
    checked = measured.load(measured.PUBLISHED)["checked"]
    print(f"Published measurements beside the simulator ({measured.PUBLISHED}, checked {checked}; ours simulated, "
          f"torch {torch.__version__}):")  # fmt: skip
    print(table(rows))
    for line in fit_lines(rows, points):
        print(line)
    print(f"simulated in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
