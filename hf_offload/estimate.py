"""Predict, without running a model, what activation offloading saves and costs.

The byte counts model what autograd saves inside one decoder layer of a Llama-style block
(RMSNorm, attention through `scaled_dot_product_attention` with grouped-query attention, gated
MLP), per token, for full fine-tuning or LoRA on every linear layer, with or without gradient
checkpointing. They were derived by listing the tensors saved by transformers 5.x layers and
are checked against what the engine measures on tiny models of each supported family
(tests/test_estimate.py, within 10%).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
FP32 = 4


@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder-only model that decide its activation memory."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> Shape:
        config = getattr(config, "text_config", None) or config
        get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        return cls(
            model_type=get("model_type", "llama"),
            hidden=hidden,
            intermediate=get("intermediate_size"),
            layers=get("num_hidden_layers"),
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads,
            vocab=get("vocab_size"),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> Shape:
        path = Path(path)
        config_file = path / "config.json" if path.is_dir() else path
        data = json.loads(config_file.read_text())
        return cls.from_config(data.get("text_config") or data)

    @property
    def layer_parameters(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate


PRESETS = {
    "llama-3-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128, 128256),
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, 128256),
    "qwen2-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 128, 152064),
    "mistral-7b": Shape("mistral", 4096, 14336, 32, 32, 8, 128, 32768),
    "gemma-7b": Shape("gemma", 3072, 24576, 28, 16, 16, 256, 256000),
}


def saved_bytes_per_token(
    shape: Shape,
    *,
    dtype_bytes: int,
    checkpointing: bool = False,
    lora_rank: int | None = None,
    lora_dtype_bytes: int | None = None,
) -> int:
    """Bytes autograd saves per token inside one decoder layer (excluding parameters)."""
    e, d, f, h = dtype_bytes, shape.hidden, shape.intermediate, shape.heads
    if checkpointing:
        return e * d  # the checkpoint's input: the hidden states entering the layer
    q, kv = h * shape.head_dim, shape.kv_heads * shape.head_dim
    # SDPA saves q, k, v, its output and a float32 log-sum-exp per head.
    attention = e * (2 * q + 2 * kv) + FP32 * h
    # RMSNorm computes in float32: its float32 input and 1/rms are saved; the normalized
    # output is saved for the norm weight's gradient (in float32 for Gemma, which scales by
    # 1 + weight before casting back), and only when that weight trains.
    norm_output = FP32 * d if shape.model_type.startswith("gemma") else e * d
    if lora_rank is None:
        norm = FP32 * d + FP32 + norm_output
        # Inputs of q/k/v (one tensor) and of gate/up; o_proj's input is the attention output
        # and down's input is one of the MLP's four intermediate tensors.
        linear_inputs = 2 * e * d
        mlp = 4 * e * f
        return 2 * norm + linear_inputs + attention + mlp
    a, r = lora_dtype_bytes or dtype_bytes, lora_rank
    norm = FP32 * d + FP32
    if a == e:
        # LoRA's A reads the same input tensors the frozen layers would have saved.
        linear_inputs = 2 * e * d
        mlp = 4 * e * f
    else:
        # Each adapter casts its own copy of its input; the frozen down projection no longer
        # needs the MLP product itself.
        linear_inputs = a * (3 * d + q + 2 * d + f)
        mlp = 3 * e * f
    adapter_outputs = 7 * a * r  # A's output, saved by B, for each adapted linear layer
    return 2 * norm + linear_inputs + attention + mlp + adapter_outputs


@dataclass(frozen=True)
class Estimate:
    shape: Shape
    tokens: int
    layer_bytes: int
    total_bytes: int
    offloaded_bytes: int
    peak_without: int
    peak_with: int
    forward_copy_seconds: float
    forward_compute_seconds: float
    backward_copy_seconds: float
    backward_compute_seconds: float

    @property
    def saved_bytes(self) -> int:
        return self.peak_without - self.peak_with

    @property
    def hides_behind_compute(self) -> bool:
        return (
            self.forward_copy_seconds <= self.forward_compute_seconds
            and self.backward_copy_seconds <= self.backward_compute_seconds
        )


def estimate(
    shape: Shape,
    *,
    seq_len: int,
    batch_size: int = 1,
    dtype_bytes: int = 2,
    checkpointing: bool = False,
    lora_rank: int | None = None,
    lora_dtype_bytes: int | None = None,
    keep_last_layers: int = 1,
    link_gbps: float = 25.0,
    tflops: float = 200.0,
) -> Estimate:
    """Activation bytes per layer and in total, device memory saved, host memory needed, and
    whether one layer's copies fit in one layer's compute (`link_gbps` per direction, GB/s;
    `tflops`, sustained TFLOP/s)."""
    tokens = seq_len * batch_size
    per_token = saved_bytes_per_token(
        shape,
        dtype_bytes=dtype_bytes,
        checkpointing=checkpointing,
        lora_rank=lora_rank,
        lora_dtype_bytes=lora_dtype_bytes,
    )
    layer_bytes = per_token * tokens
    offloaded_layers = max(shape.layers - keep_last_layers, 0)
    # Forward holds the running layer and the one whose copies are in flight, plus kept layers.
    resident_layers = min(shape.layers, keep_last_layers + 2)
    q = shape.heads * shape.head_dim
    layer_flops = 2 * shape.layer_parameters * tokens + 2 * batch_size * seq_len * seq_len * q  # causal attention
    if checkpointing:
        layer_flops *= 2  # the backward recomputes the forward
    link = link_gbps * 1e9
    compute = tflops * 1e12
    return Estimate(
        shape=shape,
        tokens=tokens,
        layer_bytes=layer_bytes,
        total_bytes=layer_bytes * shape.layers,
        offloaded_bytes=layer_bytes * offloaded_layers,
        peak_without=layer_bytes * shape.layers,
        peak_with=layer_bytes * resident_layers,
        forward_copy_seconds=layer_bytes / link,
        forward_compute_seconds=layer_flops / compute,
        backward_copy_seconds=layer_bytes / link,
        backward_compute_seconds=2 * layer_flops / compute,
    )


def format_estimate(result: Estimate, *, link_gbps: float, tflops: float) -> str:
    def gib(nbytes: float) -> str:
        return f"{nbytes / 2**30:.2f} GiB"

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f} ms"

    verdict = "yes" if result.hides_behind_compute else "no"
    return "\n".join(
        [
            f"{result.shape.model_type}: {result.shape.layers} layers, hidden {result.shape.hidden}, "
            f"{result.tokens} tokens per step",
            f"activations saved per layer: {gib(result.layer_bytes)}; all layers: {gib(result.total_bytes)}",
            f"device memory for activations: {gib(result.peak_without)} without offloading, "
            f"{gib(result.peak_with)} with it (saves {gib(result.saved_bytes)})",
            f"host memory needed: {gib(result.offloaded_bytes)}",
            f"per layer, forward: copy out {ms(result.forward_copy_seconds)} vs compute "
            f"{ms(result.forward_compute_seconds)}; backward: copy back {ms(result.backward_copy_seconds)} vs "
            f"compute {ms(result.backward_compute_seconds)}",
            f"copies hide behind compute at {link_gbps:g} GB/s and {tflops:g} TFLOP/s: {verdict}",
            "(activations outside the decoder layers, the logits and the loss are not included)",
        ]
    )
