"""4-bit bases (bitsandbytes' QLoRA layers) in the simulated step.

The model is quantized on the meta device as `from_pretrained(..., quantization_config=
BitsAndBytesConfig(load_in_4bit=True, ...))` quantizes it on a GPU: transformers' own quantizer
replaces the linear layers (not lm_head) by bitsandbytes' `Linear4bit`, and each weight, made in
the model's dtype as a checkpoint would load it, goes through transformers' `Bnb4bitQuantize` and
bitsandbytes' `Params4bit._quantize`, whose `quantize_4bit` runs on meta tensors (bitsandbytes
registers fake kernels for its ops): the packed weight (uint8, half a byte per parameter) and its
statistics (a float32 absmax per block of 64; with double quantization a uint8 absmax per block,
quantized again in blocks of 256 with a float32 absmax, the 256-entry code and the offset) are
the tensors a GPU holds. `quantized_state_tensors` names the statistics, which are no parameters
or buffers, so that the simulator counts them as weights.

The step runs bitsandbytes' `Linear4bit.forward` (the input cast to `bnb_4bit_compute_dtype`,
the output back to the input's dtype), `matmul_4bit` and `MatMul4Bit` as they are: in forward
`MatMul4Bit` saves only the packed weight; in backward it dequantizes the weight again
(`functional.dequantize_4bit`, nested statistics first) in the weight's dtype, casts it to the
gradient's and multiplies. Those ops' fake kernels allocate what the CUDA kernels allocate: their
outputs. One op does more on a GPU than its fake kernel says:

- `bitsandbytes::gemm_4bit` (the forward's product). Its fake kernel makes only the output. On
  CUDA (bitsandbytes 0.50, `backends/cuda/ops.py`), a product of more than 1536 rows (every
  training step of a useful length; also each of tiling's slices) takes `_dequant_linear_fallback`:
  with double quantization the statistics dequantized to float32 (`absmax_dq`) and offset (a
  second float32 array), the weight dequantized into a new tensor of the compute dtype, then
  `F.linear`. `dequantizing_gemm` stands in for the op on meta tensors with those steps, in that
  order, through bitsandbytes' own ops, so the tracker counts each allocation (and the matmul's
  FLOPs). Below 1537 rows CUDA may pick a fused kernel that allocates only the output (chosen per
  architecture); the stand-in dequantizes there too, overstating such a step by one dequantized
  weight. (The CPU's default backend dequantizes at every size, as the stand-in does.)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hf_offload.internal import replaced, resolve

QUANT_TYPES = ("fp4", "nf4")
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FourBit:
    """A base model loaded in 4 bits, as `BitsAndBytesConfig(load_in_4bit=True, ...)` with these
    fields (defaults: BitsAndBytesConfig's), and the QLoRA recipe's parameter dtypes."""

    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: torch.dtype = torch.float32
    # PEFT's prepare_model_for_kbit_training before LoRA: every parameter that is not 4-bit
    # (norms, embeddings, lm_head) cast to float32. False: they keep the model's dtype.
    prepare_model_for_kbit_training: bool = False

    def __post_init__(self) -> None:
        if self.bnb_4bit_quant_type not in QUANT_TYPES:
            raise ValueError(f"bnb_4bit_quant_type must be one of {QUANT_TYPES}, got {self.bnb_4bit_quant_type!r}")
        if self.bnb_4bit_compute_dtype not in COMPUTE_DTYPES:
            valid = ", ".join(str(d).removeprefix("torch.") for d in COMPUTE_DTYPES)
            raise ValueError(f"bnb_4bit_compute_dtype must be one of {valid}, got {self.bnb_4bit_compute_dtype}")

    def config(self):
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=self.bnb_4bit_use_double_quant,
            bnb_4bit_compute_dtype=self.bnb_4bit_compute_dtype,
        )

    def describe(self) -> str:
        """"4-bit nf4 base, double quantization, bfloat16 compute"."""
        double = "double quantization" if self.bnb_4bit_use_double_quant else "no double quantization"
        compute = str(self.bnb_4bit_compute_dtype).removeprefix("torch.")
        prepared = (
            ", prepare_model_for_kbit_training (the rest in float32)"
            if self.prepare_model_for_kbit_training
            else ""
        )
        return f"4-bit {self.bnb_4bit_quant_type} base, {double}, {compute} compute{prepared}"


def quantize(model: torch.nn.Module, four_bit: FourBit, dtype: torch.dtype) -> torch.nn.Module:
    """`model` (built in `dtype`, on the meta device or a real one) with its linear layers in 4 bits,
    as from_pretrained with the BitsAndBytesConfig leaves it (module docstring); then, with
    `prepare_model_for_kbit_training`, PEFT's preparation. On a real device each weight is random
    before it is quantized there (the GPU benchmark: no checkpoint is read)."""
    import bitsandbytes as bnb
    from transformers.quantizers import AutoHfQuantizer

    Bnb4bitQuantize = resolve("transformers.bnb_quantize")  # noqa: N806 (a class)
    name2qmap = resolve("bitsandbytes.name2qmap")
    resolve("bitsandbytes.params4bit_quantize")

    device = next(model.parameters()).device
    config = four_bit.config()
    # As from_pretrained records it, on a copy: the caller's config stays unquantized.
    model.config = copy.deepcopy(model.config)
    model.config.quantization_config = config
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    quantizer.preprocess_model(model=model, dtype=dtype, device_map={"": str(device)})
    convert = Bnb4bitQuantize(quantizer)
    # bitsandbytes caches the 8-bit code of double quantization in a process-wide dict, on the
    # device of its first use, and copies it from there at every later use: made on meta, it would
    # break the next real quantization in this process. Left as it was found.
    cached = dict(name2qmap)
    try:
        for name, module in model.named_modules():
            if not isinstance(module, bnb.nn.Linear4bit):
                continue
            # What a checkpoint's weight is when it reaches the quantizer: the layer's shape, the model's dtype.
            loaded = torch.empty(module.weight.shape, dtype=dtype, device=device).normal_(std=0.02)
            key = f"{name}.weight"
            (weight,) = convert.convert({key: [loaded]}, model=model, full_layer_name=key).values()
            if not weight.bnb_quantized:  # Params4bit quantizes when moved to a device, which meta is not to it
                weight = weight._quantize(device)
            module.weight = weight
            module.weight.module = module
    finally:
        if device.type == "meta":
            name2qmap.clear()
            name2qmap.update(cached)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    if four_bit.prepare_model_for_kbit_training:
        from peft import prepare_model_for_kbit_training

        # Checkpointing is the mode's to set; prepare's default (use_gradient_checkpointing=True)
        # also makes the embeddings' output require grad, which is kept.
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model.enable_input_require_grads()
    return model


def four_bit_of(model: torch.nn.Module) -> tuple[FourBit, torch.dtype] | None:
    """The 4-bit base a loaded model is (its BitsAndBytesConfig, and whether PEFT's preparation put
    its other parameters in float32), and the dtype its weights were loaded in; None if it is not."""
    import sys

    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if not getattr(model, "is_loaded_in_4bit", False) or config is None or "bitsandbytes" not in sys.modules:
        return None
    import bitsandbytes as bnb

    quantized = next((m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)), None)
    loaded = getattr(getattr(quantized, "weight", None), "quant_state", None)
    embeddings = model.get_input_embeddings().weight.dtype
    if loaded is None:
        return None
    prepared = embeddings == torch.float32 and loaded.dtype != torch.float32
    four_bit = FourBit(config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant, config.bnb_4bit_compute_dtype,
                       prepare_model_for_kbit_training=prepared)  # fmt: skip
    return four_bit, loaded.dtype


def quantized_state_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The statistics of every 4-bit weight (absmax; with double quantization the nested absmax,
    its code and the offset; the 4-bit code): device memory that is no parameter or buffer."""
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        while state is not None:
            for value in (state.absmax, state.code, state.offset):
                if isinstance(value, torch.Tensor):
                    yield value
            state = state.state2


def _dequantize_then_linear(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None,
                            absmax_code=None, absmax_offset=None):  # fmt: skip
    """`bitsandbytes::gemm_4bit` as CUDA runs it past 1536 rows (`_dequant_linear_fallback`), in
    bitsandbytes' ops: the nested statistics to float32 and offset, the weight dequantized to the
    input's dtype, `F.linear`."""
    if absmax_8bit is not None:
        absmax_dq = torch.ops.bitsandbytes.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256,
                                                                        torch.float32)  # fmt: skip
        absmax = absmax_dq + absmax_offset
    weight = torch.ops.bitsandbytes.dequantize_4bit.default(B, absmax, blocksize, quant_type, list(shapeB), A.dtype)
    return torch.nn.functional.linear(A, weight, bias)


class _Gemm4bit:
    """Stands for the `torch.ops.bitsandbytes.gemm_4bit` packet bitsandbytes calls: meta tensors
    dequantize and multiply (`_dequantize_then_linear`), others run the op."""

    def __init__(self, packet) -> None:
        self.packet = packet

    def default(self, A, *args, **kwargs):
        if A.is_meta:
            return _dequantize_then_linear(A, *args, **kwargs)
        return self.packet.default(A, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.packet, name)


@contextlib.contextmanager
def dequantizing_gemm() -> Iterator[None]:
    """Within this block bitsandbytes' 4-bit product on meta tensors dequantizes the weight and
    multiplies, as CUDA's does (module docstring). The op is replaced where bitsandbytes looks it
    up, `torch.ops.bitsandbytes`, rather than intercepted by a dispatch mode: what a kernel
    allocates inside the dispatcher is below any mode, and the tracker would see only its output."""
    import bitsandbytes  # noqa: F401 (registers its ops)

    with replaced("bitsandbytes.gemm_4bit", _Gemm4bit(resolve("bitsandbytes.gemm_4bit"))):
        yield
