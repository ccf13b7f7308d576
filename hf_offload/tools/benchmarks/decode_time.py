"""The decode time model against published decode speeds of an 8B model: its memory efficiency
fitted to one (TensorRT-LLM's Llama-3.1-8B FP8 throughput at 20,000 input and 2,000 output tokens
on one H100), every other predicted with it, held out.

    python -m hf_offload.tools.benchmarks.decode_time

Prints the fitted efficiency, the high end (the batch-1 step captured as a CUDA graph), the host's
seconds per aten op for transformers' eager `generate`, and a markdown table of every point:
published, predicted, the difference, and the point's role (fit, held out, host).
"""

from __future__ import annotations

import argparse

from hf_offload.tools import decode_time


def rows() -> list[dict]:
    """Each published point with its prediction at the fitted efficiency (host: the per-op rate
    reproduces it by construction; its GPU time is shown instead)."""
    efficiency = decode_time.fit()
    found = []
    for point in decode_time.decode_points():
        predicted = decode_time.predict(point, efficiency)
        found.append({"point": point, "predicted": predicted, "error": predicted / point["figure"]["value"] - 1})
    return found


def table() -> str:
    rates = decode_time.rates()
    lines = [
        f"memory efficiency fitted: {rates.memory_efficiency:.3f}; high end (batch-1 CUDA graph step): "
        f"{rates.memory_efficiency_high:.3f}; host seconds per aten op (transformers' generate): "
        f"{rates.host_seconds_per_op * 1e6:.1f} us; one long row's KV cache read alone (the slow end, fitted to "
        f"the long_context_batch_1 point): {rates.kv_efficiency_batch_1:.3f}",
        "",
        "| point | GPU | setup | published | predicted | difference | role |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows():
        point = row["point"]
        setup = point["setup"]
        shape = f"{setup.get('input_tokens') or 0:,} in / {setup['output_tokens']:,} out"
        if "batch" in setup:
            shape += f", batch {setup['batch']}"
        unit = "ms a step" if point["figure"]["kind"] == "ms_per_step" else "tok/s"
        predicted = f"{row['predicted']:,.1f} {unit}"
        difference = f"{row['error']:+.1%}"
        if point["role"] == "host":
            predicted += " (GPU memory time alone)"
            difference = "-"
        lines.append(
            f"| {point['id']} | {point['gpu']} | {shape} | {point['figure']['value']:,} {unit} | {predicted} "
            f"| {difference} | {point['role']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
