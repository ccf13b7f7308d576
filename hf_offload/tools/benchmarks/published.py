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
import dataclasses
import json
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


# Attention kernels a published setup ran that the time model has no rate for, timed as another:
# (the kernel timed, why).
TIMED_AS = {
    "triton_flash": (
        "sdpa",
        "MosaicML's Triton flash attention (attn_impl: triton) timed at the fit's rate: no published "
        "step separates its rate",
    ),
}


@dataclass
class Nearest:
    """The setup our simulator runs for a published point."""

    preset: str | None  # a --preset shape, or None where `config` gives the model
    mode: str
    training: Training
    kernel: str
    differs: list[str] = field(default_factory=list)  # what the simulation does not do as they did
    memory: bool = True  # whether our peak stands for theirs
    synchronous_copies: bool = False  # ALST's checkpoint offload: copies on the compute stream
    config: dict | None = None  # transformers config options (model_type included) where there is no preset
    accumulation: int = 1  # micro-batches per optimizer step, each simulated as the step is

    @property
    def model_key(self) -> str:
        return self.preset if self.preset is not None else json.dumps(self.config, sort_keys=True)


def model_config(plan: Nearest):
    """The transformers config the plan simulates."""
    if plan.preset is not None:
        return preset_config(plan.preset)
    from transformers import AutoConfig

    options = dict(plan.config)
    return AutoConfig.for_model(options.pop("model_type"), **options)


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
    if setup.get("checkpointing") not in (True, False):
        return f"its recomputation ({setup.get('checkpointing')}) is not stated"
    attention = setup.get("attention")
    if attention not in KERNELS and attention not in TIMED_AS and attention != "not stated":
        return f"its attention kernel ({attention}) is not stated precisely enough to time"
    differs = []
    kernel = attention
    if attention == "not stated":
        kernel = "sdpa"
        differs.append("attention kernel not stated: timed as cuDNN's (the source's 1M figure is the cuDNN run's)")
    if attention in TIMED_AS:
        kernel, why = TIMED_AS[attention]
        differs.append(why)
    liger, tiled_mlp, offload = setup.get("liger", False), setup.get("tiled_mlp", False), setup["checkpoint_offload"]
    tiling = None
    mode = ("checkpointing" if setup["checkpointing"] else "none") + ("+hf_offload" if offload else "")
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
    sharded = setup.get("fsdp") == "FULL_SHARD"
    if sharded:
        differs.append(
            f"FSDP over {point['gpus']} GPUs: each GPU's micro-batches simulated with the whole model, its gathers "
            f"(over NVLink, behind compute) and its 1/{point['gpus']} of the optimizer step (milliseconds) not"
        )
    lora_rank = setup.get("lora_rank")
    autocast = setup.get("precision", "").endswith("(autocast)")
    if lora_rank is not None:
        differs.append(f"LoRA r={lora_rank} on every linear layer but lm_head, with {setup['adapters']} adapters"
                       + (" under bf16 autocast" if autocast else ""))  # fmt: skip
    if point.get("config") is not None:
        differs.append(f"the model as transformers' {point['config']['model_type']} of its shape")
    accumulation = setup.get("accumulation", 1)
    if accumulation > 1:
        differs.append(f"{accumulation} micro-batches a step: {accumulation} x the micro-batch's step")
    training = Training(
        dtype=torch.bfloat16,
        lora_rank=lora_rank,
        lora_dtype=torch.float32 if setup.get("adapters", "float32") == "float32" else torch.bfloat16,
        autocast=torch.bfloat16 if autocast else None,
        optimizer_states=0 if sharded else 2,
        batch_size=setup.get("batch", 1),
        offload_params=offload_params,
        sp_size=parallel.get("size", 1),
        device=DEVICES[point["device"]],
        keep_last_layers=0 if offload else 1,
        tiling=tiling,
        recompute_offload=False,  # their systems keep what a layer's recompute saves on the device
        early_release=False,  # and let go of a layer's input as hf_offload did before issue 46
    )
    return Nearest(point["preset"], mode, training, kernel, differs, memory, synchronous, point.get("config"),
                   accumulation)  # fmt: skip


@dataclass(frozen=True)
class Band:
    """Where ours over theirs is held, and why."""

    name: str
    low: float
    high: float
    why: str

    def holds(self, ratio: float) -> bool:
        return self.low <= ratio <= self.high


# Step times. The long-context steps (attention most of the predicted step) test attention's rate
# (`FIT`, and the H200's fit beyond it): `LONG_CONTEXT` holds every one, `HELD_OUT` those not in FIT.
# Steps of 32K or less, matmuls most of the step, test everything else (issue 37): `MATMULS`.
LONG_CONTEXT = Band(
    "long context",
    0.75,
    1.25,
    "attention is most of these steps; FlashAttention 2's rate on Hopper is fitted to two of them",
)
HELD_OUT = Band(
    "long context, held out", 0.90, 1.10, "predicted without the FlashAttention 2 steps they were fitted to"
)
MATMULS = Band(
    "matmuls", 0.80, 1.25,
    "steps of 32K or less, matmuls most of the prediction, measured in 2023 (PyTorch 2.0-2.1, CUDA 11.8-12.1), "
    "against a time model fitted on 2026's software: on the A100, LLM Foundry's MPT-7B (its own fused model code) "
    "comes out at 0.86-0.89 and Qwen-7B's LoRA (transformers and PEFT, unfused) at 1.06-1.23; what separates them is "
    "the two stacks' work besides the matmuls",
)  # fmt: skip
MATMULS_HOPPER_2023 = Band(
    "matmuls, Hopper in 2023", 0.55, 0.80,
    "LLM Foundry's MPT-7B on H100s in August 2023 (torch 2.1 nightly, CUDA 12.1) took 1.4-1.6x the time the model "
    "gives, where the same image's A100 runs are within MATMULS. The model's Hopper matmul rate is the H200's, "
    "measured in 2026 (789 TFLOP/s, torch 2.11): Hopper's software of 2023, or an H100 slower than our H200; no H100 "
    "step on 2026's software separates the two",
)  # fmt: skip

# Published peaks against ours (allocated bytes, less what we simulate that their run did not
# allocate), by the counter they were read with.
ARCTIC_MEMORY = Band(
    "ArcticTraining's logger (NV or Max_MA)", 0.75, 0.93,
    "nvidia-smi's used memory (NV: the one figure labelled; the others are not said to be Max_MA or NV) holds, "
    "beyond allocated bytes, the CUDA context (about 1.4 GiB), DeepSpeed ZeRO-3's buffers and the caching "
    "allocator's reserve, which keeps freed blocks: at a loss-head peak, float32 vocabulary-wide ones (15.3 GiB at "
    "32K). All five sit at 0.78-0.90: the band is that, 3% either side; an allocated (Max_MA) figure would sit near "
    "1 and fall out of it",
)  # fmt: skip
UNSTATED_MEMORY = Band(
    "a counter and unit not stated (GB)", 0.85, 0.97,
    "ours in GB (10**9 bytes; in GiB the ratio is 7% lower). An nvidia-smi or reserved figure holds the CUDA "
    "context and the caching allocator's reserve, and Qwen's remote code keeps a shifted, contiguous bf16 copy of "
    "the logits beside the float32 one (2.5 GB at 8K): Qwen-7B's four sit at 0.88-0.95, the band is that, 3% either "
    "side",
)  # fmt: skip


def time_band(point: dict, row: Row) -> Band:
    """The band a published step time is held to: by what dominates our prediction of it, and for
    matmul-dominated steps by the GPU and the year of the software that ran them."""
    rest, attention, _measured = row.timed
    if attention >= rest:
        return HELD_OUT if point["id"] not in FIT else LONG_CONTEXT
    hopper = DEVICES[point["device"]].compute_capability[0] == 9
    year = point["setup"].get("software", {}).get("year")
    return MATMULS_HOPPER_2023 if hopper and year is not None and year <= 2023 else MATMULS


def memory_band(figure: dict) -> Band:
    counter = figure.get("memory", "")
    if counter.startswith("nvidia-smi") or "Max_MA or NV" in counter:
        return ARCTIC_MEMORY
    if figure["kind"] == "peak_gb" and counter == "not stated":
        return UNSTATED_MEMORY
    raise ValueError(f"no band for a peak read with {counter!r} ({figure['kind']})")


def simulated_beyond_theirs(point: dict, plan: Nearest, step: StepResult) -> tuple[int, str]:
    """Bytes our peak holds that their run did not allocate, and why: where the peak is in an
    untiled MLP's backward and they ran Liger's SwiGLU, which writes the gate's and the up
    projection's gradients into its saved inputs, two tensors transformers' MLP allocates."""
    setup = point["setup"]
    phase, where = step.peak.tag[0], step.peak.tag[1] if len(step.peak.tag) > 1 else ""
    if not (setup.get("liger") and not setup.get("tiled_mlp") and phase == "backward" and where.endswith(" mlp")):
        return 0, ""
    width = model_config(plan).get_text_config().intermediate_size
    tokens = step.rank_seq_len * plan.training.batch_size
    nbytes = 2 * tokens * width * plan.training.dtype.itemsize
    return nbytes, (
        f"our peak is in {where}'s backward, where transformers' MLP allocates the two gradients Liger's SwiGLU writes "
        f"into its saved inputs: {nbytes / GIB:.1f} GiB, taken off ours"
    )


def attention_bytes(step: StepResult) -> int:
    """What attention holds at the step's peak: what a layer's self_attn made in forward, recompute
    and backward (hf_offload's restored layer inputs are not attention's), and the kernel's
    workspace there."""
    parts = step.peak.live_by_tag
    made = sum(n for (phase, *where), n in parts.items() if phase != "restored" and "self_attn" in "".join(where))
    workspace = step.peak.workspace[1] if step.peak.workspace and "attention" in step.peak.workspace[0] else 0
    return made + workspace


def scaled_outside_attention(step: StepResult, factor: float) -> StepResult:
    """`step` with every byte at its peak but attention's (`attention_bytes`) scaled by `factor`:
    a simulator off by that much in the weights, optimizer, MLPs, norms and loss head."""
    other = step.tracked_peak_bytes - attention_bytes(step)
    return dataclasses.replace(step, tracked_peak_bytes=step.tracked_peak_bytes - other + int(other * factor))


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
    band: Band | None = None  # what the ratio is held to


_SIMULATORS: dict[tuple, Simulator] = {}
_STEPS: dict[tuple, StepResult] = {}  # points that share a setup (TRL's two kernels) share its step


def simulate(plan: Nearest, seq_len: int) -> StepResult:
    key = (plan.model_key, plan.training)
    if (*key, plan.mode, seq_len) in _STEPS:
        return _STEPS[(*key, plan.mode, seq_len)]
    if key not in _SIMULATORS:
        _SIMULATORS.clear()  # one 8B model at a time: the points rarely share one
        _SIMULATORS[key] = Simulator(model_config(plan), plan.training)
    step = _STEPS[(*key, plan.mode, seq_len)] = _SIMULATORS[key].run(plan.mode, seq_len)
    return step


@cache
def _parameters(preset: str | None, config: str | None) -> int:
    from transformers import AutoModelForCausalLM

    plan = Nearest(preset, "none", Training(), "sdpa", config=None if config is None else json.loads(config))
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config(plan)).parameters())


def parameters(plan: Nearest) -> int:
    """What the host's optimizer steps in full fine-tuning: every parameter."""
    return _parameters(plan.preset, None if plan.config is None else json.dumps(plan.config, sort_keys=True))


def timing(step: StepResult, plan: Nearest) -> StepTime:
    trainable = parameters(plan) if plan.training.offload_params else 0
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
    config = model_config(plan)
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
        if figure["kind"] in ("peak_gib", "peak_gb"):
            unit, scale = ("GiB", GIB) if figure["kind"] == "peak_gib" else ("GB", 1e9)
            beyond, why = simulated_beyond_theirs(point, plan, step)
            row.ours = f"{step.peak_bytes / scale:.2f} {unit} allocated" + (
                f" ({(step.peak_bytes - beyond) / scale:.2f} without what they did not allocate)" if beyond else ""
            )
            row.ratio = (step.peak_bytes - beyond) / scale / figure["value"]
            row.band = memory_band(figure)
            row.differs = "; ".join(filter(None, (f"theirs: {figure['memory']}", why, row.differs)))
        elif figure["kind"] == "trained_tokens":
            row.ours = f"peak {step.peak_bytes / GIB:.2f} of {device.memory_gib:g} GiB"
            row.ratio = step.peak_bytes / GIB / device.memory_gib
        elif figure["kind"] == "step_seconds":
            timed = timing(step, plan)
            many = plan.accumulation  # micro-batches, each the step simulated
            seconds = many * (timed.seconds + synchronous_copy_seconds(step, plan))
            # The step as a line in the kernel's slowdown: all but attention, and attention at the fit's rate.
            row.timed = (
                seconds - many * timed.attention,
                many * timed.attention / timed.slowdown,
                float(figure["value"]),
            )
            row.ours = f"{seconds:,.0f} s ({plan.kernel})" if seconds >= 100 else f"{seconds:.2f} s ({plan.kernel})"
            row.ratio = seconds / figure["value"]
            row.check = "fit" if point["id"] in FIT else "held out"
            row.band = time_band(point, row)
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
        "| point | figure | published | ours (simulated) | ours / published | band | what differs |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        check = f" ({row.check})" if row.check else ""
        band = "-" if row.band is None else f"{row.band.name}: {row.band.low:g}-{row.band.high:g}"
        if row.band is not None and row.ratio is not None and not row.band.holds(row.ratio):
            band += " (outside)"
        lines.append(f"| {row.point} | {row.kind}{check} | {row.published} | {row.ours} | {ratio} | {band} "
                     f"| {row.differs} |")  # fmt: skip
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
