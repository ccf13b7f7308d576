"""transformers' hub kernels (the `kernels` library, a dependency of transformers >= 5.25) under
tiling and offloading, on the CPU.

`kernelize` sets or deletes the instance-level forward of every module whose class kernels
decorated (RMSNorm, rotary), and transformers kernelizes in `from_pretrained` (on by default from
5.25) and again at every train() / eval() that changes the mode: a tiled norm's wrapper is taken
off each time. Tiling puts it back on top of what kernelize chose before the layers run, so a
kernelized RMSNorm still runs a slice at a time (a hub kernel's forward included, here a CPU
kernel mapped through kernels' own `use_kernel_mapping`). A module built without the
`_kernel_funcs` its forward reads (kernels' `use_kernelized_func`) is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from conftest import batch, enable_sim, grads, tiny_model, twin
from torch import nn
from transformers import AutoModelForCausalLM

import hf_offload
from hf_offload.instance_forward import dropped
from hf_offload.tiling import per_token

# A dependency of transformers from 5.25 on (the newest releases CI installs); absent at the oldest
# versions pyproject.toml allows (.ci/oldest), where transformers does not kernelize by default.
kernels = pytest.importorskip("kernels", reason="transformers < 5.25 does not install the kernels library")
Mode, kernelize, use_kernel_mapping = kernels.Mode, kernels.kernelize, kernels.use_kernel_mapping

TILE = 4
CLOSE = dict(rtol=1e-5, atol=1e-6)  # float32 sums over 3 slices instead of one


def norm_widths(monkeypatch, model) -> list[tuple[int, bool]]:
    """(tokens, grad enabled) of every run of the model's RMSNorm class forward (any instance)."""
    widths = []
    cls = type(model.model.norm)
    original = cls.forward

    def spying(self, x):
        widths.append((x.shape[1], torch.is_grad_enabled()))
        return original(self, x)

    monkeypatch.setattr(cls, "forward", spying)
    return widths


def step(model, ids) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), grads(model)


def assert_close(expected, actual) -> None:
    torch.testing.assert_close(actual[0], expected[0], **CLOSE)
    assert actual[1].keys() == expected[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], **CLOSE, msg=name)


@pytest.fixture
def loaded(tmp_path):
    """A tiny Llama as users get one: saved, then loaded with transformers' hub kernels on."""
    tiny_model("llama").save_pretrained(tmp_path / "model")

    def load():
        return AutoModelForCausalLM.from_pretrained(tmp_path / "model", use_kernels=True)

    return load


def test_tiling_survives_the_kernelize_of_every_train_call(loaded, monkeypatch):
    """from_pretrained(use_kernels=True) leaves the model in eval mode; train() kernelizes again,
    which takes tiling's wrapper off every norm. The norms still run a slice at a time with grad on,
    the step is close to the untiled one, and offloading on top stays exact."""
    plain, tiled = loaded(), loaded()
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    offloaded = twin(tiled)
    enable_sim(offloaded)
    for model in (plain, tiled, offloaded):
        model.train()
    norms = [m for m in tiled.modules() if type(m) is type(tiled.model.norm)]
    # The premise: train() kernelized again and took the wrapper off (else this test checks nothing).
    assert norms and all(dropped(norm) for norm in norms)
    ids = batch(seed=3)
    expected = step(plain, ids)
    widths = norm_widths(monkeypatch, tiled)
    actual = step(tiled, ids)
    with_grad = [tokens for tokens, grad in widths if grad]
    assert with_grad and max(with_grad) <= TILE, widths
    assert_close(expected, actual)
    assert all(per_token.is_tiled(norm) and not dropped(norm) for norm in norms)
    loss, offloaded_grads = step(offloaded, ids)
    assert torch.equal(loss, actual[0]) and all(torch.equal(offloaded_grads[n], g) for n, g in actual[1].items())


def test_without_the_guard_kernelize_leaves_the_norms_whole(loaded, monkeypatch):
    """Companion: with the reinstating switched off, the same steps run every norm over the whole
    sequence with grad on: the check above sees the fault."""
    monkeypatch.setattr(per_token, "reinstate", lambda module: False)
    tiled = loaded()
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    tiled.train()
    widths = norm_widths(monkeypatch, tiled)
    step(tiled, batch(seed=3))
    assert max(tokens for tokens, grad in widths if grad) == batch().shape[1]


class SlicedRMSNorm(nn.Module):
    """A hub-kernel stand-in: a stateless layer with RMSNorm's forward, as kernels loads one."""

    def forward(self, hidden_states):
        KERNEL_WIDTHS.append(hidden_states.shape[1])
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        normed = hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * normed.to(hidden_states.dtype)


KERNEL_WIDTHS: list[int] = []


class LocalRepository:
    """A kernels repository that loads the layer above (kernels' protocol: `layer_name`, `load`)."""

    layer_name = "RMSNorm"

    def load(self):
        return SlicedRMSNorm

    def __hash__(self) -> int:
        return hash(type(self))

    def __eq__(self, other) -> bool:
        return type(other) is type(self)


def kernelized(model):
    with use_kernel_mapping({"RMSNorm": {"cpu": LocalRepository()}}):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
    return model


def test_a_hub_kernels_rmsnorm_runs_a_slice_at_a_time():
    """kernels.kernelize with a CPU mapping puts a kernel's forward on every RMSNorm after tiling
    was enabled: the kernel then runs one slice at a time, and the step is close to the untiled
    kernelized model's."""
    plain = kernelized(tiny_model("llama"))
    tiled = twin(tiny_model("llama"))
    tiled.load_state_dict(plain.state_dict())
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    kernelized(tiled)
    assert dropped(tiled.model.norm)  # the premise: kernelize took the wrapper off
    ids = batch(seed=4)
    expected = step(plain, ids)
    KERNEL_WIDTHS.clear()
    actual = step(tiled, ids)
    assert KERNEL_WIDTHS and max(KERNEL_WIDTHS) <= TILE, KERNEL_WIDTHS
    assert_close(expected, actual)


def test_disabling_after_kernelize_keeps_the_kernels_forward():
    model = tiny_model("llama")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    kernelized(model)
    hf_offload.disable_sequence_tiling(model)
    assert not model.is_sequence_tiling
    norm = model.model.norm
    assert norm.forward.__func__ is SlicedRMSNorm.forward
    assert not [name for name in vars(norm) if name.startswith("_hf_offload")]
    assert not [name for m in model.modules() for name in vars(m) if name.startswith("_hf_offload")]


def test_a_module_built_without_kernel_funcs_is_refused_by_name():
    """What DeepSpeed's zero.Init leaves when a modeling module is first imported inside it: an
    attention built with the class's original __init__, whose kernels forward then fails at the
    first call with an AttributeError from deep inside kernels. Enabling says what happened and what
    to do, for offloading and for tiling."""
    model = tiny_model("llama")
    del model.model.layers[1].self_attn.__dict__["_kernel_funcs"]
    with pytest.raises(AttributeError, match="_kernel_funcs"):  # what the model alone does
        model(input_ids=batch())
    for enable in (hf_offload.enable_activation_offloading, hf_offload.enable_sequence_tiling):
        with pytest.raises(RuntimeError, match=r"LlamaAttention \(model\.layers\.1\.self_attn\).*zero\.Init"):
            enable(model)
