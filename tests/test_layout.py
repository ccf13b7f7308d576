"""The package's layout. The product never loads the tools: a training step with offloading and
tiling imports nothing under `hf_offload.tools` (the command, the benchmarks, the simulator), nor
Liger or TRL. Its imports keep the layers pyproject.toml's import-linter contracts name, and no
module imports itself through others (no circle); a copy of the package with a circle and
forbidden imports added breaks both checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import tomllib

import hf_offload
from hf_offload.tiling import attention as attention_tiling

ROOT = Path(hf_offload.__file__).resolve().parent.parent

TRAIN_AND_LIST_MODULES = """
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import hf_offload

model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
model.enable_activation_offloading(simulate_on_cpu=True, min_offload_bytes=0)
model.enable_sequence_tiling(tile_tokens=8)
ids = torch.randint(128, (1, 16))
model(input_ids=ids, labels=ids).loss.backward()
assert model.activation_offloading_stats().offloaded_tensors > 0
assert model.is_sequence_tiling
print("\\n".join(sorted(sys.modules)))
"""


def loaded_modules(code: str) -> set[str]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(result.stdout.split())


def test_training_with_offloading_loads_no_tool_and_no_other_library():
    modules = loaded_modules(TRAIN_AND_LIST_MODULES)
    assert "hf_offload.engine.offloader" in modules  # the step did run the engine
    assert "hf_offload.tiling.per_token" in modules
    assert not {name for name in modules if name.startswith("hf_offload.tools")}
    assert not {name for name in modules if name.split(".")[0] in ("liger_kernel", "trl")}


def test_the_check_sees_a_tool_when_one_is_loaded():
    """Companion: the same listing shows a tool module once something imports it."""
    modules = loaded_modules(TRAIN_AND_LIST_MODULES.replace("import hf_offload\n", "import hf_offload.tools.bench\n"))
    assert "hf_offload.tools.bench" in modules


LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"

# Every circle among the package's modules (strongly connected components of grimp's graph, every
# import counted: those inside functions and under TYPE_CHECKING too), as lists of module names.
CIRCLES = """
import json, sys
import grimp

graph = grimp.build_graph("hf_offload", cache_dir=None)
edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
index, low, stack, on_stack, circles = {}, {}, [], set(), []


def visit(module):
    index[module] = low[module] = len(index)
    stack.append(module)
    on_stack.add(module)
    for imported in edges[module]:
        if imported not in index:
            visit(imported)
            low[module] = min(low[module], low[imported])
        elif imported in on_stack:
            low[module] = min(low[module], index[imported])
    if low[module] == index[module]:
        component = []
        while not component or component[-1] != module:
            component.append(stack.pop())
            on_stack.discard(component[-1])
        if len(component) > 1:
            circles.append(sorted(component))


sys.setrecursionlimit(10_000)
for module in edges:
    if module not in index:
        visit(module)
print(json.dumps(circles))
"""


def in_package_at(root: Path, code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter whose `hf_offload` is the one under `root`, from `root`
    (where lint-imports reads pyproject.toml)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def circles_in(root: Path) -> list[list[str]]:
    done = in_package_at(root, CIRCLES)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_import_contracts_are_kept():
    done = in_package_at(ROOT, LINT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout


def test_no_module_imports_itself_through_others():
    assert circles_in(ROOT) == []


@pytest.fixture(scope="module")
def broken_copy(tmp_path_factory) -> Path:
    """A copy of the package and its pyproject.toml with the circle issue 47 found put back (attention
    tiling asking sequence parallelism, inside a function, as it did), the engine importing
    transformers, and the offloading API importing a tool."""
    root = tmp_path_factory.mktemp("layout")
    shutil.copytree(ROOT / "hf_offload", root / "hf_offload", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    appended = {
        "tiling/attention.py": "def _adopt():\n    from ..integrations.sequence_parallel import adopt_ulysses\n",
        "engine/stats.py": "def _config():\n    from transformers import PretrainedConfig\n",
        "api.py": "def _step_time():\n    from .tools import step_time\n",
    }
    for path, code in appended.items():
        with open(root / "hf_offload" / path, "a") as file:
            file.write("\n\n" + code)
    return root


def test_a_circle_and_forbidden_imports_break_the_contracts(broken_copy):
    """Companion: each contract fails on the copy, naming the import that breaks it."""
    done = in_package_at(broken_copy, LINT)
    assert done.returncode == 1, done.stdout + done.stderr
    report = " ".join(done.stdout.split())  # rich wraps long lines
    bare = "".join(done.stdout.split())  # and may write a long name and its verdict without a space
    for name in ("engine", "product", "layers"):
        contract = next(c for c in CONTRACTS if c["id"] == name)["name"]
        assert "".join(contract.split()) + "BROKEN" in bare
    assert "hf_offload.engine.stats -> transformers" in report
    assert "hf_offload.api -> hf_offload.tools.step_time" in report
    assert "hf_offload.tiling.attention -> hf_offload.integrations.sequence_parallel" in report


def test_the_circle_finder_finds_the_circle(broken_copy):
    """Companion: the copy's circle, every module on it."""
    assert circles_in(broken_copy) == [
        ["hf_offload.integrations.sequence_parallel", "hf_offload.tiling.attention", "hf_offload.tiling.ulysses_heads"]
    ]


CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def unplaced_integrations(module_names: list[str], layers: list[str]) -> list[str]:
    """The modules of `hf_offload.integrations` no layer names (the layers contract places them one
    by one; import-linter's exhaustiveness looks only at the rooms)."""
    placed = {tail.strip() for layer in layers for tail in layer.replace(":", "|").split("|")}
    return [name for name in module_names if f"integrations.{name}" not in placed]


def integrations_modules() -> list[str]:
    return sorted(p.stem for p in (ROOT / "hf_offload" / "integrations").glob("*.py") if p.stem != "__init__")


def test_every_integration_has_its_layer():
    layers = next(c for c in CONTRACTS if c["id"] == "layers")["layers"]
    assert unplaced_integrations(integrations_modules(), layers) == []


def test_an_integration_without_a_layer_is_named():
    """Companion: a new module the layers leave out is named."""
    layers = next(c for c in CONTRACTS if c["id"] == "layers")["layers"]
    assert unplaced_integrations([*integrations_modules(), "a_new_integration"], layers) == ["a_new_integration"]


def ulysses_registered_as_by_accelerate(monkeypatch):
    """DeepSpeed's Ulysses registered as accelerate's or the Trainer's `prepare` registers it: a
    wrapper from its module in ALL_ATTENTION_FUNCTIONS for sdpa, holding its attention module
    (here one never initialised: only adopting it is looked at), calling the registered sdpa."""
    ulysses_sp = pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    held = object.__new__(ulysses_sp.UlyssesSPAttentionHF)
    # What hf_offload's chunked forward reads of it (without them DeepSpeed's own forward is kept).
    held.world_size, held.process_group, held.attn = 2, None, None

    def registered(*args, **kwargs):
        assert held is not None  # in the closure, where DeepSpeed's wrapper holds its attention
        return AttentionInterface._global_mapping["sdpa"](*args, **kwargs)

    registered.__module__ = ulysses_sp.__name__
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", registered)
    return held


def train_tiled_and_disable(held) -> tuple[bool, bool]:
    """A tiled training step, then tiling disabled: (the Ulysses module adopted, put back)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(config)
    model.enable_sequence_tiling(tile_tokens=8)
    ids = torch.randint(128, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    adopted = "forward" in held.__dict__
    model.disable_sequence_tiling()
    return adopted, "forward" not in held.__dict__


def test_a_ulysses_registration_by_others_is_adopted_through_tilings_seam(monkeypatch):
    """Tiling's door plugs the chunked exchange into attention tiling's seam when the package is
    imported (accelerate and the Trainer never import hf_offload's sequence_parallel): a tiled
    block's call adopts their Ulysses attention; disabling tiling puts DeepSpeed's forward back."""
    held = ulysses_registered_as_by_accelerate(monkeypatch)
    # Release comes when no model of the process tiles heads: models an earlier test left alive are not this one's.
    monkeypatch.setattr(attention_tiling, "_live", weakref.WeakSet())
    assert train_tiled_and_disable(held) == (True, True)


def test_without_the_seams_entry_ulysses_is_not_adopted(monkeypatch):
    """Companion: with the door's entry taken out of the seam, the same step leaves it alone."""
    held = ulysses_registered_as_by_accelerate(monkeypatch)
    monkeypatch.delitem(attention_tiling._outer, "deepspeed_ulysses")
    assert train_tiled_and_disable(held) == (False, True)


def test_importing_tiling_plugs_in_ulysses():
    """In a fresh interpreter, importing tiling alone fills the seam with sequence parallelism's
    functions (what accelerate's path relies on: nobody else imports them)."""
    code = (
        "from hf_offload.tiling import attention; from hf_offload.integrations import sequence_parallel as sp; "
        "outer = attention._outer['deepspeed_ulysses']; "
        "print(outer.before_block is sp.adopt_ulysses and outer.released is sp.release_ulysses)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]


def test_the_seam_refuses_a_bad_registration():
    with pytest.raises(ValueError, match="name must be a non-empty str, got ''"):
        attention_tiling.register_outer_attention("", print, print)
    with pytest.raises(TypeError, match=r"register_outer_attention\('x'\): released must be callable, got None"):
        attention_tiling.register_outer_attention("x", print, None)
    assert "x" not in attention_tiling._outer
