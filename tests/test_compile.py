"""torch.compile with activation offloading: decoder layers compiled one by one (`layer.compile()`,
`torch.compile(layer)`) and the whole model (`torch.compile(model)`).

What happens: dynamo cannot trace hf_offload's layer scope (saved-tensor hooks, host copies), so
it breaks the graph at the wrapper around each decoder layer, runs the scope eagerly and compiles
the layer's own forward as a separate frame. The AOTAutograd-compiled function of that frame saves
its tensors for backward through the hooks that are active when it runs, so they are offloaded
like eager ones: results are bit-identical to the same compiled model without offloading. The
whole model is then compiled as several graphs (split at every decoder layer), and
`fullgraph=True` raises. See docs/compile.md.

The wrapper holds the class forward as functools.partial(type(self).forward, self): a bound
method held across that graph break is rebuilt by dynamo as `self.forward`, the wrapper itself,
and recursed until RecursionError (the regression these tests first caught).

Most tests use the "aot_eager" backend: dynamo plus AOTAutograd (which produces the compiled
autograd function whose saved tensors reach the hooks), without inductor's C++ build, which is
slow on a CPU. One test runs the default backend, inductor, on a one-layer model.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
import torch._dynamo
from conftest import assert_bit_identical, batch, enable_sim, tiny_model, train_step, twin
from routing import parameter_ptrs, spy_host_copies
from torch._dynamo.utils import counters

import hf_offload
from hf_offload.adapters import UnsupportedModelError
from hf_offload.engine.streams import simulated_schedule

BACKEND = "aot_eager"
LAYERS = 2
HF_OFFLOAD = os.path.dirname(hf_offload.__file__)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def compile_layers_in_place(model, backend=BACKEND):
    for layer in model.model.layers:
        layer.compile(backend=backend)
    return model


def replace_layers_with_compiled(model, backend=BACKEND):
    layers = model.model.layers
    for index, layer in enumerate(layers):
        layers[index] = torch.compile(layer, backend=backend)
    return model


def compile_model(model, backend=BACKEND):
    return torch.compile(model, backend=backend)


COMPILERS = {
    "layer.compile()": compile_layers_in_place,
    "torch.compile(layer)": replace_layers_with_compiled,
    "torch.compile(model)": compile_model,
}


def twins(layers=LAYERS):
    """The same model twice; the second offloads every layer (keep_last_layers=0)."""
    plain = tiny_model("llama", num_hidden_layers=layers)
    offloaded = twin(plain)
    enable_sim(offloaded, keep_last_layers=0)
    return plain, offloaded


def unprefixed(grads):
    # torch.compile(layer) and torch.compile(model) insert "_orig_mod." into parameter names.
    return {name.replace("_orig_mod.", ""): grad for name, grad in grads.items()}


def assert_engaged(model, copied, steps_so_far, layers=LAYERS):
    stats = hf_offload.activation_offloading_stats(model)
    assert stats.mode == "cpu-simulation"
    assert stats.offloaded_tensors > 0 and len(copied) == stats.offloaded_tensors
    assert stats.layers_offloaded == layers
    assert stats.total_layer_scopes == layers * steps_so_far
    assert stats.kept_tensors["parameter"] > 0
    assert stats.restored_tensors >= stats.offloaded_tensors
    assert not {s.data_ptr() for s in copied} & parameter_ptrs(model), "a parameter was offloaded"
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0


@pytest.mark.parametrize("how", sorted(COMPILERS))
def test_compiled_training_is_bit_identical_and_offloads(how, monkeypatch):
    """Enable offloading, then compile: two steps give the same loss and gradients as the same
    compiled model without offloading, and the engine offloaded the compiled layers' tensors."""
    plain, offloaded = twins()
    compiled_plain, compiled_offloaded = COMPILERS[how](plain), COMPILERS[how](offloaded)
    ids = batch()
    for step in range(2):
        expected_loss, expected_grads = train_step(compiled_plain, ids)
        with spy_host_copies(monkeypatch) as copied:
            loss, grads = train_step(compiled_offloaded, ids)
        assert torch.equal(expected_loss, loss), f"step {step}: loss differs"
        assert_bit_identical(unprefixed(expected_grads), unprefixed(grads))
        assert_engaged(offloaded, copied, steps_so_far=step + 1)
    assert counters["aot_autograd"]["total"] > 0, "nothing was compiled"


def test_compiled_layers_under_the_race_checker():
    """Compiled layers, copies executed as late as the engine's orderings allow: still exact."""
    plain, offloaded = twins()
    compile_layers_in_place(plain)
    compile_layers_in_place(offloaded)
    ids = batch()
    expected_loss, expected_grads = train_step(plain, ids)
    with simulated_schedule("lazy"):
        for _ in range(2):
            loss, grads = train_step(offloaded, ids)
            assert torch.equal(expected_loss, loss)
            assert_bit_identical(expected_grads, grads)
    assert hf_offload.activation_offloading_stats(offloaded).offloaded_tensors > 0


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_inductor_compiled_layer(monkeypatch):
    """The default backend (inductor, C++ kernels on the CPU) on a one-layer model: exact, and
    the layer's saved tensors are offloaded. About 25 s with a cold inductor cache."""
    plain, offloaded = twins(layers=1)
    plain.model.layers[0].compile()
    offloaded.model.layers[0].compile()
    ids = batch()
    expected_loss, expected_grads = train_step(plain, ids)
    with spy_host_copies(monkeypatch) as copied:
        loss, grads = train_step(offloaded, ids)
    assert torch.equal(expected_loss, loss)
    assert_bit_identical(expected_grads, grads)
    assert_engaged(offloaded, copied, steps_so_far=1, layers=1)


def test_whole_model_compile_is_split_at_the_decoder_layers():
    """torch.compile(model) without offloading captures this model in one graph; with offloading
    the graph breaks at each decoder layer's offload scope, so more graphs are compiled."""
    ids = batch()
    plain, offloaded = twins()
    train_step(compile_model(plain), ids)
    plain_graphs, plain_breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    torch._dynamo.reset()
    counters.clear()
    train_step(compile_model(offloaded), ids)
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    assert graphs > plain_graphs >= 1
    assert not any("hf_offload" in reason or "_current_graph_task_id" in reason for reason in plain_breaks)
    assert any("hf_offload" in reason or "_current_graph_task_id" in reason for reason in breaks), breaks


def test_fullgraph_raises():
    """fullgraph=True cannot work: the offload scope is not traceable. It raises, never silently
    compiles without offloading."""
    _, offloaded = twins()
    compiled = torch.compile(offloaded, backend=BACKEND, fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        train_step(compiled, batch())


def test_fullgraph_error_names_hf_offload():
    _, offloaded = twins()
    compiled = torch.compile(offloaded, backend=BACKEND, fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported) as error:
        train_step(compiled, batch())
    explanation = str(error.value).split("from user code:")[0]  # the user stack names every file
    assert "hf_offload" in explanation and "_current_graph_task_id" not in explanation


def test_dynamo_never_compiles_engine_code():
    """Every FX graph dynamo builds while the compiled layers train comes from the model, none
    from hf_offload's engine or its scope around the layers: the engine's copies, streams and
    events must run as written. (Tiling's pass-through around transformers' attention functions,
    installed while any tiled model is alive, may be traced: it only calls the function.)"""
    from torch._dynamo.backends.registry import lookup_backend

    sources: set[str] = set()

    def recording_backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            sources.update(re.findall(r'File "([^"]+)"', node.meta.get("stack_trace") or ""))
        return lookup_backend(BACKEND)(graph_module, example_inputs)

    _, offloaded = twins()
    compile_layers_in_place(offloaded, backend=recording_backend)
    for _ in range(2):
        train_step(offloaded, batch())
    assert sources, "no graph was recorded"
    engine = (os.path.join(HF_OFFLOAD, "engine"), os.path.join(HF_OFFLOAD, "api.py"))
    assert not [source for source in sources if source.startswith(engine)], sources


def test_running_under_compile_is_reported_once(caplog):
    """Eager training logs nothing about compile; compiled training logs one line that names
    torch.compile and fullgraph=True."""
    _, offloaded = twins()
    with caplog.at_level("WARNING", logger="hf_offload"):
        train_step(offloaded, batch())
        assert not [r for r in caplog.records if "torch.compile" in r.getMessage()]
        compiled = compile_model(offloaded)
        for _ in range(2):
            train_step(compiled, batch())
    notes = [r for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(notes) == 1 and "fullgraph=True" in notes[0].getMessage()


def test_enable_after_replacing_layers_with_compiled_ones():
    """`model.model.layers[i] = torch.compile(layer)` first, then enabling: the same as enabling first."""
    plain, offloaded = twins()
    hf_offload.disable_activation_offloading(offloaded)
    replace_layers_with_compiled(plain)
    replace_layers_with_compiled(offloaded)
    enable_sim(offloaded, keep_last_layers=0)
    expected_loss, expected_grads = train_step(plain, batch())
    loss, grads = train_step(offloaded, batch())
    assert torch.equal(expected_loss, loss)
    assert_bit_identical(unprefixed(expected_grads), unprefixed(grads))
    assert hf_offload.activation_offloading_stats(offloaded).offloaded_tensors > 0


def test_enabling_on_compiled_layers_fails_loudly_or_works():
    """Never a silent no-op: enabling after replacing the layers either raises an error naming
    the class it found or offloads."""
    _, offloaded = twins()
    hf_offload.disable_activation_offloading(offloaded)
    replace_layers_with_compiled(offloaded)
    try:
        enable_sim(offloaded, keep_last_layers=0)
    except UnsupportedModelError as error:
        assert "OptimizedModule" in str(error)
        return
    train_step(offloaded, batch())
    assert hf_offload.activation_offloading_stats(offloaded).offloaded_tensors > 0


def test_the_trl_notice_does_not_break_a_compiled_backbones_graph():
    """Tiling's loss head puts a pre-hook on the backbone that reads the call stack for TRL's fused
    head (to say once that the loss head is TRL's). Compiled, the backbone's graph must not break
    there: reading frames is untraceable, so the hook stands aside under compile (without that
    guard dynamo breaks at `sys._getframe` on every call; checked)."""
    model = tiny_model()
    hf_offload.enable_sequence_tiling(model, tile_tokens=4)
    model.model.compile(backend=BACKEND)
    counters.clear()
    model.model(input_ids=batch(seq=16)).last_hidden_state.sum().backward()
    breaks = dict(counters["graph_break"])
    assert breaks, "the tiled modules break the graph by design: the count must have been read"
    assert not any("_getframe" in reason for reason in breaks), breaks
