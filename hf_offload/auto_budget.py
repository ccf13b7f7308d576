"""What `max_device_bytes="auto"` needs at run time: the device's free memory, and a small pure
prediction of what a step needs on the device beyond the decoder layers' saved activations.

The prediction is deliberately small: the larger of the loss head's peak and one decoder layer's
full activations (its working memory, and the layer a checkpoint recomputes in backward), per
token, from the model's config. `hf-offload estimate` simulates whole steps instead
(docs/estimate.md); its tests hold the plan "auto" makes with this prediction to the simulated
step at 8B (tests/test_simulator.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# Left free by max_device_bytes="auto": a share of the device's memory for the allocator's
# fragmentation, kernels' workspaces and what the step allocates outside the decoder layers.
AUTO_BUDGET_MARGIN_SHARE = 0.05

FP32 = 4

# Set by `simulated_device`: the memory simulator's device, read instead of an accelerator's.
_simulated: list[Callable[[], tuple[int, int]]] = []


@contextlib.contextmanager
def simulated_device(read: Callable[[], tuple[int, int]]) -> Iterator[None]:
    """Within this block, "auto" reads (free bytes, total bytes) from `read()`: the memory
    simulator (`hf-offload estimate`) runs steps on the meta device, with a device memory of its own."""
    _simulated.append(read)
    try:
        yield
    finally:
        _simulated.remove(read)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(bytes a step can still take, total bytes) of `device`: the driver's free memory plus what
    torch's caching allocator holds unused (that is free to the step too)."""
    if _simulated:
        return _simulated[-1]()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        available = free + torch.cuda.memory_reserved(device) - allocated
        # A process capped with torch.cuda.set_per_process_memory_fraction gets no more than that.
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
        if fraction < 1.0:
            available = min(available, int(total * fraction) - allocated)
        return available, total
    free, total = torch.accelerator.get_memory_info(device)
    return free + torch.accelerator.memory_reserved(device) - torch.accelerator.memory_allocated(device), total


def total_device_memory(device: torch.device) -> int | None:
    """The total memory of `device` (the simulated device's, an accelerator's); None for the CPU
    and where it cannot be read."""
    if _simulated:
        return _simulated[-1]()[1]
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type in ("cpu", "meta") or not hasattr(torch.accelerator, "get_memory_info"):
        return None
    return torch.accelerator.get_memory_info(device)[1]


def check_device_memory_readable() -> None:
    """max_device_bytes="auto" needs the accelerator's free memory at every step: fail at enable
    time, where it cannot be read, rather than in the middle of training. Nothing is asked of the
    device itself here (that would create a CUDA context on the current device, GPU 0 for every
    rank of a torchrun job that enables before choosing its device): the first step reads the
    memory, on the layers' own device."""
    if _simulated:
        return
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        raise ValueError(
            "option max_device_bytes='auto' reads the accelerator's free memory at every step, and no "
            "accelerator is available here (torch.accelerator.is_available() is False); pass a number of "
            "bytes, or None to offload every layer"
        )
    if accelerator.type != "cuda" and not hasattr(torch.accelerator, "get_memory_info"):
        raise ValueError(
            f"option max_device_bytes='auto' cannot read the free memory of {accelerator.type} devices with "
            f"torch {torch.__version__} (no torch.accelerator.get_memory_info); pass a number of bytes, or None "
            "to offload every layer"
        )


@dataclass(frozen=True)
class LayerShape:
    """The numbers of a decoder-only config that decide the loss head's and one layer's memory."""

    model_type: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> LayerShape:
        """From a transformers config or its dict; composite models through `text_config`. The
        feed-forward width has many names (and none in GPT-2, Bloom or Falcon, whose width is the
        classic four times the hidden size); models without attention (Mamba, RWKV) have no heads."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        config = getattr(config, "text_config", None) or config
        if not isinstance(config, dict) and not _attribute(config, "hidden_size"):
            # A byte-latent model (BLT): its decoder's sizes.
            config = getattr(config, "decoder_config", None) or config
        get = config.get if isinstance(config, dict) else lambda key, default=None: _attribute(config, key, default)
        hidden = get("hidden_size")
        heads = get("num_attention_heads") or 0
        intermediate = next((get(name) for name in _FEED_FORWARD_NAMES if get(name)), None)
        if isinstance(intermediate, (list, tuple)):
            intermediate = max(intermediate)
        if not intermediate and hidden:
            intermediate = int((get("expansion_ratio") or get("mlp_ratio") or 4) * hidden)
        shape = cls(
            model_type=str(get("model_type", "")),
            hidden=hidden,
            intermediate=intermediate,
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or (hidden // heads if hidden and heads else 0),
            vocab=get("vocab_size"),
        )
        needed = ("hidden", "intermediate", "vocab")
        missing = [name for name in needed if not isinstance(getattr(shape, name), int) or getattr(shape, name) <= 0]
        if missing:
            raise ValueError(f"config of model_type {shape.model_type!r} has no usable {', '.join(missing)}")
        return shape


# Where configs keep the feed-forward width, in the order tried.
_FEED_FORWARD_NAMES = (
    "intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "d_ff", "d_inner",
    "dim_feedforward", "intermediate_size_mlp", "moe_intermediate_size",
)  # fmt: skip


def _attribute(config, key: str, default=None):
    """A config's attribute; a per-layer one that differs between layers (Gemma 4's head_dim)
    reads as its largest value, and a missing one as `default`."""
    try:
        value = getattr(config, key, default)
    except Exception:  # noqa: BLE001 - transformers refuses a global read of a per-layer attribute
        values = [getattr(layer, key, None) for layer in getattr(config, "layer_configs", None) or []]
        values = [v for v in values if isinstance(v, int)]
        return max(values) if values else default
    return value


def layer_bytes_per_token(shape: LayerShape, *, dtype_bytes: int) -> int:
    """What one Llama-style decoder layer (RMSNorm, SDPA with grouped-query attention, gated MLP)
    saves per token in full fine-tuning: both norms' float32 inputs and outputs, the inputs of
    the projections, q, k, v, the attention output and its float32 log-sum-exp, and the MLP's
    four intermediate tensors."""
    e, d, f = dtype_bytes, shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = e * (2 * q + 2 * kv) + FP32 * shape.heads
    norm_output = FP32 * d if shape.model_type.startswith("gemma") else e * d
    norm = FP32 * d + FP32 + norm_output
    return 2 * norm + 2 * e * d + attention + 4 * e * f


def loss_head_bytes_per_token(shape: LayerShape, *, dtype_bytes: int, fused: bool = False) -> int:
    """The loss head's peak per token beyond the layers' activations. transformers' loss: inside
    `log_softmax`'s backward, three float32 tensors of vocabulary size (its saved output, the
    gradient coming in, the gradient going out). A fused linear cross-entropy (Liger's) holds the
    input hidden states, the input gradient it computes in forward, a chunk's logits (at most
    `2 x hidden` elements per token) and a few bytes of loss, mask and target per token."""
    if fused:
        e, d = dtype_bytes, shape.hidden
        return 4 * e * d + FP32 + 1 + 8
    return 3 * FP32 * shape.vocab


def predicted_step_bytes(config, *, dtype: torch.dtype, tokens: int, fused_loss: bool) -> int:
    """Device bytes a step of `tokens` tokens needs beyond the decoder layers' saved activations,
    the weights and the gradients: the larger of the loss head's peak and one layer's full
    activations. The two are never live together: backward is through the loss head, whose
    tensors are then freed, before the first layer's backward (or a checkpoint's recompute)."""
    shape = LayerShape.from_config(config)
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    layer = layer_bytes_per_token(shape, dtype_bytes=dtype_bytes)
    head = loss_head_bytes_per_token(shape, dtype_bytes=dtype_bytes, fused=fused_loss)
    return tokens * max(layer, head)
