"""The methods `import hf_offload` adds to transformers' `PreTrainedModel`, added without
importing transformers or torch: `import hf_offload` stays cheap (the `hf-offload` command
checks its arguments before paying for either), and the one-line use works whichever of
`import hf_offload` and transformers' models comes first.

If `transformers.modeling_utils` is already imported, the methods go on its `PreTrainedModel`
at once. Either way a finder at the front of `sys.meta_path` stays for the process: when
`transformers.modeling_utils` executes (a first import through transformers' lazy module or
directly, or `importlib.reload`), it adds them to the class that module has just defined.

An import hook put ahead of ours later may serve that module itself and never ask ours
(typeguard's and jaxtyping's take the spec from the path finder and load it their way). So the
methods also go on when a model is built: torch's global hook on submodule registration, which
every model's construction runs, adds them where PreTrainedModel lacks them. It is registered as
soon as torch is loaded, at `import hf_offload` or at the first import after that which reaches
our finder; only a hook ahead of ours that serves torch as well, from `import hf_offload` on,
leaves both unasked (docs/api.md says what to do then).

Each method is looked up in its home (`hf_offload.api`, `hf_offload.tiling`) on first use, not
when it is added: the finder runs in the middle of transformers' own imports, where importing
hf_offload's model code (which imports transformers' modules) could meet a half-imported one."""

from __future__ import annotations

import importlib
import sys
import threading
import types
from importlib.abc import Loader, MetaPathFinder

MODULE = "transformers.modeling_utils"

# The model's methods and properties: each hf_offload's public function of that name, found in its
# home (the package's `_HOMES`) on first use.
METHODS = (
    "enable_activation_offloading",
    "disable_activation_offloading",
    "activation_offloading_stats",
    "enable_sequence_tiling",
    "disable_sequence_tiling",
)
PROPERTIES = ("is_activation_offloading", "is_sequence_tiling")


class _ModelMethod:
    # `model.NAME(...)` is hf_offload's NAME(model, ...): the function bound to the model, with its
    # own signature and docstring; `PreTrainedModel.NAME` is the function. A non-data descriptor, as
    # a function is: an instance may shadow it.

    def __init__(self, name: str) -> None:
        self.name = name

    def function(self):
        return getattr(importlib.import_module("hf_offload"), self.name)

    def __get__(self, model, owner=None):
        return self.function() if model is None else types.MethodType(self.function(), model)


class _ModelProperty(_ModelMethod):
    # `model.NAME` is hf_offload's NAME(model), read-only, as a property without a setter.

    def __get__(self, model, owner=None):
        return self if model is None else self.function()(model)

    def __set__(self, model, value) -> None:
        raise AttributeError(f"property {self.name!r} of {type(model).__name__!r} object has no setter")

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self.function().__doc__


def _add_methods_to(module) -> None:
    """The methods on the module's PreTrainedModel; where transformers no longer defines it there,
    said once (the functions of hf_offload work on any model as they do)."""
    model_class = getattr(module, "PreTrainedModel", None)
    if model_class is None:
        from .integrations.upstream import announce

        announce("transformers.pretrained_model")
        return
    _add_methods(model_class)


_added = False  # the methods are on a PreTrainedModel (the one a reload of its module replaces gets them again)


def _add_methods(model_class: type) -> None:
    global _added
    for name in METHODS:
        setattr(model_class, name, _ModelMethod(name))
    for name in PROPERTIES:
        setattr(model_class, name, _ModelProperty(name))
    _added = True


def _add_where_missing() -> None:
    """The methods on transformers' PreTrainedModel, if it is defined and lacks them."""
    model_class = getattr(sys.modules.get(MODULE), "PreTrainedModel", None)
    if model_class is not None and METHODS[0] not in model_class.__dict__:
        _add_methods(model_class)


_watching_construction: list = []  # the handle of torch's registration hook, once registered


def _on_module_registration(_module, _name, _submodule) -> None:
    # Once added, nothing to do: transformers registers modules in every forward (a sliced
    # ModuleList of layers), under torch.compile too, where a flag is all it traces.
    if not _added:
        _add_where_missing()


def _watch_model_construction() -> None:
    """Register `_on_module_registration` with torch, once torch's module code is loaded (never
    importing it: `import hf_offload` stays cheap). Never removed (torch iterates its hooks while
    calling them, so the hook cannot remove itself); a flag read per registration once added."""
    if _watching_construction:
        return
    register = getattr(sys.modules.get("torch.nn.modules.module"), "register_module_module_registration_hook", None)
    if register is not None:
        _watching_construction.append(register(_on_module_registration))


class _AddMethodsAfterExecution(Loader):
    """The loader of `transformers.modeling_utils`, wrapped: executes the module, then adds the
    methods to its `PreTrainedModel`. The module keeps the real loader as its `__loader__`."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _add_methods_to(module)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


class ModelMethodsFinder(MetaPathFinder):
    """Finds nothing itself: asks the other finders for `transformers.modeling_utils` and wraps the
    loader of what they find."""

    def __init__(self) -> None:
        # Another finder that asks the rest of sys.meta_path in turn (wrapt's post-import hooks
        # do) would ask this one again, and so on without end: the second ask finds nothing.
        self._asking = threading.local()

    def find_spec(self, fullname, path, target=None):
        if not _watching_construction:  # torch may have been loaded since
            _watch_model_construction()
        if fullname != MODULE or getattr(self._asking, "now", False):
            return None
        self._asking.now = True
        try:
            for finder in sys.meta_path:
                find_spec = getattr(finder, "find_spec", None)
                if finder is self or find_spec is None:
                    continue
                spec = find_spec(fullname, path, target)
                if spec is None:
                    continue
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AddMethodsAfterExecution(spec.loader)
                return spec
            return None
        finally:
            self._asking.now = False


def install() -> None:
    """Add the methods to `PreTrainedModel` now if transformers has defined it, whenever
    `transformers.modeling_utils` executes, and when a model is built without them. Idempotent."""
    module = sys.modules.get(MODULE)
    if module is not None and hasattr(module, "PreTrainedModel"):  # else: still executing, or without it
        _add_methods(module.PreTrainedModel)
    _watch_model_construction()
    # By class name: after importlib.reload of this module the class is a new object.
    if not any(type(finder).__name__ == ModelMethodsFinder.__name__ for finder in sys.meta_path):
        sys.meta_path.insert(0, ModelMethodsFinder())
