"""Independent accounts of what a layer saves, to check what the engine routed."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from conftest import assert_bit_identical, batch, train_step

import hf_offload
from hf_offload.adapters import resolve_layers, unwrap_model
from hf_offload.engine.offloader import DeviceContext


@contextlib.contextmanager
def spy_host_copies(monkeypatch) -> Iterator[list[torch.UntypedStorage]]:
    """Every device storage the engine copies to the host, in order."""
    copied: list[torch.UntypedStorage] = []
    original = DeviceContext.offload_async

    def recording_offload_async(self, copies, engine):
        copied.extend(copy.source for copy in copies)
        return original(self, copies, engine)

    monkeypatch.setattr(DeviceContext, "offload_async", recording_offload_async)
    yield copied
    monkeypatch.setattr(DeviceContext, "offload_async", original)


def parameter_ptrs(model: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}


@contextlib.contextmanager
def record_layer_saves(model: torch.nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Per decoder layer (forward order), the tensors autograd saved inside its call, recorded by
    a hooks context entered and left by module hooks, outside any checkpoint, as a reference."""
    _, layers = resolve_layers(unwrap_model(model))
    saved: list[list[torch.Tensor]] = [[] for _ in layers]
    contexts: list[contextlib.ExitStack] = []
    handles = []
    for index, layer in enumerate(layers):

        def pre_hook(module, args, index=index):
            stack = contextlib.ExitStack()

            def pack(tensor):
                saved[index].append(tensor)
                return tensor.detach()

            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            contexts.append(stack)

        def post_hook(module, args, output):
            contexts.pop().close()

        handles.append(layer.register_forward_pre_hook(pre_hook))
        handles.append(layer.register_forward_hook(post_hook))
    try:
        yield saved
    finally:
        for handle in handles:
            handle.remove()


def expected_offload(model: torch.nn.Module, saved: list[list[torch.Tensor]], keep_last_layers: int = 1):
    """(tensors, bytes) the engine should offload with min_offload_bytes=0: every non-parameter
    storage saved in an offloaded layer, once per storage and version, but leaves that require
    grad (the graph holds those anyway), except layer 0's input where it is the embeddings' output
    (under checkpointing with LoRA: layer 0 takes it detoured, and it is offloaded)."""
    protected = parameter_ptrs(model)
    seen = set()
    count = total = 0
    for position, layer_saves in enumerate(saved[: len(saved) - keep_last_layers]):
        for index, tensor in enumerate(layer_saves):
            storage = tensor.untyped_storage()
            if storage.data_ptr() in protected or tensor.numel() == 0:
                continue
            detoured = position == 0 and index == 0  # the layer's input, saved first by its checkpoint
            if tensor.requires_grad and tensor.grad_fn is None and not detoured:
                continue
            key = (id(storage), tensor._version)
            if key in seen:
                continue
            seen.add(key)
            count += 1
            total += storage.nbytes()
    return count, total


def assert_parity_and_routing(plain, offloaded, monkeypatch, steps: int = 2) -> hf_offload.OffloadStats:
    """`steps` training steps on each: identical losses and gradients, the engine offloaded exactly
    the non-parameter storages the layers saved, and never a parameter's storage."""
    ids = batch()
    for step in range(steps):
        with record_layer_saves(plain) as saved:
            expected_loss, expected_grads = train_step(plain, ids)
        with spy_host_copies(monkeypatch) as copied:
            loss, actual_grads = train_step(offloaded, ids)
        assert torch.equal(expected_loss, loss), f"step {step}: loss differs"
        assert_bit_identical(expected_grads, actual_grads)
        stats = hf_offload.activation_offloading_stats(offloaded)
        assert stats.mode == "cpu-simulation"
        assert not {s.data_ptr() for s in copied} & parameter_ptrs(offloaded), "a parameter was offloaded"
        count, nbytes = expected_offload(plain, saved)
        assert count > 0
        assert (stats.offloaded_tensors, stats.offloaded_bytes) == (count, nbytes)
        assert len(copied) == count
        assert stats.host_bytes_held == 0 and stats.live_host_copies == 0
    return stats
