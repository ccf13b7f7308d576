"""`import hf_offload` imports neither torch nor transformers, and the one-line use still works:
the model methods are on PreTrainedModel whether transformers' models were imported before
hf_offload or after it, and every public name imports from the package."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import transformers.modeling_utils
from conftest import tiny_model

import hf_offload
from hf_offload import model_methods

# In a fresh interpreter: hf_offload first, then a model through transformers' lazy module (the
# usual `from transformers import ...`), then transformers.modeling_utils executed again.
AFTER = """
import importlib, json, sys
import hf_offload
report = {"imported": [name for name in ("torch", "transformers") if name in sys.modules]}
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=97)
model = LlamaForCausalLM(config)
model.enable_activation_offloading(simulate_on_cpu=True)
model.enable_sequence_tiling()
report["enabled"] = [model.is_activation_offloading, model.is_sequence_tiling]
modeling_utils = importlib.import_module("transformers.modeling_utils")
report["loader"] = type(modeling_utils.__loader__).__name__
old = modeling_utils.PreTrainedModel
importlib.reload(modeling_utils)
new = modeling_utils.PreTrainedModel
report["reloaded"] = [new is not old, hasattr(new, "enable_sequence_tiling")]
print(json.dumps(report))
"""


def test_methods_are_added_when_transformers_is_imported_after_hf_offload():
    done = subprocess.run([sys.executable, "-c", AFTER], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["imported"] == []
    assert report["enabled"] == [True, True]
    assert report["loader"] == "SourceFileLoader"  # the module keeps its own loader, not the finder's wrapper
    assert report["reloaded"] == [True, True]


# hf_offload first, then an import hook ahead of ours that serves transformers' modules itself, as
# typeguard's install_import_hook("transformers") does: the spec from the path finder, its own loader.
HOOK_AHEAD = """
import importlib.abc, importlib.machinery, importlib, json, sys
import hf_offload


class Instrumenting(importlib.machinery.SourceFileLoader):
    pass


class ServesTransformers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] != "transformers":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return None
        spec.loader = Instrumenting(spec.loader.name, spec.loader.path)
        return spec


sys.meta_path.insert(0, ServesTransformers())
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=97)
model = LlamaForCausalLM(config)
model.enable_activation_offloading(simulate_on_cpu=True)
loader = type(importlib.import_module("transformers.modeling_utils").__loader__).__name__
print(json.dumps({"loader": loader, "offloading": model.is_activation_offloading}))
"""


def test_methods_are_there_when_an_import_hook_ahead_of_ours_serves_transformers():
    """Our finder is never asked for transformers.modeling_utils: the methods go on when the model is
    built (torch's hook on submodule registration, registered when torch loaded). Before, the model
    had no enable_activation_offloading (AttributeError)."""
    done = subprocess.run([sys.executable, "-c", HOOK_AHEAD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"loader": "Instrumenting", "offloading": True}


def test_a_model_built_where_pretrainedmodel_lacks_the_methods_gets_them(monkeypatch):
    """The fallback on its own, in this process (torch was loaded before hf_offload here, so its hook
    was registered at import: what covers an import hook ahead of ours that serves every module):
    with the methods gone from PreTrainedModel and our finder out of sys.meta_path, building a model
    puts them back."""
    names = [*model_methods.METHODS, *model_methods.PROPERTIES]
    for name in names:
        monkeypatch.delattr(transformers.modeling_utils.PreTrainedModel, name)
    monkeypatch.setattr(model_methods, "_added", False)
    finders = [finder for finder in sys.meta_path if not isinstance(finder, model_methods.ModelMethodsFinder)]
    monkeypatch.setattr(sys, "meta_path", finders)
    model = tiny_model()
    assert all(name in transformers.modeling_utils.PreTrainedModel.__dict__ for name in names)
    model.enable_activation_offloading(simulate_on_cpu=True)
    assert model.is_activation_offloading


def test_methods_are_added_when_transformers_was_imported_first(monkeypatch):
    """hf_offload's own code run again with transformers imported and the methods gone: they are
    added at once (the finder, removed too, cannot be what adds them)."""
    names = [*model_methods.METHODS, *model_methods.PROPERTIES]
    for name in names:
        monkeypatch.delattr(transformers.modeling_utils.PreTrainedModel, name)
    finders = [finder for finder in sys.meta_path if not isinstance(finder, model_methods.ModelMethodsFinder)]
    monkeypatch.setattr(sys, "meta_path", finders)
    assert not hasattr(tiny_model(), "enable_activation_offloading")
    importlib.reload(hf_offload)
    importlib.reload(hf_offload)  # as often as it runs, one finder
    assert sum(isinstance(finder, model_methods.ModelMethodsFinder) for finder in sys.meta_path) == 1
    model = tiny_model()
    model.enable_activation_offloading(simulate_on_cpu=True)
    model.enable_sequence_tiling(tile_tokens=4)
    assert model.is_activation_offloading and model.is_sequence_tiling
    model.disable_activation_offloading()
    model.disable_sequence_tiling()
    assert not model.is_activation_offloading and not model.is_sequence_tiling


def test_a_method_is_the_function_bound_to_the_model():
    """Its signature and docstring are the function's; a property has no setter, as before."""
    model = tiny_model()
    assert model.enable_activation_offloading.__func__ is hf_offload.enable_activation_offloading
    assert model.enable_sequence_tiling.__doc__ == hf_offload.enable_sequence_tiling.__doc__
    assert transformers.PreTrainedModel.is_sequence_tiling.__doc__ == hf_offload.is_sequence_tiling.__doc__
    try:
        model.is_activation_offloading = True
    except AttributeError as error:
        assert "has no setter" in str(error)
    else:
        raise AssertionError("is_activation_offloading took a value")


def test_every_public_name_imports_from_the_package():
    """From its home, the same object; the names for type checkers are the same names."""
    for name in hf_offload.__all__:
        home = importlib.import_module(hf_offload._HOMES[name], "hf_offload")
        assert getattr(hf_offload, name) is getattr(home, name)
        namespace: dict = {}
        exec(f"from hf_offload import {name}", namespace)
        assert namespace[name] is getattr(home, name)
    assert sorted(hf_offload._HOMES) == sorted(hf_offload.__all__)
    tree = ast.parse(Path(hf_offload.__file__).read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
    typed = {alias.name: "." + node.module for node in block.body for alias in node.names}
    assert typed == hf_offload._HOMES
    assert hf_offload.api.MODEL_STATE_ATTR  # a submodule, as when the package imported it
