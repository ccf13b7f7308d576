"""Predict, without running a model, what a training step keeps on the device and how long it takes.

Three layers of prediction, each a pure function of a model's shape:

- `saved_bytes_per_token`: what autograd saves per token inside one decoder layer of a Llama-style
  block (RMSNorm, attention through `scaled_dot_product_attention` with grouped-query attention,
  gated MLP), for full fine-tuning or LoRA on every linear layer, with or without gradient
  checkpointing. Derived by listing the tensors saved by transformers 5.x layers; checked against
  what the engine measures on tiny models of each supported family (tests/test_estimate.py).
- `step_peak`: the peak device memory of a whole training step in each mode (no offloading,
  hf_offload, checkpointing, both), with or without a fused linear cross-entropy loss: weights,
  gradients and optimizer state, the saved activations each mode keeps on the device, the loss
  head, and the working set of the phase where the peak falls. `max_seq_len` solves it for the
  longest sequence that fits a device. Checked against the H200 figures in docs/estimate.md and,
  for the loss head and the layer phases, against allocations counted on the CPU.
- `step_time`: the matmul and attention FLOPs of a step at a device's sustained matmul rate and
  a step efficiency fitted to the H200 figures, plus LoRA's adapter overhead.

Nothing here imports transformers: the engine's planner and the API can call it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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
    tied_embeddings: bool = False  # lm_head shares the input embedding's weight

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
            tied_embeddings=bool(get("tie_word_embeddings", False)),
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

    @property
    def parameters(self) -> int:
        """Every weight: embedding, decoder layers with their two norms, final norm, lm_head
        (biases, e.g. Qwen2's q/k/v biases, are left out: under 0.01% of the total)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.layers * (self.layer_parameters + 2 * self.hidden) + self.hidden

    def lora_parameters(self, rank: int) -> int:
        """Adapter weights of LoRA on every linear layer of every decoder layer (PEFT's
        "all-linear", which leaves lm_head out): rank x (in + out) per linear layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        d, f = self.hidden, self.intermediate
        in_plus_out = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d)
        return self.layers * rank * in_plus_out


PRESETS = {
    "llama-3-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128, 128256),
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, 128256, tied_embeddings=True),
    "qwen2-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 128, 152064),
    "mistral-7b": Shape("mistral", 4096, 14336, 32, 32, 8, 128, 32768),
    "gemma-7b": Shape("gemma", 3072, 24576, 28, 16, 16, 256, 256000, tied_embeddings=True),
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


# ---------------------------------------------------------------------------------------------
# The whole step's peak
# ---------------------------------------------------------------------------------------------

MODES = ("none", "hf_offload", "checkpointing", "checkpointing+hf_offload")

# RMSNorm's backward (pow, mean, rsqrt and two multiplications, all in float32) holds five
# float32 tensors of the norm's size at once besides the float32 input it saved; counted on the
# CPU at PowBackward0, and the same on CUDA: these are autograd's composite formulas, not kernels.
NORM_BACKWARD_TEMPORARIES = 5


def loss_head_bytes_per_token(shape: Shape, *, dtype_bytes: int, fused: bool = False) -> int:
    """Device bytes per token that the loss head (lm_head and the cross-entropy) holds at its own
    peak, on top of the decoder layers' saved activations, the final norm's and the weights.

    Standard loss (transformers' `ForCausalLMLoss`: `logits.float()`, then `cross_entropy`,
    which is `log_softmax` and `nll_loss`): the peak is in backward, inside `log_softmax`'s
    backward, where three float32 tensors of vocabulary size are live per token: the
    log-probabilities `log_softmax` saved, the gradient `nll_loss` returned for them and the
    gradient `log_softmax` is writing. The bf16 logits and their float32 copy are gone by then
    (nothing saves them), so it is `12 x vocab` bytes whatever `dtype_bytes` is. This assumes the
    caller keeps only the loss (`model(...).loss`, as Trainer and `hf-offload bench` do); a loop
    that keeps the output object alive through backward also holds the logits,
    `dtype_bytes x vocab` more.

    Fused loss (`fused=True`; Liger's fused linear cross-entropy, read from liger-kernel 0.8.5,
    not measured here): logits exist one chunk of tokens at a time, chunks sized so that a chunk's
    logits are about `tokens x hidden` elements (rounded up to a power of two, so at most twice
    that). At its peak, in forward, per token: the input hidden states, the input gradient it
    computes in forward and keeps for backward, the chunk's logits (bounded by `2 x hidden`
    elements per token), the float32 per-token loss, the target mask and the int64 targets.
    A trainable lm_head's gradient is computed in forward too; that is a fixed size, counted with
    the weights (see `step_peak`).

    Use it to size a device-memory budget: `tokens x loss_head_bytes_per_token(...)` is what must
    stay free for the loss head beyond the decoder layers' activations.
    """
    _require_positive_int("dtype_bytes", dtype_bytes)
    if fused:
        e, d = dtype_bytes, shape.hidden
        return e * d + e * d + 2 * e * d + FP32 + 1 + 8
    return 3 * FP32 * shape.vocab


def _checkpoint_bytes_per_token(shape: Shape, dtype_bytes: int) -> int:
    return saved_bytes_per_token(shape, dtype_bytes=dtype_bytes, checkpointing=True)


def _final_norm_bytes_per_token(shape: Shape, *, dtype_bytes: int, trainable_head: bool) -> int:
    """What the final norm and lm_head save: the norm's float32 input and 1/rms; with full
    fine-tuning also the normalized output the norm weight's gradient needs and lm_head's input
    (its weight's gradient needs it)."""
    e, d = dtype_bytes, shape.hidden
    saved = FP32 * d + FP32
    if trainable_head:
        saved += (FP32 if shape.model_type.startswith("gemma") else e) * d + e * d
    return saved


def _layer_backward_working_bytes_per_token(
    shape: Shape, *, dtype_bytes: int, lora_rank: int | None, lora_dtype_bytes: int | None
) -> int:
    """What a decoder layer's backward holds beyond the tensors the layer saved, at its largest
    moment, which is in the MLP (the intermediate size dominates):

    - full fine-tuning, or LoRA with adapters in the model's dtype: the backward of
      `act(gate) * up` holds the product's gradient and the two gradients it produces, while the
      product itself has been released: `2 x dtype x intermediate`;
    - float32 adapters on a bf16 model (PEFT's default): the down projection's adapter holds the
      float32 gradient of its float32 copy of its input: `4 x intermediate` (the recompute of gate
      and up under checkpointing holds about as much: the adapter's float32 output, its sum with
      the bf16 result, and that result);

    plus the gradient flowing down the residual stream (with float32 adapters, also the bf16
    gradient of the base projection's output and the recomputed residual)."""
    e, d, f = dtype_bytes, shape.hidden, shape.intermediate
    a = lora_dtype_bytes or dtype_bytes
    if lora_rank is not None and a != e:
        return a * f + 3 * e * d
    return 2 * e * f + e * d


def _misc_bytes_per_token(shape: Shape, dtype_bytes: int) -> int:
    """Alive the whole step: rotary cos and sin, position ids, input ids and the shifted labels."""
    return 2 * shape.head_dim * dtype_bytes + 3 * 8


@dataclass(frozen=True)
class Phase:
    """One moment of the step that may hold its peak: `fixed_bytes + per_token_bytes x tokens`."""

    name: str
    fixed_bytes: int
    per_token_bytes: int
    parts: dict[str, int] = field(default_factory=dict, compare=False)  # per-token bytes by part

    def bytes_at(self, tokens: int) -> int:
        return self.fixed_bytes + self.per_token_bytes * tokens


@dataclass(frozen=True)
class Fixed:
    """Bytes that do not depend on the sequence length."""

    weights: int
    gradients: int  # trainable parameters' gradients
    optimizer: int  # optimizer state for the trainable parameters
    head_gradient: int  # lm_head's gradient, when lm_head trains
    layer_gradient: int  # one decoder layer's share of `gradients`
    embedding_gradient: int  # the input embedding's, when it trains and is not lm_head's

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def fixed_bytes(
    shape: Shape,
    *,
    dtype_bytes: int = 2,
    lora_rank: int | None = None,
    lora_dtype_bytes: int | None = None,
    optimizer_states: int = 2,
) -> Fixed:
    """Weights in `dtype_bytes`; LoRA adapters in `lora_dtype_bytes` (default `dtype_bytes`);
    one gradient per trainable parameter in its own dtype; `optimizer_states` optimizer tensors per
    trainable parameter in its dtype (torch's AdamW keeps two, exp_avg and exp_avg_sq, like the
    parameter: fp32 for PEFT's fp32 adapters, bf16 for a bf16 model trained in full; 0 for a step
    without an optimizer, as `hf-offload bench` runs). Mixed-precision master weights are not
    modelled."""
    _require_positive_int("dtype_bytes", dtype_bytes)
    if optimizer_states < 0:
        raise ValueError(f"optimizer_states must be >= 0, got {optimizer_states}")
    weights = shape.parameters * dtype_bytes
    if lora_rank is None:
        trainable = weights
        head = shape.vocab * shape.hidden * dtype_bytes
        layer = (shape.layer_parameters + 2 * shape.hidden) * dtype_bytes
        embedding = 0 if shape.tied_embeddings else head
    else:
        _require_positive_int("lora_rank", lora_rank)
        trainable = shape.lora_parameters(lora_rank) * (lora_dtype_bytes or dtype_bytes)
        weights += trainable
        head = embedding = 0
        layer = trainable // shape.layers
    return Fixed(
        weights=weights,
        gradients=trainable,
        optimizer=optimizer_states * trainable,
        head_gradient=head,
        layer_gradient=layer,
        embedding_gradient=embedding,
    )


def _resident_layers(mode: str, shape: Shape, keep_last_layers: int, prefetch_layers: int) -> tuple[int, int]:
    """Layers whose saved tensors (or checkpoint inputs) are on the device (at the loss head,
    while the last layer's backward runs, counting that layer)."""
    if mode in ("none", "checkpointing"):
        return shape.layers, shape.layers
    # Forward releases a layer's copied-out tensors once the next layer has run, so at the loss
    # head only the kept layers remain (the last layer, if none is kept: nothing runs after it to
    # release it). In backward: the layer being differentiated plus `prefetch_layers` brought back
    # ahead, or all kept layers while the first of them runs.
    at_head = min(shape.layers, max(keep_last_layers, 1))
    in_backward = min(shape.layers, max(keep_last_layers, 1 + prefetch_layers))
    return at_head, in_backward


def step_phases(
    shape: Shape,
    *,
    mode: str,
    dtype_bytes: int = 2,
    lora_rank: int | None = None,
    lora_dtype_bytes: int | None = None,
    fused_loss: bool = False,
    keep_last_layers: int = 1,
    prefetch_layers: int = 1,
    optimizer_states: int = 2,
) -> tuple[Phase, ...]:
    """The moments of a training step (forward, backward and the optimizer step; optimizer state
    present throughout, gradients set to None between steps) that may hold its peak, each linear
    in the number of tokens:

    - "loss head": the loss head's own peak (backward of `log_softmax`; with a fused loss, its
      forward) over the saved activations of the layers still resident then;
    - "final norm backward": RMSNorm's float32 backward temporaries over the same residents;
    - "last layer backward": the first decoder layer backward reaches (recomputed first under
      checkpointing): its saved tensors and working set over every other resident layer, with
      only lm_head's and that layer's gradients allocated so far;
    - "first layer backward": the last one backward reaches: every gradient but the input
      embedding's exists, and only that layer's activations remain;
    - "optimizer step": weights, gradients and optimizer state, nothing per token (the
      temporaries of a foreach optimizer step, up to a copy of the parameters, are not counted).

    `mode` is one of MODES. Offloaded modes assume hf_offload's default policy: `keep_last_layers`
    layers stay on the device, `prefetch_layers` are brought back ahead in backward.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    _require_positive_int("dtype_bytes", dtype_bytes)
    if keep_last_layers < 0 or prefetch_layers < 0:
        raise ValueError(
            f"keep_last_layers and prefetch_layers must be >= 0, got {keep_last_layers} and {prefetch_layers}"
        )
    checkpointing = mode.startswith("checkpointing")
    full = saved_bytes_per_token(shape, dtype_bytes=dtype_bytes, lora_rank=lora_rank, lora_dtype_bytes=lora_dtype_bytes)
    per_layer = _checkpoint_bytes_per_token(shape, dtype_bytes) if checkpointing else full
    at_head, in_backward = _resident_layers(mode, shape, keep_last_layers, prefetch_layers)
    fixed = fixed_bytes(
        shape,
        dtype_bytes=dtype_bytes,
        lora_rank=lora_rank,
        lora_dtype_bytes=lora_dtype_bytes,
        optimizer_states=optimizer_states,
    )
    misc = _misc_bytes_per_token(shape, dtype_bytes)
    final_norm = _final_norm_bytes_per_token(shape, dtype_bytes=dtype_bytes, trainable_head=lora_rank is None)
    head = loss_head_bytes_per_token(shape, dtype_bytes=dtype_bytes, fused=fused_loss)
    before_backward = fixed.weights + fixed.optimizer
    # A fused loss computes lm_head's gradient in forward; the standard one only after its peak.
    head_fixed = before_backward + (fixed.head_gradient if fused_loss else 0)
    e, d = dtype_bytes, shape.hidden
    norm_backward = FP32 * NORM_BACKWARD_TEMPORARIES * d + e * d  # and the gradient arriving
    layer_work = _layer_backward_working_bytes_per_token(
        shape, dtype_bytes=dtype_bytes, lora_rank=lora_rank, lora_dtype_bytes=lora_dtype_bytes
    )
    # Under checkpointing the resident checkpoint inputs include the recomputed layer's own, and
    # its recompute saves what the layer would have saved without checkpointing.
    recomputed = full if checkpointing else 0
    last_layer = in_backward * per_layer + recomputed
    first_layer = per_layer + recomputed
    gradients_before_embedding = fixed.gradients - fixed.embedding_gradient
    return (
        Phase(
            "loss head",
            head_fixed,
            at_head * per_layer + final_norm + head + misc,
            {"layers": at_head * per_layer, "final norm": final_norm, "loss head": head, "other": misc},
        ),
        Phase(
            "final norm backward",
            before_backward + fixed.head_gradient,
            at_head * per_layer + final_norm + norm_backward + misc,
            {"layers": at_head * per_layer, "final norm": final_norm + norm_backward, "other": misc},
        ),
        Phase(
            "last layer backward",
            before_backward + fixed.head_gradient + fixed.layer_gradient,
            last_layer + layer_work + misc,
            {"layers": last_layer, "layer working set": layer_work, "other": misc},
        ),
        Phase(
            "first layer backward",
            before_backward + gradients_before_embedding,
            first_layer + layer_work + misc,
            {"layers": first_layer, "layer working set": layer_work, "other": misc},
        ),
        Phase("optimizer step", fixed.total, 0, {}),
    )


@dataclass(frozen=True)
class StepPeak:
    mode: str
    fused_loss: bool
    tokens: int
    phases: tuple[Phase, ...]

    @property
    def phase(self) -> Phase:
        """The phase that holds the peak at this many tokens."""
        return max(self.phases, key=lambda phase: phase.bytes_at(self.tokens))

    @property
    def peak_bytes(self) -> int:
        return self.phase.bytes_at(self.tokens)

    @property
    def per_token_bytes(self) -> int:
        """The slope of the peak at this length: what one more token costs."""
        return self.phase.per_token_bytes

    @property
    def long_phase(self) -> Phase:
        """The phase that holds the peak once sequences are long enough for the per-token part
        to dominate (its slope is the most any phase grows by)."""
        return max(self.phases, key=lambda phase: (phase.per_token_bytes, phase.fixed_bytes))


def step_peak(shape: Shape, *, seq_len: int, batch_size: int = 1, mode: str, **options) -> StepPeak:
    """Peak device memory of one training step of `batch_size` sequences of `seq_len` tokens in
    `mode` (see `step_phases` for the options and what is counted)."""
    _require_positive_int("seq_len", seq_len)
    _require_positive_int("batch_size", batch_size)
    fused = bool(options.get("fused_loss", False))
    return StepPeak(mode, fused, seq_len * batch_size, step_phases(shape, mode=mode, **options))


def max_seq_len(device_memory_bytes: int, shape: Shape, *, mode: str, batch_size: int = 1, **options) -> int:
    """The longest sequence whose training step fits in `device_memory_bytes` in `mode`: every
    phase is linear in tokens (attention through SDPA keeps no sequence-squared tensor), so each
    gives a bound and the smallest wins. 0 when not even the fixed part fits."""
    if not device_memory_bytes > 0:
        raise ValueError(f"device_memory_bytes must be > 0, got {device_memory_bytes}")
    _require_positive_int("batch_size", batch_size)
    phases = step_phases(shape, mode=mode, **options)
    if any(phase.fixed_bytes > device_memory_bytes for phase in phases):
        return 0
    tokens = min(
        (device_memory_bytes - phase.fixed_bytes) // phase.per_token_bytes for phase in phases if phase.per_token_bytes
    )
    return int(tokens) // batch_size


# ---------------------------------------------------------------------------------------------
# Devices and time
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """What the estimates need of an accelerator."""

    name: str
    tflops: float  # sustained dense bf16 matmul TFLOP/s
    link_gbps: float  # host link, pinned memory, GB/s per direction
    memory_gib: float  # device memory a training step can use
    memory_tbps: float  # device memory bandwidth, TB/s (datasheet)
    source: str  # where the numbers come from


# Vendor datasheet figures are derated to what a sustained workload gets, using the ratios our
# H200 showed: 789 of 989 dense bf16 TFLOP/s on an 8192^3 matmul (0.80), 55 of 64 GB/s per
# direction on PCIe gen 5 x16 (0.86), and 139 of 140.4 GiB usable (about 1.4 GiB to the CUDA
# context and allocator).
DATASHEET_COMPUTE_DERATING = 0.80
DATASHEET_LINK_DERATING = 0.86
RESERVED_GIB = 1.4


def _from_datasheet(name: str, tflops: float, link_gbps: float, memory_mib: int, memory_tbps: float, what: str):
    """A device preset from vendor figures, derated as above."""
    return Device(
        name,
        round(tflops * DATASHEET_COMPUTE_DERATING),
        round(link_gbps * DATASHEET_LINK_DERATING, 1),
        round(memory_mib / 1024 - RESERVED_GIB, 1),
        memory_tbps,
        f"datasheet ({what}), derated",
    )


DEVICES = {
    "h200": Device(
        "h200",
        789.0,
        55.0,
        139.0,
        4.8,
        "measured on our H200: bf16 8192^3 matmul, pinned copies each way, 143771 MiB total; "
        "memory bandwidth from the datasheet",
    ),
    "h100-80gb": _from_datasheet(
        "h100-80gb", 989.4, 64, 81559, 3.35, "H100 SXM 80GB: 989 TFLOP/s bf16 dense, PCIe gen 5 x16, 81559 MiB"
    ),
    "a100-80gb": _from_datasheet(
        "a100-80gb", 312, 32, 81920, 2.04, "A100 80GB: 312 TFLOP/s bf16 dense, PCIe gen 4 x16, 81920 MiB"
    ),
    "a100-40gb": _from_datasheet(
        "a100-40gb", 312, 32, 40960, 1.56, "A100 40GB: 312 TFLOP/s bf16 dense, PCIe gen 4 x16, 40960 MiB"
    ),
    "l40s": _from_datasheet("l40s", 362, 32, 46068, 0.864, "L40S: 362 TFLOP/s bf16 dense, PCIe gen 4 x16, 46068 MiB"),
    "rtx4090": _from_datasheet(
        "rtx4090",
        165.2,
        32,
        24564,
        1.008,
        "RTX 4090: 165 TFLOP/s bf16 dense with fp32 accumulate, PCIe gen 4 x16, 24564 MiB",
    ),
}

# A whole training step does not run at the matmul rate: norms, rotary, activations, casts and
# kernel gaps sit between the matmuls. On the H200, the step FLOPs counted by `step_flops` ran at
# 0.50-0.55 of the 789 TFLOP/s matmul rate for 1B full fine-tuning and 8B LoRA (docs/estimate.md);
# 0.54 is the value that fits all ten H200 step times best together with the LoRA term below.
STEP_EFFICIENCY = 0.54
# PEFT's fp32 adapters on a bf16 model cast inputs and outputs and add in fp32 around every
# linear layer: memory-bound work that grows with tokens, not with FLOPs. Fitted on the H200:
# 0.25 us per token, layer and pass (forward, recompute, and backward counted twice), which at its
# 4.8 TB/s is the time to move this many bytes; other devices scale by their memory bandwidth.
LORA_BYTES_PER_TOKEN_LAYER_PASS = 1.2e6
# FlashAttention's backward runs five sequence-by-sequence matmuls against the forward's two.
ATTENTION_BACKWARD_FACTOR = 2.5


@dataclass(frozen=True)
class StepFlops:
    matmul: float  # projections, MLP, lm_head, LoRA adapters
    attention: float  # causal QK^T and PV, forward, backward and recompute
    layer_forward: float  # one decoder layer's forward (matmul and attention)
    layer_backward: float  # one decoder layer's backward, with its recompute under checkpointing
    lora_passes: int  # passes over each layer that run LoRA adapters (backward counts twice)

    @property
    def total(self) -> float:
        return self.matmul + self.attention


def step_flops(
    shape: Shape,
    *,
    seq_len: int,
    batch_size: int = 1,
    checkpointing: bool = False,
    lora_rank: int | None = None,
) -> StepFlops:
    """FLOPs of one training step. Matmuls: 2 per weight per token in forward; backward computes
    input gradients (as many again) and, for trainable weights, weight gradients (as many again),
    so LoRA's frozen projections and lm_head cost 1x forward in backward, full fine-tuning 2x.
    Causal attention: `2 x seq_len^2 x heads x head_dim` per layer and sequence in forward (half
    of QK^T and PV are masked), `ATTENTION_BACKWARD_FACTOR` times that in backward. Checkpointing
    recomputes each layer's forward (not lm_head's) once."""
    tokens = seq_len * batch_size
    q = shape.heads * shape.head_dim
    backward_factor = 2 if lora_rank is None else 1
    layer_matmul = 2 * shape.layer_parameters * tokens
    adapters = 0 if lora_rank is None else 2 * shape.lora_parameters(lora_rank) // shape.layers * tokens
    layer_attention = 2 * batch_size * seq_len * seq_len * q
    layer_forward = layer_matmul + adapters + layer_attention
    layer_backward = backward_factor * layer_matmul + 2 * adapters + ATTENTION_BACKWARD_FACTOR * layer_attention
    if checkpointing:
        layer_backward += layer_forward
    head = 2 * shape.vocab * shape.hidden * tokens * (1 + backward_factor)
    recompute = 1 if checkpointing else 0
    matmul = shape.layers * (layer_matmul * (1 + backward_factor + recompute) + adapters * (3 + recompute)) + head
    attention = shape.layers * layer_attention * (1 + ATTENTION_BACKWARD_FACTOR + recompute)
    return StepFlops(
        matmul=matmul,
        attention=attention,
        layer_forward=layer_forward,
        layer_backward=layer_backward,
        lora_passes=0 if lora_rank is None else 3 + recompute,
    )


@dataclass(frozen=True)
class StepTime:
    flops: StepFlops
    compute_seconds: float  # the FLOPs at the effective rate
    lora_seconds: float  # the adapters' memory-bound overhead
    effective_tflops: float

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.lora_seconds


def step_time(
    shape: Shape,
    *,
    seq_len: int,
    batch_size: int = 1,
    checkpointing: bool = False,
    lora_rank: int | None = None,
    lora_dtype_bytes: int | None = None,
    dtype_bytes: int = 2,
    tflops: float = DEVICES["h200"].tflops,
    efficiency: float = STEP_EFFICIENCY,
    memory_tbps: float = DEVICES["h200"].memory_tbps,
) -> StepTime:
    """Seconds of compute for one training step, offloading copies not included: the step's
    FLOPs at `tflops x efficiency` (`tflops`: the device's sustained dense matmul rate), plus, for
    LoRA with adapters in a wider dtype than the model (PEFT's default fp32), their memory-bound
    overhead at `memory_tbps`."""
    if not tflops > 0 or not memory_tbps > 0:
        raise ValueError(f"tflops and memory_tbps must be > 0, got {tflops} and {memory_tbps}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    flops = step_flops(shape, seq_len=seq_len, batch_size=batch_size, checkpointing=checkpointing, lora_rank=lora_rank)
    rate = tflops * 1e12 * efficiency
    mixed_adapters = lora_rank is not None and (lora_dtype_bytes or dtype_bytes) != dtype_bytes
    lora_bytes = (
        LORA_BYTES_PER_TOKEN_LAYER_PASS * seq_len * batch_size * shape.layers * flops.lora_passes
        if mixed_adapters
        else 0.0
    )
    return StepTime(flops, flops.total / rate, lora_bytes / (memory_tbps * 1e12), rate / 1e12)


# ---------------------------------------------------------------------------------------------
# The per-layer view: what offloading moves and whether its copies hide
# ---------------------------------------------------------------------------------------------


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
    link_gbps: float = DEVICES["h200"].link_gbps,
    tflops: float = DEVICES["h200"].tflops,
    efficiency: float = STEP_EFFICIENCY,
) -> Estimate:
    """Activation bytes per layer and in total, device memory saved, host memory needed, and
    whether one layer's copies fit in one layer's compute (`link_gbps` per direction, GB/s;
    `tflops`, the sustained matmul rate, run at `efficiency`)."""
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
    flops = step_flops(shape, seq_len=seq_len, batch_size=batch_size, checkpointing=checkpointing, lora_rank=lora_rank)
    link = link_gbps * 1e9
    compute = tflops * 1e12 * efficiency
    return Estimate(
        shape=shape,
        tokens=tokens,
        layer_bytes=layer_bytes,
        total_bytes=layer_bytes * shape.layers,
        offloaded_bytes=layer_bytes * offloaded_layers,
        peak_without=layer_bytes * shape.layers,
        peak_with=layer_bytes * resident_layers,
        forward_copy_seconds=layer_bytes / link,
        forward_compute_seconds=flops.layer_forward / compute,
        backward_copy_seconds=layer_bytes / link,
        backward_compute_seconds=flops.layer_backward / compute,
    )


def _require_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def format_estimate(result: Estimate, *, link_gbps: float, tflops: float) -> str:
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
        ]
    )


def format_budget_plan(result: Estimate, *, budget_bytes: int, keep_last_layers: int, prefetch_layers: int) -> str:
    """What hf_offload's device-memory budget (`max_device_bytes`) does with this step: the plan
    the engine would make from these per-layer bytes (engine/planner.py, the same function)."""
    from hf_offload.engine.planner import plan  # the engine imports no transformers either

    layers = result.shape.layers
    offloadable = max(layers - keep_last_layers, 0)
    layer_bytes = [result.layer_bytes] * layers
    chosen = plan(layer_bytes, budget_bytes, offloadable_layers=offloadable, prefetch_layers=prefetch_layers)
    kept = offloadable - chosen.offloaded_layers
    line = (
        f"device-memory budget {gib(budget_bytes)} (max_device_bytes={budget_bytes}): offloads the first "
        f"{chosen.offloaded_layers} of {offloadable} offloadable layers and keeps {kept} on the device for the budget; "
        f"decoder-layer activations on the device at most {gib(chosen.predicted_peak_bytes)}"
    )
    if not chosen.fits:
        line += " - more than the budget: even full offloading needs that much, so every layer is offloaded"
    return line


def format_devices() -> str:
    """The `--device` presets as a markdown table."""
    lines = [
        "| device | sustained bf16 matmul TFLOP/s | host link GB/s per direction | usable memory GiB "
        "| memory TB/s | source |",
        "|---|---|---|---|---|---|",
    ]
    for device in DEVICES.values():
        lines.append(
            f"| {device.name} | {device.tflops:g} | {device.link_gbps:g} | {device.memory_gib:g} "
            f"| {device.memory_tbps:g} | {device.source} |"
        )
    lines.append(
        f"Datasheet figures are derated to the H200's measured ratios: compute x{DATASHEET_COMPUTE_DERATING:g}, "
        f"host link x{DATASHEET_LINK_DERATING:g}, memory less {RESERVED_GIB:g} GiB."
    )
    return "\n".join(lines)


def format_assumptions(
    device: Device,
    *,
    default: bool,
    tflops: float | None = None,
    link_gbps: float | None = None,
    efficiency: float | None = None,
) -> str:
    """Which rates the time lines assumed and where each came from; `None` means the device's."""
    note = " (the default: --device to choose one, --list-devices for all)" if default else ""
    lines = [
        f"assumed device: {device.name}{note}: {device.tflops:g} TFLOP/s sustained bf16 matmul, "
        f"{device.link_gbps:g} GB/s host link per direction, {device.memory_gib:g} GiB usable, "
        f"{device.memory_tbps:g} TB/s memory",
        f"  source: {device.source}",
    ]
    if tflops is not None:
        lines.append(f"  matmul rate: {tflops:g} TFLOP/s, given with --tflops")
    if link_gbps is not None:
        lines.append(f"  host link: {link_gbps:g} GB/s, given with --link-gbps")
    if efficiency is None:
        lines.append(f"  step efficiency: {STEP_EFFICIENCY:g} of the matmul rate, fitted to the H200's step times")
    else:
        lines.append(f"  step efficiency: {efficiency:g}, given with --efficiency")
    return "\n".join(lines)


def format_step_peaks(peaks: list[StepPeak], fixed: Fixed) -> str:
    lines = [f"{'mode':<26}{'peak GiB':>10}{'MB/token':>10}  {'peak phase':<22}at long lengths"]
    for peak in peaks:
        long = peak.long_phase
        lines.append(
            f"{peak.mode:<26}{peak.peak_bytes / 2**30:>10.2f}{peak.per_token_bytes / 1e6:>10.3f}  "
            f"{peak.phase.name:<22}{long.per_token_bytes / 1e6:.3f} MB/token, {long.name}"
        )
    lines.append(
        f"(fixed part: weights {gib(fixed.weights)}, gradients {gib(fixed.gradients)}, "
        f"optimizer state {gib(fixed.optimizer)})"
    )
    return "\n".join(lines)


def format_max_seq_lens(
    lengths: dict[str, tuple[int, int]], *, memory_bytes: float, fixed: Fixed, batch_size: int
) -> str:
    """`lengths`: mode -> (longest sequence with the standard loss, with a fused loss)."""
    lines = [
        f"longest sequence that fits in {memory_bytes / 2**30:.2f} GiB (batch {batch_size}), predicted:",
        f"{'mode':<26}{'standard loss':>15}{'fused loss':>12}",
    ]
    for mode, (standard, fused) in lengths.items():
        lines.append(f"{mode:<26}{standard:>15}{fused:>12}")
    if fixed.total >= memory_bytes:
        lines.append(f"nothing fits: weights, gradients and optimizer state alone need {gib(fixed.total)}")
    return "\n".join(lines)
