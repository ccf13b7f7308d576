"""Stand-ins for the GPU kernels of hybrid models' linear-attention layers (Qwen3.5, Qwen3-Next).

transformers' Gated DeltaNet layer calls two module functions, `torch_chunk_gated_delta_rule` and
`causal_conv1d_fn`, wrapped by `use_kernel_func_from_hub_with_fallback`: on CUDA, when
flash-linear-attention ("fla") and causal-conv1d are installed, they run those libraries' Triton
and CUDA kernels; on any other device (the CPU, meta) the PyTorch reference code, which chunks the
sequence in a Python loop, keeps float32 copies and (B, heads, chunks, 64, 64) decay matrices, and
pads the convolution: other allocations than the GPU's, and a loop of T / 64 steps per layer.

Here the two module functions are replaced, for meta tensors only, by autograd functions that make
the allocations the kernels' own Python code makes on CUDA, in the same order, without computing:

- `SimulatedChunkGatedDeltaRule`: fla 0.6.0's `ChunkGatedDeltaRuleFunction`
  (fla/ops/gated_delta_rule/chunk.py) as transformers calls it (qk l2-normalised in the kernel, no
  packed sequences, chunks of 64). Forward: `input_guard` makes the inputs contiguous (its copies live
  through the forward); `l2norm_fwd`
  (fla/modules/norm/l2norm.py) a normalised q and k and a float32 rstd per token and head;
  `chunk_local_cumsum` a float32 g; `chunk_gated_delta_rule_fwd_intra` A (B, T, HV, 64), and
  `recompute_w_u_fwd` (wy_fast.py) w (B, T, HV, K) and u like v; `chunk_gated_delta_rule_fwd_h`
  (common/chunk_delta_h.py) the chunk states h (B, ceil(T / 64), HV, K, V) and v_new like u;
  `chunk_fwd_o` (common/chunk_o.py) o like v. Saved: q, q_rstd, k, k_rstd, v, g, beta, A; w, u, h
  and v_new go when the forward returns. Backward (`chunk_gated_delta_rule_bwd`): w, u, h and v_new
  again, dv like do (`chunk_bwd_dv_local`), dh like h and a second dv (`chunk_gated_delta_rule_bwd_dhu`),
  dq and dk (B, T, HV, K), dg (NK, B, T, HV) float32 and dw like w (`chunk_bwd_dqkwg`, dq and dk summed
  to H heads and dg over NK), dk2, dv, dg, db (`prepare_wy_repr_bwd`), the reversed cumsum of dg;
  all of that lives until the function returns; then `l2norm_bwd` allocates dq and dk again.
  Approximated: NK (the key blocks of `chunk_bwd_dqkwg`) from the compute capability as fla picks
  its tiling (128 on sm90 and later, 128 or 64 on sm80 by dtype, else 64); Triton's own scratch
  (none for these kernels) and the autotuner are not counted.
- `SimulatedCausalConv1d`: causal-conv1d 1.7.0's `CausalConv1dFn` (causal_conv1d_interface.py,
  cpp_functions.py): out like x (x made contiguous only when neither its last two strides is 1),
  x and weight saved; backward dx like x, dweight (and dbias) float32, cast to the weight's dtype.
  The silu is fused. Not counted: the deterministic mode's float32 workspaces.

Decode steps (one token, `torch_recurrent_gated_delta_rule`, fla's `fused_recurrent`) keep the
reference code: one token's tensors.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from hf_offload.internal import replaced, resolve

CHUNK = 64  # fla's chunk size for the gated delta rule, as transformers calls it
# The transformers modules whose Gated DeltaNet calls the two functions (inventory entries in
# hf_offload.integrations.upstream, one per module and function).
MODULES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
STAND_INS = (
    "flash-linear-attention 0.6.0's chunk_gated_delta_rule (Triton), as allocated on CUDA",
    "causal-conv1d 1.7.0's causal_conv1d_fn (CUDA), as allocated on CUDA",
)


def key_block_count(head_k_dim: int, dtype: torch.dtype, capability: tuple[int, int]) -> int:
    """NK of fla's `chunk_bwd_dqkwg`: key blocks of BK = min(max(next_power_of_2(K), 16), tiling),
    its tiling 128 on Hopper-class shared memory (sm90+), on sm80 128 for 16-bit tensors else 64,
    else 64 (sm86/sm89: 'ada')."""
    if capability >= (9, 0):
        tiling = 128
    elif capability == (8, 0):
        tiling = 128 if torch.empty((), dtype=dtype).element_size() == 2 else 64
    else:
        tiling = 64
    block = min(max(1 << max(head_k_dim - 1, 0).bit_length(), 16), tiling)
    return math.ceil(head_k_dim / block)


class SimulatedChunkGatedDeltaRule(torch.autograd.Function):
    """fla's `ChunkGatedDeltaRuleFunction` for meta tensors (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, l2norm: bool, initial_state, output_final_state: bool, capability):
        if not q.is_meta:
            raise RuntimeError("the simulated chunk_gated_delta_rule computes nothing: meta tensors only")
        # fla's input_guard: contiguous copies of strided inputs, held in its argument list until the forward returns
        guarded = tuple(t.contiguous() for t in (q, k, v, g, beta))
        q, k, v, g, beta = guarded
        batch, tokens, heads, k_dim = k.shape
        v_heads, v_dim = v.shape[2:]
        chunks = math.ceil(tokens / CHUNK)
        q_rstd = k_rstd = None
        if l2norm:
            q, q_rstd = torch.empty_like(q), torch.empty((batch, tokens, heads), dtype=torch.float32, device=q.device)
            k, k_rstd = torch.empty_like(k), torch.empty((batch, tokens, heads), dtype=torch.float32, device=k.device)
        g = torch.empty_like(g, dtype=torch.float32)  # chunk_local_cumsum
        a = torch.zeros((batch, tokens, v_heads, CHUNK), dtype=k.dtype, device=k.device)
        w = k.new_empty(batch, tokens, v_heads, k_dim)
        u = torch.empty_like(v)
        h = k.new_empty(batch, chunks, v_heads, k_dim, v_dim)
        final = k.new_zeros(batch, v_heads, k_dim, v_dim, dtype=torch.float32) if output_final_state else None
        v_new = torch.empty_like(u)
        o = torch.empty_like(v)
        del w, u, h, v_new
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, a)
        ctx.shape = (batch, tokens, heads, k_dim, v_heads, v_dim, chunks)
        ctx.capability = capability
        ctx.has_initial_state = initial_state is not None
        return o, final

    @staticmethod
    def backward(ctx, do, _dfinal):
        q, q_rstd, k, k_rstd, v, g, beta, a = ctx.saved_tensors
        batch, tokens, heads, k_dim, v_heads, v_dim, chunks = ctx.shape
        do = do.contiguous()
        # chunk_gated_delta_rule_bwd: its locals live until it returns
        w = k.new_empty(batch, tokens, v_heads, k_dim)
        u = torch.empty_like(v)
        h = k.new_empty(batch, chunks, v_heads, k_dim, v_dim)
        v_new = torch.empty_like(u)
        dv = torch.empty_like(do)
        dh = q.new_empty(batch, chunks, v_heads, k_dim, v_dim)
        dh0 = torch.empty((batch, v_heads, k_dim, v_dim), dtype=torch.float32, device=q.device) if (
            ctx.has_initial_state) else None  # fmt: skip
        dv = torch.empty_like(dv)
        blocks = key_block_count(k_dim, k.dtype, ctx.capability)
        dq = q.new_empty(batch, tokens, v_heads, k_dim)
        dk = k.new_empty(batch, tokens, v_heads, k_dim)
        dg = torch.empty((blocks, *g.shape), dtype=torch.float32, device=g.device)
        dw = torch.empty_like(w)
        if v_heads != heads:
            dq = dq.view(batch, tokens, heads, v_heads // heads, k_dim).sum(3)
            dk = dk.view(batch, tokens, heads, v_heads // heads, k_dim).sum(3)
        dg = dg.sum(0)
        dk2 = k.new_empty(batch, tokens, v_heads, k_dim)
        dv = torch.empty_like(v)
        dg2 = torch.empty_like(g)
        db = torch.empty_like(beta)
        if v_heads != heads:
            dk2 = dk2.view(batch, tokens, heads, v_heads // heads, k_dim).sum(3)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = torch.empty_like(dg, dtype=torch.float32)  # chunk_local_cumsum(reverse=True)
        del w, u, h, v_new, dh, dw, dk2, dg2
        if q_rstd is not None:
            dq = torch.empty_like(q)  # l2norm_bwd
            dk = torch.empty_like(k)
        return dq, dk, dv, dg, db, None, dh0, None, None


class SimulatedCausalConv1d(torch.autograd.Function):
    """causal-conv1d's `CausalConv1dFn` for meta tensors (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        if not x.is_meta:
            raise RuntimeError("the simulated causal_conv1d_fn computes nothing: meta tensors only")
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty_like(x)
        ctx.save_for_backward(x, weight, bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias = ctx.saved_tensors
        if dout.stride(2) != 1 and dout.stride(1) != 1:
            dout = dout.contiguous()
        dx = torch.empty_like(x)
        dweight = torch.zeros_like(weight, dtype=torch.float32).type_as(weight)
        dbias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32).type_as(bias)
        return dx, dweight, dbias


def _chunk_rule(original, capability):
    def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = CHUNK, initial_state=None,
                               output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                               **kwargs):  # fmt: skip
        if not query.is_meta:
            return original(query, key, value, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)  # fmt: skip
        if kwargs.get("cu_seqlens") is not None:
            raise ValueError("the simulated chunk_gated_delta_rule takes no packed sequences (cu_seqlens)")
        return SimulatedChunkGatedDeltaRule.apply(
            query, key, value, g, beta, use_qk_l2norm_in_kernel, initial_state, output_final_state, capability
        )

    chunk_gated_delta_rule.__wrapped__ = original
    return chunk_gated_delta_rule


def _conv(original):
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        if not hidden_states.is_meta:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"causal-conv1d fuses only silu, not the activation {activation!r}")
        return SimulatedCausalConv1d.apply(hidden_states, weight, bias)

    causal_conv1d_fn.__wrapped__ = original
    return causal_conv1d_fn


def entries(module: str) -> tuple[str, str]:
    """The inventory entries of one transformers module's two functions."""
    return f"transformers.{module}.chunk_gated_delta_rule", f"transformers.{module}.causal_conv1d_fn"


def uses_linear_attention(config) -> bool:
    """Whether the model has Gated DeltaNet layers the stand-ins cover."""
    text = config.get_text_config()
    return "linear_attention" in (getattr(text, "layer_types", None) or ())


def linear_attention_lines(config) -> list[str]:
    """What the estimate's output says of a hybrid model's kernels."""
    if not uses_linear_attention(config):
        return []
    return [
        "  linear attention (Gated DeltaNet layers): the GPU kernels stand in on meta with the memory their own code "
        f"allocates on CUDA: {'; '.join(STAND_INS)} (hf_offload/tools/simulator/linear_attention.py); step times leave "
        "out those kernels' own compute (they count none)",
    ]


def refuse_linear_attention_under_sp(config, sp_size: int) -> None:
    """A hybrid model under Ulysses needs an exchange around its linear-attention layers (their
    heads split across the ranks over the whole sequence: integrations/linear_attention.py), which the
    simulator does not model yet:
    refused by name rather than estimated as if each rank's layers saw only its own shard."""
    text = config.get_text_config()
    layers = [i for i, kind in enumerate(getattr(text, "layer_types", None) or ()) if kind == "linear_attention"]
    if sp_size > 1 and layers:
        shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
        raise ValueError(
            f"--sp {sp_size}: {type(text).__name__} ({text.model_type}) has {len(layers)} 'linear_attention' layers "
            f"(Gated DeltaNet; layers {shown}); under sequence parallelism they need an exchange of their own (each "
            "rank's heads over the whole sequence); training runs it exactly (register_ulysses, "
            "docs/sequence_parallel.md), but the estimate does not simulate it yet: estimate one GPU (no --sp)"
        )


@contextlib.contextmanager
def linear_attention_as_on_cuda(capability: tuple[int, int]) -> Iterator[None]:
    """Within the block, the Gated DeltaNet layers of the transformers modules in MODULES run the
    stand-ins on meta tensors (and their own code on any other)."""
    with contextlib.ExitStack() as stack:
        for module in MODULES:
            rule, conv = entries(module)
            stack.enter_context(replaced(rule, _chunk_rule(resolve(rule), capability)))
            stack.enter_context(replaced(conv, _conv(resolve(conv))))
        yield
