"""Where the simulated step, on the meta device, must be told what a real GPU would do.

- SDPA on meta tensors takes the math path, which materialises the sequence-by-sequence
  attention weights. `attention_as_on_cuda` has `torch.nn.functional.scaled_dot_product_attention`
  call the kernel CUDA's dispatch picks instead (flash attention, or the memory-efficient one
  where flash cannot run): the CUDA op itself, whose meta kernel gives its outputs (the output
  and a float32 log-sum-exp per head and token), and whose backward autograd saves and runs as
  on a GPU. (The function is replaced rather than intercepted by a TorchFunctionMode: those are
  not active in backward, where a checkpoint recomputes its layer.)
- transformers' masking cannot look at position ids without data: `find_packed_sequence_indices`
  asks whether they restart inside a row. On a GPU, an unpadded batch of one sequence per row
  answers no, and the causal kernel runs without a mask; `real_device_masking` answers the same.
  (Unanswered, a mask of sequence x sequence is built: 12 GiB at 64k tokens.)
- Liger's fused linear cross-entropy is Triton, which runs nothing on meta tensors.
  `SimulatedFusedLinearCrossEntropy` makes the allocations Liger 0.8.5's
  `fused_linear_cross_entropy_forward` makes on CUDA, in the same order, without computing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def attention_as_on_cuda() -> Iterator[None]:
    """`scaled_dot_product_attention` as CUDA dispatches it on a recent GPU: flash attention for
    half precision without a mask (grouped-query attention included) and head dims up to 256;
    else the memory-efficient kernel, which takes a mask and float32 but not grouped-query
    attention; else the math path, as there."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        grouped = key.shape[-3] != query.shape[-3]
        if query.dtype in _FLASH_DTYPES and attn_mask is None and query.shape[-1] <= 256 and query.is_meta:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if not grouped and query.is_meta:
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
            )[0]
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


@contextlib.contextmanager
def real_device_masking() -> Iterator[None]:
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class SimulatedFusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's `LigerFusedLinearCrossEntropyFunction` (0.8.5, mean or sum reduction, as its
    causal-LM forward calls it), for meta tensors only: the loss and both gradients are produced
    in forward, a chunk of tokens at a time, through one reused logits buffer of
    `next_power_of_2(ceil(tokens / ceil(vocab / hidden)))` rows; backward scales the saved
    gradients in place. On CUDA Liger writes each chunk's logits, the gradient of the input and
    that of the weight with `out=` matmuls and in-place kernels, so those allocate nothing."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias=None, ce_weight=None, ignore_index=-100, *options):
        if not hidden.is_meta:
            raise RuntimeError("the simulated fused linear cross-entropy computes nothing: meta tensors only")
        tokens, width = hidden.shape
        vocab = weight.shape[0]
        chunk = min(_next_power_of_2(math.ceil(tokens / math.ceil(vocab / width))), tokens)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
        losses = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        counted = target != ignore_index
        logits = torch.empty((chunk, vocab), dtype=hidden.dtype, device=hidden.device)
        for start in range(0, tokens, chunk):
            rows = slice(start, min(start + chunk, tokens))
            block = logits[: rows.stop - rows.start]
            torch.mm(hidden[rows], weight.t(), out=block)
            torch.mm(block, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight.addmm_(block.t(), hidden[rows])
        del logits, counted
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return losses.sum(), None, None, None

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        for gradient in (grad_hidden, grad_weight, grad_bias):
            if gradient is not None:
                gradient.mul_(grad_loss)
        return (grad_hidden, grad_weight, None, grad_bias) + (None,) * (len(ctx.needs_input_grad) - 4)


@contextlib.contextmanager
def simulated_liger_loss() -> Iterator[None]:
    """Liger's causal-LM forwards call its fused linear cross-entropy through this module global."""
    import liger_kernel.transformers.functional as liger_functional

    original = liger_functional.LigerFusedLinearCrossEntropyFunction
    liger_functional.LigerFusedLinearCrossEntropyFunction = SimulatedFusedLinearCrossEntropy
    try:
        yield
    finally:
        liger_functional.LigerFusedLinearCrossEntropyFunction = original
