"""How long generation takes on a GPU: prefill at the step time model's rates, then one decode step
per token, which reads from device memory what it uses (the weights once, every row's KV cache)
and, run eagerly, waits on the host's launching of its ops.

Decoding is memory-bound: a step of 8 rows multiplies each weight matrix by 8 vectors. Its seconds
are `max(bytes / (memory bandwidth x efficiency), FLOPs / rate, ops x host seconds per op)`:

- `bytes`: what the step reads and writes, as simulated (`simulator.generation`: the matmuls' and
  attention's operands, among them every weight and every row's keys and values, and the
  FLOP-less ops' traffic, among them transformers' `DynamicCache` copying the whole cache into a
  tensor one token longer at every step); for vLLM, its weights once and each row's cache, read
  by paged attention in place.
- `efficiency`: fitted to one published long-context throughput, TensorRT-LLM's Llama-3.1-8B FP8
  at 20,000 input and 2,000 output tokens on one H100, and checked against the others, held out
  (`published_generation.json`; `python -m hf_offload.tools.benchmarks.decode_time`). The high
  end of the range: a batch-1 step captured as a CUDA graph on an H100 (5.1 ms).
- Host: transformers' `generate` runs eagerly, one kernel launch per op and a host sync per step
  (its stop check). The host's seconds per aten op come from one published measurement, an A100
  running transformers' `generate` at 30.2 ms a step for Llama-3.1-8B at batch 1, a third of which
  its memory bandwidth explains; divided by the ops of that step as simulated. vLLM replays CUDA
  graphs: no host term.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from hf_offload.tools import measured
from hf_offload.tools.devices import DEVICES, TIME_MODEL, Device

GB = 1e9
GENERATION = "published_generation.json"


@dataclass(frozen=True)
class DecodeRates:
    """The decode model's constants: the memory efficiency's fitted value (low end of the speed)
    and the highest a published step reached (high end), and the host's seconds per aten op."""

    memory_efficiency: float
    memory_efficiency_high: float
    host_seconds_per_op: float
    # The slow end's efficiency reading one row's KV cache when one long row decodes alone: fitted
    # to vLLM 0.4.2's 30 ms a token at 200K context (Llama-3-8B, one H800; lmdeploy#1608), the
    # weights at `memory_efficiency`. None: the cache at `memory_efficiency` too.
    kv_efficiency_batch_1: float | None = None


def decode_points() -> list[dict]:
    return measured.load(GENERATION)["decode"]


def grpo_points() -> list[dict]:
    return measured.load(GENERATION)["grpo"]


@cache
def _shape(preset: str) -> dict:
    """Parameter counts of a preset read per decode step: (everything but the input embeddings,
    of which only the rows used are read; lm_head apart) and the KV elements per token."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_offload.tools.presets import preset_config

    config = preset_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return {
        "linear": total - embeddings.numel() - (0 if head is embeddings else head.numel()),
        "head": head.numel(),
        "kv_elements": 2 * text.num_hidden_layers * heads * head_dim,
        "layers": text.num_hidden_layers,
        "attention_width": text.num_attention_heads * head_dim,
    }


def _weights_read(point: dict) -> float:
    shape, assumed = _shape(point["preset"]), point["assumed"]
    linear = shape["linear"] * assumed["weight_bytes_per_parameter"]
    return linear + shape["head"] * assumed["lm_head_bytes_per_parameter"]


def predict(point: dict, efficiency: float) -> float:
    """The point's figure predicted at this memory efficiency: milliseconds per step for a batch
    of one; output tokens per second for a maximum-load throughput (every request in flight that
    the KV cache holds: their prefill at the time model's matmul rate, twice the bf16 rate in
    FP8; then their decode steps, each bound by memory or compute)."""
    device = DEVICES[point["device"]]
    shape, assumed, setup = _shape(point["preset"]), point["assumed"], point["setup"]
    kv_token = shape["kv_elements"] * assumed["kv_bytes_per_element"]
    weights = _weights_read(point)
    bandwidth = device.memory_tbps * 1e12 * efficiency
    if point["figure"]["kind"] == "ms_per_step":
        context = setup["input_tokens"] or 0
        return (weights + context * kv_token) / bandwidth * 1e3
    isl, osl = setup["input_tokens"], setup["output_tokens"]
    rate = device.tflops * 1e12 * TIME_MODEL.matmul * (2 if assumed["weight_bytes_per_parameter"] == 1 else 1)
    free = (device.memory_gib * 2**30 - weights) * assumed["kv_share_of_free_memory"]
    requests = max(int(free // ((isl + osl) * kv_token)), 1)
    parameters = shape["linear"] + shape["head"]
    attention = 2 * shape["layers"] * shape["attention_width"]  # FLOPs per query token per key token
    seconds = requests * (2 * parameters * isl + attention * isl * isl) / rate
    for step in range(osl):
        context = isl + step
        memory = (weights + requests * context * kv_token) / bandwidth
        compute = requests * (2 * parameters + 2 * attention * context) / rate
        seconds += max(memory, compute)
    return requests * osl / seconds


def fit(points: list[dict] | None = None) -> float:
    """The memory efficiency that predicts the point with role "fit" (a bisection: the prediction
    rises with the efficiency)."""
    points = decode_points() if points is None else points
    (point,) = [p for p in points if p["role"] == "fit"]
    target = point["figure"]["value"]
    low, high = 0.05, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if predict(point, middle) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def host_seconds_per_op(ops_per_step: int, points: list[dict] | None = None) -> float:
    """The host's seconds per aten op: the "host" point's step time over `ops_per_step`, the ops
    of that model's decode step at batch 1 as simulated (the caller simulates it)."""
    points = decode_points() if points is None else points
    (point,) = [p for p in points if p["role"] == "host"]
    return point["figure"]["value"] / 1e3 / ops_per_step


def efficiency_of(point: dict) -> float:
    """The memory efficiency at which a batch-1 point is predicted exactly."""
    return predict(point, 1.0) / point["figure"]["value"]


@cache
def rates() -> DecodeRates:
    """The fitted efficiency, the graph-captured batch-1 step's, and the host's seconds per op
    (the host point's model simulated at batch 1 for its op count: a few seconds, once)."""
    points = decode_points()
    (graph,) = [p for p in points if p["id"].endswith("cuda-graph")]
    (host,) = [p for p in points if p["role"] == "host"]
    fitted = fit(points)
    return DecodeRates(fitted, efficiency_of(graph), host_seconds_per_op(_decode_ops(host["preset"]), points),
                       kv_efficiency_batch_1(fitted, points))  # fmt: skip


def kv_efficiency_batch_1(fitted: float, points: list[dict] | None = None) -> float:
    """The efficiency at which one row's long KV cache is read, the weights read at `fitted`, that
    reproduces the "long_context_batch_1" point (vLLM 0.4.2 at 200K tokens: attention over one long
    row uses few of the GPU's cores, which a bandwidth model alone does not see)."""
    points = decode_points() if points is None else points
    (point,) = [p for p in points if p["role"] == "long_context_batch_1"]
    device = DEVICES[point["device"]]
    bandwidth = device.memory_tbps * 1e12
    kv_token = _shape(point["preset"])["kv_elements"] * point["assumed"]["kv_bytes_per_element"]
    kv = kv_token * point["setup"]["input_tokens"]
    left = point["figure"]["value"] / 1e3 - _weights_read(point) / (bandwidth * fitted)
    return kv / (bandwidth * left)


@cache
def _decode_ops(preset: str) -> int:
    """Aten ops of one decode step of the preset at batch 1 (bf16, no adapters), as simulated: on
    the preset's layers at a small width (the ops are the same at any width, and it takes a second)."""
    import logging

    from hf_offload.tools.presets import preset_config
    from hf_offload.tools.simulator import Simulator, Training, TrlStep

    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = preset_config(preset)
    text = config.get_text_config()
    heads, kv_heads = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    scale = heads // kv_heads
    text.update(dict(hidden_size=64 * scale, num_attention_heads=2 * scale, num_key_value_heads=2, head_dim=32,
                     intermediate_size=128, vocab_size=256))  # fmt: skip
    simulator = Simulator(config, Training(trl=TrlStep("grpo")))
    return simulator.generate("none", rows=1, prompt_length=64).ops


@dataclass(frozen=True)
class DecodeTime:
    """Seconds of generation: prefill, then the decode steps, at the two ends of the range."""

    prefill: float
    decode_low: float
    decode_high: float
    steps: int
    host_bound_steps: int  # at the high end: steps the host's launching sets

    @property
    def low(self) -> float:
        return self.prefill + self.decode_low

    @property
    def high(self) -> float:
        return self.prefill + self.decode_high


def _sum_of_max(base: float, slope: float, floor: float, first: int, last: int) -> tuple[float, int]:
    """sum over k in first..last of max(base + slope k, floor), and how many terms the floor set
    (the line rises: `slope` >= 0)."""
    if last < first:
        return 0.0, 0
    below_end = min(last, math.ceil((floor - base) / slope) - 1) if slope > 0 else (last if base < floor else first - 1)
    below = max(below_end - first + 1, 0)
    start = first + below
    count = last - start + 1
    line = count * base + slope * (start + last) * count / 2 if count > 0 else 0.0
    return below * floor + line, below


Line = tuple[float, float]  # base, per step


def decode_seconds(device: Device, bytes_line: Line, flops_line: Line, *, steps: int, host_seconds: float = 0.0,
                   rates_: DecodeRates | None = None,
                   lone_kv: Line | None = None) -> tuple[float, float, int]:  # fmt: skip
    """Decode steps 1..steps whose bytes and FLOPs are `base + slope x k`: (fast end, slow end,
    steps the host sets at the slow end). `host_seconds`: the host's time per step (eager).
    `lone_kv`: the part of the bytes that is one row's KV cache decoding alone (vLLM, one row at a
    time): read at the slow end at `kv_efficiency_batch_1` (the published 200K-token point)."""
    found = rates() if rates_ is None else rates_
    rate = device.tflops * 1e12 * TIME_MODEL.matmul
    ends = []
    host_bound = 0
    for efficiency in (found.memory_efficiency_high, found.memory_efficiency):
        bandwidth = device.memory_tbps * 1e12 * efficiency
        base = max(bytes_line[0] / bandwidth, 0.0)
        slope = bytes_line[1] / bandwidth
        lone = found.kv_efficiency_batch_1
        if lone_kv is not None and lone is not None and efficiency == found.memory_efficiency and lone < efficiency:
            slower = device.memory_tbps * 1e12 * lone
            base += lone_kv[0] / slower - lone_kv[0] / bandwidth
            slope += lone_kv[1] / slower - lone_kv[1] / bandwidth
        # Compute-bound steps would need FLOPs / rate above memory: not at GRPO's few rows; checked.
        if flops_line[0] / rate > base or flops_line[1] / rate > slope:
            base, slope = max(base, flops_line[0] / rate), max(slope, flops_line[1] / rate)
        floor = host_seconds if efficiency == found.memory_efficiency else 0.0
        total, host_bound = _sum_of_max(base, slope, floor, 1, steps)
        ends.append(total)
    return ends[0], ends[1], host_bound


def compute_dict_seconds(device: Device, compute: Mapping, traffic: float) -> float:
    """Seconds of a compute-bound pass (prefill) at the step time model's rates."""
    return TIME_MODEL.seconds(device, compute, traffic)
