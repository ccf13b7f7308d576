"""What of hf_offload composes with torch's context parallelism (`context_parallel`, accelerate's
`ParallelismConfig(cp_size=N)` on FSDP2, TRL's long-context recipe), as far as the CPU runs it.

torch 2.13's context parallelism does not run on the CPU at all: it intercepts only CUDA's
attention kernels (`aten._scaled_dot_product_flash_attention_for_cpu` "does not have a sharding
strategy registered", on 2 gloo ranks). What runs here is what hf_offload does on its side of
the boundary: attention tiled over heads reaching torch's SDPA through the module attribute that
context parallelism replaces, once per group; the tiled loss on one rank's shard as the Trainer
prepares it (labels and shift_labels sharded, the whole batch's count); and the refusal of
DeepSpeed's Ulysses while context parallelism is on (docs/sequence_parallel.md).
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import VOCAB, tiny_model, twin

import hf_offload
from hf_offload.integrations import sequence_parallel as sp

SEQ = 16


def ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def test_attention_over_heads_reaches_the_sdpa_context_parallelism_replaces_once_per_group(monkeypatch):
    """torch's context parallelism replaces `torch.nn.functional.scaled_dot_product_attention` with
    its ring dispatcher (`_distribute_function`); transformers' SDPA function looks it up at each
    call. Attention tiled over heads (8 query heads, 4 key/value heads: 4 groups) reaches it once
    per group, each group its own ring over its heads, the result as one call's."""
    plain = tiny_model("llama", seed=0, num_attention_heads=8, num_key_value_heads=4, head_dim=4).double()
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=4)
    original = torch.nn.functional.scaled_dot_product_attention
    heads_per_call: list[int] = []

    def dispatcher(query, key, value, *args, **kwargs):  # where context parallelism's ring would run
        heads_per_call.append(query.shape[1])
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", dispatcher)
    try:
        batch = ids()
        expected = plain(input_ids=batch, labels=batch).loss
        heads_per_call.clear()
        loss = tiled(input_ids=batch, labels=batch).loss
        assert heads_per_call == [2] * 4 * tiled.config.num_hidden_layers
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    finally:
        hf_offload.disable_sequence_tiling(tiled)


def test_the_tiled_loss_takes_a_context_parallel_shard_as_the_trainer_prepares_it():
    """Under context parallelism the Trainer shifts the labels before sharding (`shift_labels`),
    shards `labels` too, and passes the whole batch's count of labelled tokens: the tiled loss
    head uses shift_labels (never shifting a shard again) and that count, as transformers' loss
    does, on the same rank's inputs."""
    plain = tiny_model("llama", seed=0).double()
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=4, mlp=False, norms=False, projections=False, attention=False)
    batch = ids()
    labels = batch.clone()
    labels[:, :5] = -100
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    shard = slice(0, SEQ // 2)  # rank 0 of 2 (without load balancing; with it, two chunks of four)
    inputs = {  # contiguous, as context parallelism writes each shard in place
        "input_ids": batch[:, shard].contiguous(),
        "labels": labels[:, shard].contiguous(),
        "shift_labels": shifted[:, shard].contiguous(),
        "position_ids": torch.arange(SEQ)[shard].expand(2, -1).contiguous(),
        "num_items_in_batch": (shifted != -100).sum(),
    }
    expected = plain(**inputs).loss
    loss = tiled(**inputs).loss
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    # Companion: the shard's labels shifted again (its last token loses the next shard's first
    # label) is another loss, which the comparison above would see.
    shifted_again = plain(**{k: v for k, v in inputs.items() if k != "shift_labels"}).loss
    assert abs(float(shifted_again) - float(expected)) > 1e-3
    hf_offload.disable_sequence_tiling(tiled)


def test_ulysses_is_refused_while_torch_context_parallelism_is_on(monkeypatch):
    """Both split the sequence across ranks: with context parallelism's dispatcher in place of
    torch's SDPA, check_sequence_parallel (and so register_ulysses, and Ulysses's attention at
    each call) refuses, naming both. Companion: without it, the same check passes."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    model = tiny_model("llama")
    assert sp.check_sequence_parallel(model, 2, world_size=2) == "sdpa"
    assert not sp.torch_context_parallel_active()
    dispatcher = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setitem(_attention._replaced_functions, dispatcher, ("scaled_dot_product_attention", dispatcher))
    assert sys.modules[sp._TORCH_CONTEXT_PARALLEL] is _attention
    assert sp.torch_context_parallel_active()
    with pytest.raises(ValueError, match=r"torch's context parallelism is on.*ParallelismConfig\(cp_size=N\)"):
        sp.check_sequence_parallel(model, 2, world_size=2)
