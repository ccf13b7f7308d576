"""The decode time model (`hf_offload.tools.decode_time`) against published decode speeds of an
8B model, fitted to one and held out on the others (`published_generation.json`), and its sums."""

from __future__ import annotations

import pytest

from hf_offload.tools import decode_time
from hf_offload.tools.benchmarks import decode_time as decode_benchmark
from hf_offload.tools.devices import DEVICES


@pytest.fixture(scope="module")
def rows():
    return {row["point"]["id"]: row for row in decode_benchmark.rows()}


def test_the_fit_reproduces_its_point_and_the_long_context_point_held_out(rows):
    """Fitted to TensorRT-LLM's H100 throughput at 20,000 + 2,000 tokens, the memory-bound model
    predicts the H200's at the same lengths, held out, within 10%, and a batch-1 step of vLLM on an
    A100 (another engine, another GPU) within 10%: the regime of GRPO's long traces."""
    assert rows["trtllm-h100-llama-3.1-8b-fp8-20000-2000"]["error"] == pytest.approx(0, abs=1e-6)
    assert abs(rows["trtllm-h200-llama-3.1-8b-fp8-20000-2000"]["error"]) < 0.10
    assert abs(rows["vllm-a100-40gb-llama-3.1-8b-bf16-batch-1"]["error"]) < 0.10


def test_every_held_out_point_within_the_printed_range(rows):
    """The others (shorter inputs, whose prefill weighs more; a batch-1 step captured as a CUDA
    graph) are within 30%, and the decode range's fast end (the graph step's efficiency) is above
    the fitted one: a range, not a point."""
    held_out = [row for row in rows.values() if row["point"]["role"] == "held_out"]
    assert len(held_out) >= 4
    assert all(abs(row["error"]) < 0.30 for row in held_out)
    rates = decode_time.rates()
    assert rates.memory_efficiency < rates.memory_efficiency_high <= 1


def test_sum_of_a_line_floored_by_the_host():
    """The decode sum with the host's floor equals summing step by step."""
    for base, slope, floor, first, last in [(1.0, 0.5, 3.0, 1, 20), (5.0, 0.1, 2.0, 1, 9), (0.0, 2.0, 100.0, 1, 7)]:
        total, floored = decode_time._sum_of_max(base, slope, floor, first, last)
        steps = [max(base + slope * k, floor) for k in range(first, last + 1)]
        assert total == pytest.approx(sum(steps))
        assert floored == sum(1 for k in range(first, last + 1) if base + slope * k < floor)


def test_decode_seconds_grow_with_the_cache_and_the_host_sets_a_floor():
    device = DEVICES["h100-80gb"]
    rates = decode_time.DecodeRates(memory_efficiency=0.75, memory_efficiency_high=0.9, host_seconds_per_op=1e-5)
    fast, slow, floored = decode_time.decode_seconds(device, (16e9, 1e6), (0.0, 0.0), steps=1000, rates_=rates)
    assert fast < slow and floored == 0
    _, slow_host, floored_host = decode_time.decode_seconds(device, (16e9, 1e6), (0.0, 0.0), steps=1000,
                                                            host_seconds=1.0, rates_=rates)  # fmt: skip
    assert floored_host == 1000 and slow_host == pytest.approx(1000.0)


def test_one_long_row_alone_is_as_slow_as_the_published_200k_token_point():
    """vLLM 0.4.2 decoded one 200K-token row of Llama-3-8B at 30 ms a token on an H800
    (lmdeploy#1608), 1.8x what the bandwidth model at the fitted efficiency says: the slow end of a
    lone row's decode reproduces it, the fast end stays the CUDA graph step's; without the lone
    row's cache read apart, the slow end is the bandwidth model's."""
    rates = decode_time.rates()
    (point,) = [p for p in decode_time.decode_points() if p["role"] == "long_context_batch_1"]
    device = DEVICES[point["device"]]
    shape = decode_time._shape(point["preset"])
    kv = shape["kv_elements"] * point["assumed"]["kv_bytes_per_element"] * point["setup"]["input_tokens"]
    read = (decode_time._weights_read(point) + kv, 0.0)
    fast, slow, _ = decode_time.decode_seconds(device, read, (0.0, 0.0), steps=1, lone_kv=(kv, 0.0))
    assert slow == pytest.approx(point["figure"]["value"] / 1e3, rel=1e-9)
    _, bandwidth_only, _ = decode_time.decode_seconds(device, read, (0.0, 0.0), steps=1)
    assert bandwidth_only == pytest.approx(decode_time.predict(point, rates.memory_efficiency) / 1e3)
    assert fast < bandwidth_only < 0.6 * slow
