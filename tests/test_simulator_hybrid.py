"""Hybrid models (Qwen3.5, Qwen3-Next) in the simulator: their presets, the stand-ins for the GPU
kernels of their Gated DeltaNet layers (flash-linear-attention, causal-conv1d), and the estimate."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_offload.tools import cli
from hf_offload.tools.presets import PRESET_CONFIGS, preset_config
from hf_offload.tools.simulator import linear_attention
from hf_offload.tools.simulator.tracker import MemoryTracker

HYBRID_PRESETS = [name for name, fields in PRESET_CONFIGS.items() if "layer_types" in fields]

TINY = {
    "qwen3_5_text": dict(intermediate_size=256),
    "qwen3_5_moe_text": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64
    ),
    "qwen3_next": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64
    ),
}


def tiny_config_dir(tmp_path, model_type: str):
    fields = dict(model_type=model_type, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention"] * 2, **TINY[model_type])  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return tmp_path


def test_the_hybrid_presets_build_with_transformers_classes():
    """Each hybrid preset is a config of transformers' own class for its model type, three linear-attention
    layers to one of softmax attention all the way down, and builds its causal LM (on meta) with a Gated
    DeltaNet in each linear-attention layer."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert {PRESET_CONFIGS[name]["model_type"] for name in HYBRID_PRESETS} == {
        "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}  # fmt: skip
    for name in HYBRID_PRESETS:
        config = preset_config(name)
        assert type(config) is CONFIG_MAPPING[PRESET_CONFIGS[name]["model_type"]]
        kinds = config.layer_types
        assert len(kinds) == config.num_hidden_layers
        assert kinds == (["linear_attention"] * 3 + ["full_attention"]) * (config.num_hidden_layers // 4)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        mixers = [type(layer.linear_attn).__name__ for layer in model.model.layers if hasattr(layer, "linear_attn")]
        assert len(mixers) == kinds.count("linear_attention") and all(m.endswith("GatedDeltaNet") for m in mixers)


def _measure(function, *inputs, grad_output):
    """Forward peak, bytes the forward leaves (its output and what it saves), and the backward's peak,
    each above what was live before it, as the simulator's tracker counts them."""
    tracker = MemoryTracker()
    for tensor in (*inputs, grad_output):
        tracker.adopt(tensor)
    with tracker:
        before = tracker.live
        tracker.start(trace=False)
        output = function(*inputs)
        forward_peak = tracker.finish().bytes - before
        held = tracker.live - before
        start = tracker.live
        tracker.start(trace=False)
        output.backward(grad_output)
        backward_peak = tracker.finish().bytes - start
    return forward_peak, held, backward_peak


# Shapes as transformers calls the kernel: q, k (B, T, H, K), v (B, T, HV, V), g float32 and beta (B, T, HV).
B, T, H, HV, K, V = 1, 1024, 2, 4, 64, 64
DTYPE = torch.bfloat16


def _delta_rule_inputs():
    with torch.device("meta"):
        q, k = (torch.empty(B, T, H, K, dtype=DTYPE, requires_grad=True) for _ in range(2))
        v = torch.empty(B, T, HV, V, dtype=DTYPE, requires_grad=True)
        g = torch.empty(B, T, HV, dtype=torch.float32, requires_grad=True)
        beta = torch.empty(B, T, HV, dtype=DTYPE, requires_grad=True)
        grad_output = torch.empty(B, T, HV, V, dtype=DTYPE)
    return (q, k, v, g, beta), grad_output


def _fla_bytes():
    """fla 0.6.0's ChunkGatedDeltaRuleFunction (chunk.py) as allocated on CUDA, from its code, for the
    shapes above with use_qk_l2norm_in_kernel=True, chunks of 64, sm90 (NK = 1):
    forward: l2norm_fwd's q, k and float32 rstd per (token, head); chunk_local_cumsum's float32 g;
    A (B, T, HV, 64); w (B, T, HV, K), u like v (recompute_w_u_fwd); h (B, NT, HV, K, V) and v_new
    (chunk_gated_delta_rule_fwd_h); o like v (chunk_fwd_o): the peak, when o is made. Held after it:
    the saved q, q_rstd, k, k_rstd, g, A, and o.
    backward: its peak is in prepare_wy_repr_bwd, when its dv is made before the dv of bwd_dhu goes:
    w, u, v_new, dw, dk2 (HV heads each), two dv, h and dh, dq and dk already summed to H heads, the
    summed float32 dg (NK = 1)."""
    e = torch.empty((), dtype=DTYPE).element_size()
    chunks = math.ceil(T / 64)
    per_k_head, per_v_head = B * T * K * e, B * T * V * e
    fp32_per_v_head = B * T * HV * 4
    state = B * chunks * HV * K * V * e
    saved = 2 * H * per_k_head + 2 * B * T * H * 4 + fp32_per_v_head + B * T * HV * 64 * e
    forward_peak = saved + HV * per_k_head + 3 * HV * per_v_head + state
    held = saved + HV * per_v_head
    backward_peak = 3 * HV * per_k_head + 4 * HV * per_v_head + 2 * state + 2 * H * per_k_head + fp32_per_v_head
    return forward_peak, held, backward_peak


def _stand_in(q, k, v, g, beta):
    rule = linear_attention._chunk_rule(None, (9, 0))
    return rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=None)[0]


def test_the_delta_rule_stand_in_allocates_what_flas_kernel_allocates():
    inputs, grad_output = _delta_rule_inputs()
    assert _measure(_stand_in, *inputs, grad_output=grad_output) == _fla_bytes()


def test_the_delta_rule_check_catches_the_reference_code_on_meta():
    """Companion: transformers' PyTorch reference (what meta runs without the stand-in) holds float32
    copies and per-chunk decay matrices: the check above tells it from fla's kernel."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    reference = modeling_qwen3_5.torch_chunk_gated_delta_rule

    def run(q, k, v, g, beta):
        return reference(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    inputs, grad_output = _delta_rule_inputs()
    measured = _measure(run, *inputs, grad_output=grad_output)
    expected = _fla_bytes()
    assert measured[1] != expected[1] and measured[2] != expected[2]


def _conv_inputs():
    channels, width = 96, 4
    with torch.device("meta"):
        # As the layer passes it: in_proj's output (B, T, C) transposed to (B, C, T), channels last in memory.
        x = torch.empty(B, T, channels, dtype=DTYPE, requires_grad=True).transpose(1, 2)
        weight = torch.empty(channels, width, dtype=DTYPE, requires_grad=True)
        grad_output = torch.empty(B, T, channels, dtype=DTYPE).transpose(1, 2)
    return x, weight, grad_output


def test_the_conv_stand_in_allocates_what_causal_conv1d_allocates():
    """causal-conv1d 1.7.0's CausalConv1dFn: out like x (no copy of a channels-last x), x and weight saved;
    backward dx like x and a float32 dweight cast to the weight's dtype (the cast made while the float32 one
    lives)."""
    x, weight, grad_output = _conv_inputs()
    conv = linear_attention._conv(None)
    measured = _measure(lambda x, w: conv(x, w, None, activation="silu"), x, weight, grad_output=grad_output)
    e = torch.empty((), dtype=DTYPE).element_size()
    out = x.numel() * e
    assert measured == (out, out, out + weight.numel() * (4 + e))


def test_the_conv_check_catches_the_reference_code_on_meta():
    """Companion: transformers' reference convolution pads the sequence and applies silu separately."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    x, weight, grad_output = _conv_inputs()
    reference = modeling_qwen3_5.causal_conv1d_fn
    measured = _measure(lambda x, w: reference(x, w, None, activation="silu"), x, weight, grad_output=grad_output)
    out = x.numel() * torch.empty((), dtype=DTYPE).element_size()
    assert measured[:2] != (out, out)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_the_estimate_answers_for_a_hybrid_model_naming_its_stand_ins(model_type, tmp_path, capsys):
    """`hf-offload estimate --model DIR` for a tiny Qwen3.5 (dense and MoE) and a tiny Qwen3-Next: it answers, names the
    stand-ins, and the step ran them (the simulated delta rule once per linear-attention layer in forward and
    once more in the checkpointed recompute)."""
    calls = []
    original = linear_attention.SimulatedChunkGatedDeltaRule.apply

    def counted(*args):
        calls.append(args[0].shape)
        return original(*args)

    directory = tiny_config_dir(tmp_path, model_type)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(linear_attention.SimulatedChunkGatedDeltaRule, "apply", counted)
        code = cli.main(["estimate", "--model", str(directory), "--seq-len", "512", "--modes", "checkpointing"])
    output = capsys.readouterr().out
    assert code in (0, None)
    assert "flash-linear-attention 0.6.0's chunk_gated_delta_rule" in output and "causal-conv1d 1.7.0" in output
    assert len(calls) == 2 * 2 and all(shape[1] == 512 for shape in calls)


def test_the_estimate_refuses_sequence_parallelism_for_a_hybrid_model(tmp_path, capsys):
    directory = tiny_config_dir(tmp_path, "qwen3_5_text")
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--model", str(directory), "--seq-len", "512", "--sp", "2"])
    error = capsys.readouterr().err
    assert "--sp 2" in error and "'linear_attention' layers" in error and "layers 0, 2" in error
