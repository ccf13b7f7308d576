"""The simulator's memo of module calls (tools/simulator/memo.py), on calls that differ only where
its key must tell them apart: a replayed call must leave the step's peak where running every call
leaves it. The calls are made as sequence tiling's backward makes them: inside an autograd node,
with grad, each differentiated at once."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hf_offload.tools.simulator import memo
from hf_offload.tools.simulator.memo import SliceMemo
from hf_offload.tools.simulator.tracker import MemoryTracker

TOKENS, HIDDEN = 64, 32
ARGUMENT_BYTES = TOKENS * HIDDEN * 4


class SavesItsInput(nn.Module):
    """exp's backward runs after mul's, which is the last to need x: an x held by the graph
    alone is freed between them, a view of a tensor the caller holds is not."""

    def forward(self, x):
        return x.exp() * x


class Twice(nn.Module):
    def forward(self, x, y):
        return x * y


class Scratch(nn.Module):
    """Allocates `rows` rows of scratch: state the key does not hold, set by its caller."""

    rows = 1

    def forward(self, x):
        return x * 2 + torch.empty(self.rows * TOKENS, HIDDEN, device="meta").sum()


def argument(kind: str) -> torch.Tensor:
    if kind == "view":  # a slice of a tensor the caller holds, of a fresh tensor's shape and strides
        return torch.empty(2, TOKENS, HIDDEN, device="meta", requires_grad=True)[0]
    return torch.empty(TOKENS, HIDDEN, device="meta", requires_grad=True)


class _Calls(torch.autograd.Function):
    """Its backward calls `call(kind)` for each kind, with grad, and differentiates each."""

    @staticmethod
    def forward(ctx, anchor, kinds, call):
        ctx.kinds, ctx.call = kinds, call
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad):
        for kind in ctx.kinds:
            with torch.enable_grad():
                inputs, out = ctx.call(kind)
                torch.autograd.grad(out, inputs, torch.empty(out.shape, device="meta"))
            del inputs, out
        return grad, None, None


def peak(module: nn.Module, kinds: list[str], call, replay: bool) -> tuple[int, SliceMemo]:
    tracker = MemoryTracker()
    memory = SliceMemo(tracker)
    with tracker:
        tracker.start(trace=False)
        anchor = torch.empty(4, device="meta", requires_grad=True)
        with memory.installed([module]) if replay else contextlib.nullcontext():
            _Calls.apply(anchor, kinds, call).sum().backward()
        return tracker.finish().bytes, memory


def single(module):
    def call(kind):
        x = argument(kind)
        return [x], module(x)

    return call


def test_a_view_and_a_fresh_argument_of_the_same_shape_are_learnt_apart():
    """A fresh argument first, then a view of the same shape and strides: the view stays live
    through the call's backward, the fresh one does not, and the replayed step's peak is the full
    one's (8 KiB higher than the fresh call's)."""
    module = SavesItsInput()
    kinds = ["fresh", "view"]
    full, _ = peak(module, kinds, single(module), replay=False)
    replayed, memory = peak(module, kinds, single(module), replay=True)
    assert memory.replays == 2 and replayed == full
    fresh_only, _ = peak(module, ["fresh"], single(module), replay=False)
    assert full - fresh_only == ARGUMENT_BYTES


def test_the_comparison_catches_a_key_blind_to_views(monkeypatch):
    """Companion: keyed without whether an argument is a view, and learning the second call from
    the first call's arguments (as the memo did), the view's call replays the fresh call's
    backward, and the peak falls by the argument's bytes. (Learnt from its own arguments, the
    second call disagrees with the first and runs for real: exact, but not replayed.)"""
    describe, call_of, first = memo._describe, memo._call_of, {}

    def blind(value):
        found = describe(value)
        return found[:4] if isinstance(value, torch.Tensor) else found

    def first_call_of(module, *args):
        return first.setdefault(id(module), call_of(module, *args))

    monkeypatch.setattr(memo, "_describe", blind)
    monkeypatch.setattr(memo, "_call_of", first_call_of)
    module = SavesItsInput()
    kinds = ["fresh", "view"]
    full, _ = peak(module, kinds, single(module), replay=False)
    replayed, _ = peak(module, kinds, single(module), replay=True)
    assert full - replayed == ARGUMENT_BYTES


def test_arguments_sharing_storage_run_for_real():
    """module(x, x): the sandbox would give each argument a tensor of its own; the call runs for
    real, and the peak is the full one."""
    module = Twice()

    def call(kind):
        x = argument(kind)
        return [x], module(x, x)

    full, _ = peak(module, ["fresh"] * 3, call, replay=False)
    replayed, memory = peak(module, ["fresh"] * 3, call, replay=True)
    assert memory.replays == 0 and memory.real_calls == 3 and replayed == full


def test_state_the_key_does_not_hold_is_caught_by_the_second_learning():
    """A module whose scratch grows between its first and second calls (state outside the key):
    learnt again at its second call, it disagrees with the first and runs for real from then on;
    the peak is the full one."""

    def run(replay: bool) -> tuple[int, SliceMemo]:
        module = Scratch()

        def call(rows):
            module.rows = rows
            x = argument("fresh")
            return [x], module(x)

        return peak(module, [1, 4, 4, 4], call, replay)

    full, _ = run(replay=False)
    replayed, memory = run(replay=True)
    assert replayed == full and memory.replays == 1 and memory.real_calls == 3
