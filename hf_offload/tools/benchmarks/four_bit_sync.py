"""What vLLM would read after TRL 1.16 syncs a merged 4-bit policy into it (docs/trl.md, "vLLM's
releases and a 4-bit policy"), on the CPU with bitsandbytes:

    python -m hf_offload.tools.benchmarks.four_bit_sync

TRL merges the LoRA adapters (PEFT re-quantizes each merged weight with the trainer's own
`Params4bit` settings: its quant type, its double quantization) and hands vLLM each weight's
`param.data`, the packed 4-bit codes only: the absmax and the code book stay behind in the
trainer's `quant_state`. vLLM's copy keeps the state its own loader made when it quantized the
checkpoint (nf4, double quantization: cited from vLLM's bitsandbytes loader, not installed here).
This dequantizes the synced codes with that state and compares them with the merged weight the
trainer holds.
"""

from __future__ import annotations

import torch


def read_back_error(train_type: str, double_quant: bool, *, seed: int = 0) -> float:
    """The relative error of the merged weight as vLLM would read it (the synced codes, its own state)."""
    import bitsandbytes.functional as F

    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(256, 512, generator=generator) * 0.02).to(torch.bfloat16)
    delta = torch.randn(256, 8, generator=generator) @ torch.randn(8, 512, generator=generator) * 1e-3
    _, vllm_state = F.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
    packed, state = F.quantize_4bit(weight, quant_type=train_type, compress_statistics=double_quant)
    merged = (F.dequantize_4bit(packed, state).float() + delta).to(torch.bfloat16)
    synced, merged_state = F.quantize_4bit(merged, quant_type=train_type, compress_statistics=double_quant)
    right = F.dequantize_4bit(synced, merged_state).float()
    read = F.dequantize_4bit(synced, vllm_state).float()
    return ((read - right).norm() / right.norm()).item()


def main() -> int:
    for train_type, double_quant in (("fp4", False), ("fp4", True), ("nf4", True), ("nf4", False)):
        error = read_back_error(train_type, double_quant)
        print(f"trainer {train_type}, double quant {double_quant}: vLLM reads the synced codes {error:.1%} off")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
