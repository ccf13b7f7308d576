"""`hf-offload estimate`'s tables keep their columns apart whatever the figures: widths come from
the cells, not from a guess at how large a figure gets."""

from __future__ import annotations

import pytest
from conftest import TINY_CONFIGS
from transformers import AutoConfig

from hf_offload.tools.estimate import Request, format_estimate, run_estimate
from hf_offload.tools.simulator import Training

MODES = ["checkpointing+hf_offload", "checkpointing+hf_offload_auto+liger+tiled"]


@pytest.fixture(scope="module")
def estimate():
    config = AutoConfig.for_model("llama", **TINY_CONFIGS["llama"])
    training = Training(optimizer_states=0)
    request = Request(config=config, name="tiny", training=training, modes=MODES[:1], seq_len=64)
    return run_estimate(request, echo=None, jobs=1)


def test_a_step_past_ten_thousand_seconds_keeps_its_columns_apart(estimate):
    """A step of 20,059,145 TFLOP and 18,781.58 s (as an 8B step at millions of tokens computes)
    printed 2005914518781.58 in one piece; each figure is its own column now, under its header, and
    a mode name longer than the mode column stays apart from the first figure."""
    entry = estimate.modes[0]
    entry.step.matmul_flops, entry.step.attention_flops = 20_059_145 * 10**12, 0  # flops: their sum
    entry.step_seconds = 18_781.58
    entry.step.tracked_peak_bytes = 123_456 * 2**30 - entry.step.workspace_bytes  # peak_bytes: with workspaces
    entry.mode = MODES[1]
    text = format_estimate(estimate, device_given=False)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("mode") and line.endswith("peak at"))
    row = lines[header + 1]
    cells = row.split()
    assert cells[0] == MODES[1] and cells[1] == "123456.00" and cells[4:7] == ["20059145", "18781.58", "in"], row
    # Each right-aligned figure ends where its header does.
    titles = ["peak GiB", "host GiB", "moved GiB", "TFLOP", "step s"]
    ends, at = [], 0
    for title in titles:
        at = lines[header].index(title, at) + len(title)
        ends.append(at)
    for figure, end in zip(cells[1:6], ends, strict=True):
        assert row[end - len(figure) : end] == figure, (figure, row, lines[header])
