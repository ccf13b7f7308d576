"""The time model against the step times measured on the H200: each step simulated, its seconds
predicted by the model fitted to all of them, and by the model fitted to the others (held out).

    python -m hf_offload.tools.benchmarks.time_model

Prints the three efficiencies a fit to all the points gives (what `devices.TIME_MODEL` should
hold) and a markdown table of each step: measured, predicted by the fit, predicted held out.
"""

from __future__ import annotations

import argparse
import logging
import warnings

from hf_offload.tools import measured
from hf_offload.tools.devices import DEVICES, TIME_MODEL, TimeModel, fit_time_model
from hf_offload.tools.presets import preset_config
from hf_offload.tools.simulator import Simulator, StepResult, Training


def simulate(points: dict[tuple, float], simulators: dict | None = None) -> dict[tuple, StepResult]:
    """Each measured step, simulated as it was measured (no optimizer step)."""
    simulators = {} if simulators is None else simulators
    results = {}
    for case in points:
        model, lora_rank, mode, seq_len = case
        key = (model, lora_rank)
        if key not in simulators:
            simulators[key] = Simulator(preset_config(model), Training(lora_rank=lora_rank))
        results[case] = simulators[key].run(mode, seq_len)
    return results


def parts(step: StepResult, model: TimeModel = TIME_MODEL) -> tuple[float, float, float]:
    return model.parts(DEVICES["h200"], step.compute, step.traffic_bytes)


def held_out(results: dict[tuple, StepResult], points: dict[tuple, float]) -> dict[tuple, float]:
    """Each point's seconds predicted by the model fitted to the other points."""
    predicted = {}
    for case in points:
        others = [(parts(results[c]), seconds) for c, seconds in points.items() if c != case]
        model = fit_time_model(others)
        predicted[case] = model.seconds(DEVICES["h200"], results[case].compute, results[case].traffic_bytes)
    return predicted


def table(results, points, fitted: TimeModel, held: dict[tuple, float]) -> str:
    lines = [
        "| model | tuning | mode | tokens | measured s | fitted s | fitted / measured | held out s "
        "| held out / measured | TFLOP bf16 + float32 + attention |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, seconds in points.items():
        model, lora_rank, mode, seq_len = case
        step = results[case]
        fit = fitted.seconds(DEVICES["h200"], step.compute, step.traffic_bytes)
        low = sum(f for (kind, dtype), f in step.compute.items() if kind == "matmul" and dtype.itemsize < 4)
        high = sum(f for (kind, dtype), f in step.compute.items() if kind == "matmul" and dtype.itemsize >= 4)
        attention = sum(f for (kind, _dtype), f in step.compute.items() if kind == "attention")
        tuning = "full" if lora_rank is None else f"LoRA r={lora_rank}"
        lines.append(
            f"| {model} | {tuning} | {mode} | {seq_len} | {seconds:.3f} | {fit:.3f} | {fit / seconds:.3f} "
            f"| {held[case]:.3f} | {held[case] / seconds:.3f} | {low / 1e12:.0f} + {high / 1e12:.1f} + "
            f"{attention / 1e12:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore", FutureWarning)
    points = measured.step_seconds()
    results = simulate(points)
    fitted = fit_time_model([(parts(results[c]), s) for c, s in points.items()])
    held = held_out(results, points)
    print(f"fitted to all {len(points)}: matmul {fitted.matmul:.3f}, attention {fitted.attention:.3f}, "
          f"memory {fitted.memory:.3f} (devices.TIME_MODEL: {TIME_MODEL})")  # fmt: skip
    worst = max(abs(held[c] / s - 1) for c, s in points.items())
    print(f"held out, worst error {worst:.1%}")
    print(table(results, points, fitted, held))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
