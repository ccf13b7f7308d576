"""The engine on its own, without transformers: deduplication and its guards."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch

from hf_offload.engine import ActivationOffloader
from hf_offload.engine.handles import HostCopy
from hf_offload.engine.pool import HostBuffer
from hf_offload.engine.streams import simulated_schedule
from hf_offload.tools.benchmarks.standin import stand_in_accelerator


def scope(engine, *, starts_pass=True, keep=False, protected=()):
    return engine.layer_scope(
        training=True,
        device=torch.device("cpu"),
        starts_pass=starts_pass,
        keep=keep,
        protected=lambda: protected,
        pass_protected=lambda: (),
        name="toy",
    )


def new_engine():
    return ActivationOffloader(min_offload_bytes=0, simulate_on_cpu=True)


def run(body, engine=None):
    """x.grad for body(x), optionally with body's saved tensors routed through `engine`."""
    torch.manual_seed(0)
    x = torch.randn(1024, requires_grad=True)
    with scope(engine) if engine is not None else contextlib.nullcontext():
        loss = body(x)
    loss.backward()
    return x.grad


def saved_twice(x):
    a = x * 2
    return (a.sin() + a.cos()).sum()  # sin and cos both save `a`


def modified_between_saves(x, engine=None):
    """Layer 1 saves `a` (its use never reaches the loss); layer 2 modifies `a` in place and
    saves it again. Without offloading this is a valid program."""

    def layer(starts_pass):
        return scope(engine, starts_pass=starts_pass) if engine is not None else contextlib.nullcontext()

    with layer(True):
        a = x * 2
        _unused = a.sin()  # saves `a` at version 0; its backward never runs
    with layer(False):
        a.mul_(3)
        return a.cos().sum()  # saves `a` at version 1


def grad_of_modified_between_saves(engine):
    torch.manual_seed(0)
    x = torch.randn(1024, requires_grad=True)
    modified_between_saves(x, engine).backward()
    return x.grad


def test_a_storage_saved_twice_is_offloaded_once():
    engine = new_engine()
    assert torch.equal(run(saved_twice), run(saved_twice, engine))
    stats = engine.stats()
    assert stats.offloaded_tensors == 1 and stats.kept_tensors["duplicate"] == 1


def test_a_storage_modified_in_place_between_saves_is_copied_again():
    engine = new_engine()
    assert torch.equal(grad_of_modified_between_saves(None), grad_of_modified_between_saves(engine))
    assert engine.stats().offloaded_tensors == 2


def test_version_guard_is_what_keeps_in_place_modification_exact(monkeypatch):
    """Companion: matching on identity alone hands layer 2 the copy of the tensor as it was
    before the in-place change, which backward must not use."""
    monkeypatch.setattr(HostCopy, "matches", lambda self, storage, version: self.source_ref() is storage)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grad_of_modified_between_saves(new_engine())


def test_in_place_change_of_a_saved_tensor_is_reported_like_autograd_does():
    def body(engine):
        x = torch.randn(1024, requires_grad=True)
        with scope(engine) if engine is not None else contextlib.nullcontext():
            a = x * 2
            b = a.sin()  # saves `a`
            a.mul_(3)  # ...which backward then needs in its old state
        b.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        body(None)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*hf_offload"):
        body(new_engine())


def _reused_address_grad(engine):
    """Layer 1 saves a tensor; once the engine has released it (after layer 2), it dies and
    layer 3 saves a different tensor at the same address: what a caching allocator does all
    the time once offloading has freed memory. Two storages over one buffer make the reuse
    deterministic."""
    torch.manual_seed(0)
    x = torch.randn(1024, requires_grad=True)
    buffer = bytearray(x.numel() * 4)
    with scope(engine, starts_pass=True):
        a = torch.frombuffer(buffer, dtype=torch.float32)
        a.copy_(x * 2)
        first = a.sin()  # saves `a`; the graph holds only the offloaded handle
        address = a.untyped_storage().data_ptr()
        del a
    with scope(engine, starts_pass=False):
        middle = x.cos()
    with scope(engine, starts_pass=False):
        b = torch.frombuffer(buffer, dtype=torch.float32)
        b.copy_(x * 3)  # same address, same version number as `a` had, different data
        assert b.untyped_storage().data_ptr() == address
        last = b.sin()
    (first + middle + last).sum().backward()
    expected = 2 * torch.cos(2 * x.detach()) - torch.sin(x.detach()) + 3 * torch.cos(3 * x.detach())
    return x.grad, expected


def test_a_new_storage_at_a_freed_address_is_not_a_duplicate():
    engine = new_engine()
    grad, analytic = _reused_address_grad(engine)
    torch.testing.assert_close(grad, analytic)
    stats = engine.stats()
    # `a` and `b` offloaded, neither taken for the other; the middle layer saves `x`, a leaf that
    # requires grad, which the graph holds anyway: kept.
    assert stats.offloaded_tensors == 2 and stats.kept_tensors["duplicate"] == 0 and stats.kept_tensors["leaf"] == 1


def test_identity_guard_is_what_keeps_address_reuse_exact(monkeypatch):
    """Companion: matching on address and version alone takes the dead tensor's copy."""
    monkeypatch.setattr(HostCopy, "matches", lambda self, storage, version: self.version == version)
    grad, analytic = _reused_address_grad(new_engine())
    assert not torch.allclose(grad, analytic)


def every_layout(x):
    """Saved tensors of each layout the copy out tells apart. Copied as itself into a host view
    of the same layout: a contiguous float tensor over its whole storage. Copied as their
    storage's bytes: a transpose and a channels-last tensor (dense but not contiguous), a slice
    at an offset, an expanded (overlapping) view, and a bool mask (a dtype whose element-wise
    copy is not a byte copy everywhere)."""
    contiguous = (x * 2).view(32, 32)
    transposed = (x * 3).view(32, 32).t()
    sliced = (x * 4)[16:]
    expanded = (x * 5)[:32].view(1, 32).expand(8, 32)
    image = (x * 6).view(1, 4, 16, 16).contiguous(memory_format=torch.channels_last)
    masked = torch.where(x > 0, x, 0.0)  # saves the mask
    parts = (contiguous, transposed, sliced, expanded, image)
    return sum(part.sin().sum() for part in parts) + masked.sum()


def sliced(x):
    return (x * 4)[16:].sin().sum()


@pytest.mark.parametrize("streams", ["eager", "lazy", "random", "accelerator"])
def test_every_layout_comes_back_exactly(monkeypatch, streams):
    """Under the race checker's three schedules, and on the accelerator code path against
    stand-in streams (whose copies are torch's own `copy_` into the typed host views, where the
    simulated streams copy runs of bytes)."""
    made = []
    init = HostCopy.__init__

    def spy(self, tensor, *args):
        init(self, tensor, *args)
        made.append(self.whole)

    monkeypatch.setattr(HostCopy, "__init__", spy)
    engine = new_engine()
    context = stand_in_accelerator() if streams == "accelerator" else simulated_schedule(streams, seed=1)
    with context:
        assert torch.equal(run(every_layout), run(every_layout, engine))
    assert engine.stats().offloaded_tensors == 6
    assert sorted(made) == [False] * 5 + [True]


def test_a_host_view_of_another_layout_would_be_caught(monkeypatch):
    """Companion: a host view whose strides differ from the tensor's (here transposed) scrambles
    what the copy out writes, and the accelerator path's check sees it."""
    typed = HostBuffer.typed

    def transposed(self, dtype, shape, stride):
        return typed(self, dtype, shape, stride).mT if len(shape) == 2 else typed(self, dtype, shape, stride)

    monkeypatch.setattr(HostBuffer, "typed", transposed)
    with stand_in_accelerator():
        assert not torch.equal(run(every_layout), run(every_layout, new_engine()))


def test_copying_a_view_at_an_offset_as_itself_would_be_caught(monkeypatch):
    """Companion: a slice at an offset copied as itself (into a host view from the buffer's
    start) comes back shifted when its storage is rebuilt from the host bytes."""
    init = HostCopy.__init__

    def always_whole(self, *args):
        init(self, *args)
        self.whole = True

    monkeypatch.setattr(HostCopy, "__init__", always_whole)
    assert not torch.equal(run(sliced), run(sliced, new_engine()))


def test_protected_storages_and_views_of_them_stay():
    engine = new_engine()
    weight = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True) * 2  # an activation, not a leaf
    with scope(engine, protected=(weight,)):
        # linear saves weight.t(): a plain tensor sharing the parameter's storage.
        loss = torch.nn.functional.linear(x, weight).sum()
    loss.backward()
    stats = engine.stats()
    assert stats.kept_tensors["parameter"] == 1
    assert stats.offloaded_tensors == 1  # x itself, saved for the weight's gradient


def test_a_leaf_that_requires_grad_is_kept_not_copied():
    """An input that requires grad (the embeddings' output, which transformers' checkpointing makes
    require grad when the embeddings are frozen) is a leaf of the graph: kept as itself, not
    copied. Its gradient is exact."""
    engine = new_engine()
    x = torch.randn(1024, requires_grad=True)
    with scope(engine):
        loss = (x.sin() * 2).sum()  # sin saves x
    loss.backward()
    stats = engine.stats()
    assert stats.kept_tensors["leaf"] == 1 and stats.offloaded_tensors == 0
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


def test_why_a_leaf_is_kept_copying_it_frees_nothing():
    """The reason for the rule: a leaf that requires grad outlives its saved copy, because
    autograd's AccumulateGrad node holds it until backward. Packed away by hooks that keep no
    reference (what an offload would do), its storage is still alive after the forward."""
    x = torch.randn(1024, requires_grad=True)
    storage = weakref.ref(x.untyped_storage())
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.shape, lambda shape: torch.zeros(shape)):
        loss = x.sin().sum()
    del x
    gc.collect()
    assert storage() is not None
    activation = torch.randn(1024, requires_grad=True) * 2  # an activation, for contrast
    storage = weakref.ref(activation.untyped_storage())
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.shape, lambda shape: torch.zeros(shape)):
        loss = activation.sin().sum()
    del activation
    gc.collect()
    assert storage() is None and loss is not None


def test_kept_scope_offloads_nothing():
    engine = new_engine()
    x = torch.randn(1024, requires_grad=True)
    with scope(engine, keep=True):
        loss = x.sin().sum()
    loss.backward()
    stats = engine.stats()
    assert stats.offloaded_tensors == 0 and stats.kept_tensors["kept_layer"] == 1


@pytest.mark.parametrize("training,grad", [(False, True), (True, False)])
def test_no_scope_without_training_and_grad(training, grad):
    engine = new_engine()
    x = torch.randn(16, requires_grad=True)
    with (
        torch.set_grad_enabled(grad),
        engine.layer_scope(
            training=training,
            device=x.device,
            starts_pass=True,
            keep=False,
            protected=lambda: (),
            pass_protected=lambda: (),
            name="toy",
        ),
    ):
        x.sin()
    assert engine.stats().total_layer_scopes == 0 and engine.stats().total_pack_calls == 0


def test_deepcopy_gives_an_independent_engine():
    engine = new_engine()
    run(saved_twice, engine)
    clone = copy.deepcopy(engine)
    assert clone is not engine
    assert clone.stats().total_pack_calls == 0
    assert (clone.min_offload_bytes, clone.simulate_on_cpu) == (0, True)
