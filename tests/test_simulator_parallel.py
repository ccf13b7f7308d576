"""The simulator's sequence parallelism (one Ulysses rank) and parameter offload (ZeRO-3 to the CPU),
on a tiny grouped-query Llama: what the tracker saw, against what each must change."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_utils import AttentionInterface

from hf_offload.tools.cli import main
from hf_offload.tools.simulator import Simulator, Training, stand_ins

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 32, 2
SEQ = 512


pytestmark = pytest.mark.usefixtures("quiet_simulation")


def gqa_config(**overrides) -> LlamaConfig:
    values = dict(
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=352,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=512,
    )
    values.update(overrides)
    config = LlamaConfig(**values)
    config._attn_implementation = "sdpa"
    return config


def by_tag(result, phase: str, module: str) -> int:
    return result.peak.live_by_tag.get((phase, module), 0)


def test_one_ulysses_rank_halves_the_per_token_parts_and_sees_the_whole_sequence_in_attention(monkeypatch):
    seen = []
    core = AttentionInterface._global_mapping["sdpa"]

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((tuple(query.shape), tuple(key.shape)))
        return core(module, query, key, value, *args, **kwargs)

    # Registered before the step, so that the simulated Ulysses wraps it: it sees what the kernel gets.
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", recording)
    whole = Simulator(gqa_config(), Training()).run("none", SEQ)
    seen_whole, seen[:] = list(seen), []
    rank = Simulator(gqa_config(), Training(sp_size=2)).run("none", SEQ)

    assert set(seen_whole) == {((1, HEADS, SEQ, HEAD_DIM), (1, KV_HEADS, SEQ, HEAD_DIM))}
    assert set(seen) == {((1, HEADS // 2, SEQ, HEAD_DIM), (1, KV_HEADS // 2, SEQ, HEAD_DIM))}
    assert rank.rank_seq_len == SEQ // 2
    # Per-token parts: the MLP's saved activations halve exactly, the loss head's but for its scalar.
    for module in ("layer 0 mlp", "layer 1 mlp"):
        assert by_tag(whole, "forward", module) > 0
        assert by_tag(rank, "forward", module) * 2 == by_tag(whole, "forward", module), module
    assert abs(by_tag(rank, "forward", "loss") * 2 - by_tag(whole, "forward", "loss")) <= 8
    assert by_tag(whole, "forward", "loss") > 2**20
    mlp_flops = whole.flops_by_tag[("forward", "layer 0 mlp")][0]
    assert rank.flops_by_tag[("forward", "layer 0 mlp")][0] * 2 == mlp_flops
    # Attention over the whole square with half the heads: half the FLOPs.
    assert rank.attention_flops * 2 == whole.attention_flops
    # What the all-to-alls send: q, k, v in and the output back, in forward and again in backward,
    # each buffer (this rank's share of the sequence, every head) half leaving the rank.
    per_call = (HEADS + 2 * KV_HEADS + HEADS) * (SEQ // 2) * HEAD_DIM * 2 // 2
    assert rank.sp_sent_bytes == 2 * LAYERS * per_call
    assert whole.sp_sent_bytes == 0


def test_the_all_to_all_buffers_are_counted(monkeypatch):
    """Beside an exchange that hands back its send buffer (allocating nothing), the received
    buffers raise the layer's attention peak by at least the gathered query (bf16)."""
    counted = Simulator(gqa_config(), Training(sp_size=2)).run("none", SEQ)

    def allocating_nothing(ctx, buffer, traffic):
        ctx.traffic = traffic
        return buffer.view_as(buffer)

    monkeypatch.setattr(stand_ins._AllToAll, "forward", staticmethod(allocating_nothing))
    blind = Simulator(gqa_config(), Training(sp_size=2)).run("none", SEQ)
    tag = ("forward", "layer 0 self_attn")
    gathered_query = SEQ * (HEADS // 2) * HEAD_DIM * 2
    assert counted.tag_peaks[tag] - blind.tag_peaks[tag] >= gathered_query


def test_fewer_key_value_heads_than_ranks_are_repeated_as_ulysses_does():
    result = Simulator(gqa_config(), Training(sp_size=4)).run("none", SEQ)
    # One key/value head per rank after repetition: k and v as large as q's share.
    per_call = (HEADS + 2 * HEADS + HEADS) * (SEQ // 4) * HEAD_DIM * 2 * 3 // 4
    assert result.sp_sent_bytes == 2 * LAYERS * per_call


def test_a_sequence_parallel_size_the_heads_do_not_divide_is_refused_by_name(capsys):
    with pytest.raises(ValueError, match=r"sp_size=3 does not divide num_attention_heads=4"):
        Simulator(gqa_config(), Training(sp_size=3))
    with pytest.raises(SystemExit):
        main(["estimate", "--preset", "tiny", "--sp", "3", "--seq-len", "256", "--modes", "none"])
    assert "sp_size=3 does not divide num_attention_heads=8" in capsys.readouterr().err


def test_offloaded_parameters_leave_the_device_but_for_the_layers_in_use():
    config = gqa_config(num_hidden_layers=4)
    resident = Simulator(config, Training(optimizer_states=2))
    offloaded = Simulator(config, Training(optimizer_states=2, offload_params=True))
    weights = sum(p.numel() * p.element_size() for p in resident.model.parameters())
    units = offloaded.param_offload.unit_bytes
    assert sum(units) == weights
    assert resident.resident_bytes >= 3 * weights  # weights and AdamW's two states
    assert offloaded.resident_bytes < weights / 100  # buffers only
    on = resident.run("checkpointing", SEQ)
    off = offloaded.run("checkpointing", SEQ)

    def kind(result, phase):
        return sum(n for tag, n in result.peak.live_by_tag.items() if tag[0] == phase)

    two_units = max(a + b for a, b in zip(units, units[1:], strict=False))
    buffers = sum(b.numel() * b.element_size() for b in offloaded.model.buffers())  # rotary's, counted as weights
    assert 0 < kind(off, "weights") - buffers <= two_units
    assert kind(off, "optimizer") == 0
    assert kind(off, "gradients") <= max(units)
    assert on.peak_bytes - off.peak_bytes >= 3 * weights - two_units - max(units)
    # Every unit came over in forward and again in backward.
    assert off.params_gathered_bytes >= 2 * weights
    params = sum(p.numel() for p in offloaded.model.parameters())
    assert off.params_host_bytes == weights + params * (4 + 4 + 8)


def test_query_heads_a_chunk_at_a_time_hold_less_in_attention_and_send_as_much():
    """Attention tiled over heads under --sp: the simulator runs hf_offload's exchange of a chunk of
    query heads at a time (8 heads and 2 key/value heads on 2 ranks: 4 query heads and 1 key/value
    head per rank, one query head per chunk), against the same step with the rank's heads exchanged
    at once (tile_heads=4, DeepSpeed's call). Each all-to-all call becomes 4 query chunks, the key
    and the value once, 4 output chunks, with the same bytes in all; the attention backward holds
    less, by most of the FlashAttention workspace of 3 query heads (float32 dq accumulator, and dk,
    dv expanded to the query's 4 heads), and the forward less too (one chunk's gathered query)."""
    from hf_offload.tools.simulator.tracker import flash_backward_workspace_bytes

    config = gqa_config(num_attention_heads=8, num_key_value_heads=2, hidden_size=8 * HEAD_DIM)
    seq = 4096
    whole = Simulator(config, Training(sp_size=2, tiling={"tile_heads": 4})).run("checkpointing+tiled", seq)
    chunked = Simulator(config, Training(sp_size=2)).run("checkpointing+tiled", seq)
    assert chunked.sp_sent_bytes == whole.sp_sent_bytes > 0
    # Per attention call and pass (forward, recompute, backward): 4 all-to-alls, or 4 + 2 + 4.
    assert whole.sp_exchanges == 3 * LAYERS * 4 and chunked.sp_exchanges == 3 * LAYERS * 10

    def meta(heads):
        return torch.empty(1, heads, seq, HEAD_DIM, device="meta", dtype=torch.bfloat16)

    workspace = flash_backward_workspace_bytes(meta(4), meta(1)) - flash_backward_workspace_bytes(meta(1), meta(1))
    for phase, at_least in (("backward", workspace // 2), ("forward", seq * 3 * HEAD_DIM * 2)):
        tag = (phase, "layer 0 self_attn")
        assert whole.tag_peaks[tag] - chunked.tag_peaks[tag] >= at_least, (phase, whole.tag_peaks, chunked.tag_peaks)
