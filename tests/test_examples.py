"""The demo and the examples run, and the demo's verdict is right."""

from __future__ import annotations

import pytest
from conftest import run_example

from hf_offload.cli import main


def test_demo_reports_bit_identical_runs(capsys):
    assert main(["demo", "--steps", "2", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "bit-identical: losses yes, final weights yes" in out
    assert "offloaded:" in out and "CPU simulation" in out


def test_demo_rejects_bad_values(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--steps", "0"])
    assert exit_.value.code == 2
    assert "steps must be >= 1, got 0" in capsys.readouterr().err


def test_own_loop_example_runs():
    result = run_example("own_loop.py", "--steps", "2", "--seq-len", "32")
    assert result.returncode == 0, result.stderr
    assert "step 1: loss" in result.stdout and "offloaded:" in result.stdout
