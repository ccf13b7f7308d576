"""The inventory of what hf_offload relies on in other libraries (hf_offload/integrations/upstream.py,
docs/upstream.md): for each entry, its name removed from the installed library (what a release that
renames it does), and the feature that uses it run:

- ERROR entries: the feature stops with UpstreamChanged, naming the library, its version, the
  versions checked and the feature (not an AttributeError from deeper down, nor a stand-in left
  unused while the original runs);
- FALLBACK entries: the feature goes on as the entry says, and says so once;
- HELD entries (behaviours no lookup can check): the test named in the entry exists, and holds the
  simulator or the product to the real library.
"""

from __future__ import annotations

import ast
import importlib
import logging
import sys
from pathlib import Path

import pytest
import torch
from conftest import batch, tiny_model
from test_estimate import restore_logging  # noqa: F401 (autouse: the command quiets the loggers)
from transformers import AutoConfig

import hf_offload
from hf_offload.integrations import kernels as kernels_integration
from hf_offload.integrations import sequence_parallel, upstream
from hf_offload.integrations.upstream import ERROR, FALLBACK, HELD, INVENTORY, UpstreamChanged
from hf_offload.tools.simulator import four_bit, linear_attention, stand_ins
from hf_offload.tools.simulator import trl as trl_simulator


class OpsWithout:
    """A custom-op namespace (torch.ops.NAME) without one op: a namespace makes any registered op on
    demand, so the op cannot simply be deleted from it."""

    def __init__(self, namespace, missing: str) -> None:
        self.namespace, self.missing = namespace, missing

    def __getattr__(self, name: str):
        if name == self.missing:
            raise AttributeError(name)
        return getattr(self.namespace, name)


def remove(monkeypatch, entry_id: str) -> None:
    """The entry's name taken out of the installed library, for this test."""
    owner, attribute = upstream._owner_and_attribute(entry_id)
    if isinstance(owner, torch._ops._OpNamespace):
        monkeypatch.setattr(torch.ops, owner.name, OpsWithout(owner, attribute))
    elif isinstance(owner, type):  # gone from every class that defines it, as a rename would have it
        for cls in owner.__mro__:
            if attribute in vars(cls):
                monkeypatch.delattr(cls, attribute)
    else:
        monkeypatch.delattr(owner, attribute)
    assert not upstream.present(entry_id)


def on_meta():
    with torch.device("meta"):
        return tiny_model("llama")


def head_stand_ins(_monkeypatch):
    with trl_simulator.fused_head_as_on_cuda():
        pass


def fused_head_added(_monkeypatch):
    with trl_simulator.fused_head_added(on_meta(), "sft"):
        pass


def reference_pass(_monkeypatch):
    with trl_simulator._reference(on_meta()):
        pass


def masks_on_meta(_monkeypatch):
    with stand_ins.real_device_masking():
        pass


def four_bit_base(_monkeypatch):
    four_bit.quantize(on_meta(), four_bit.FourBit("nf4", True, torch.bfloat16), torch.bfloat16)


def four_bit_product(_monkeypatch):
    with four_bit.dequantizing_gemm():
        pass


def liger_loss_on_meta(_monkeypatch):
    with stand_ins.simulated_liger_loss():
        pass


def liger_applied(_monkeypatch):
    from hf_offload.tools.modes import set_liger_flce

    set_liger_flce(tiny_model("llama"), True)


_BUILT: dict = {}  # models built while the names were there (transformers itself needs some to build one)


def tiling_enabled(_monkeypatch):
    if "llama" not in _BUILT:
        _BUILT["llama"] = tiny_model("llama")
    hf_offload.enable_sequence_tiling(_BUILT["llama"])


def trl_offloading_context(_monkeypatch):
    from hf_offload.tools.benchmarks import trl_trainers

    trl_trainers.grpo_trainer_with_trl_offloading()


def causal_lm_check(_monkeypatch):
    from hf_offload.tools import presets

    presets._check_causal_lm(AutoConfig.for_model("llama"), "config.json")


def hub_check(monkeypatch):
    from huggingface_hub import constants

    from hf_offload.tools import presets

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    presets._hub_reachable()


def generic_adapter(_monkeypatch):
    from hf_offload.internal import resolve_layers

    model = tiny_model("llama")
    model.config.model_type = "a_type_without_an_adapter"
    resolve_layers(model)


def sequence_parallel_checked(_monkeypatch):
    sequence_parallel.check_sequence_parallel(AutoConfig.for_model("llama"), 2, world_size=2)


def sequence_parallel_group(_monkeypatch):
    try:
        sequence_parallel._sp_group()
    except UpstreamChanged:
        raise
    except RuntimeError as error:  # no group registered: said as such while the name is there
        assert "register_ulysses" in str(error)


def ulysses_exchange(_monkeypatch):
    importlib.import_module(sequence_parallel.ULYSSES_MODULE)
    sequence_parallel.deepspeed_exchange(None)


def counted_exchange(_monkeypatch):
    """benchmarks/gpu_multi.py counts DeepSpeed's all-to-alls by replacing its private function for a block."""
    from hf_offload.tools.benchmarks import gpu_multi

    ulysses_sp = importlib.import_module(sequence_parallel.ULYSSES_MODULE)
    original = getattr(ulysses_sp, "_dim_zero_all_to_all", None)
    with gpu_multi.CountedExchange(2):
        assert ulysses_sp._dim_zero_all_to_all is not original
    assert ulysses_sp._dim_zero_all_to_all is original


def ulysses_unregistered(monkeypatch):
    registered = {"implementation": "sdpa", "local": sequence_parallel._ABSENT}
    monkeypatch.setattr(sequence_parallel, "_REGISTERED", registered)
    sequence_parallel.unregister_ulysses()


# The feature that uses each ERROR entry, run (cheaply) as users reach it.
def linear_attention_stand_ins(_monkeypatch):
    with linear_attention.linear_attention_as_on_cuda((9, 0)):
        pass


def grpo_ulysses_built(monkeypatch):
    from hf_offload.integrations import grpo_ulysses

    grpo_ulysses._build_class()


STOPS = {
    "trl.use_triton": head_stand_ins,
    "trl.trainer_use_triton": head_stand_ins,
    "trl.addmm_fp32": head_stand_ins,
    "trl.forward_kernel": head_stand_ins,
    "trl.backward_kernel": head_stand_ins,
    "trl.add_fused_lm_head": fused_head_added,
    "trl.disable_gradient_checkpointing": reference_pass,
    "trl.use_adapter": reference_pass,
    "transformers.find_packed_sequence_indices": masks_on_meta,
    "transformers.fast_all": masks_on_meta,
    "transformers.bnb_quantize": four_bit_base,
    "bitsandbytes.gemm_4bit": four_bit_product,
    "bitsandbytes.name2qmap": four_bit_base,
    "bitsandbytes.params4bit_quantize": four_bit_base,
    "liger-kernel.fused_linear_cross_entropy": liger_loss_on_meta,
    "liger-kernel.apply_functions": liger_applied,
    "transformers.attention_registry": tiling_enabled,
    "trl.activation_offloading": trl_offloading_context,
    "transformers.causal_lm_types": causal_lm_check,
    "huggingface-hub.constants": hub_check,
    "transformers.output_collector": tiling_enabled,
    "transformers.local_attention_functions": ulysses_unregistered,
    "trl.grpo_train_sampler": grpo_ulysses_built,
    "trl.grpo_repeat_sampler": grpo_ulysses_built,
    "trl.grpo_prepare_inputs": grpo_ulysses_built,
    "trl.grpo_shuffle": grpo_ulysses_built,
    "trl.grpo_generate_and_score": grpo_ulysses_built,
    "trl.grpo_compute_loss": grpo_ulysses_built,
    "trl.grpo_gather": grpo_ulysses_built,
    "trl.grpo_gather_object": grpo_ulysses_built,
    "trl.grpo_generate_single_turn": grpo_ulysses_built,
    "trl.grpo_per_token_logps": grpo_ulysses_built,
    "transformers.attn_implementation": sequence_parallel_checked,
    "transformers.checkpointing_layer": generic_adapter,
    "deepspeed.sequence_parallel_group": sequence_parallel_group,
    "deepspeed.release_groups": ulysses_unregistered,
    "deepspeed.all_to_all": ulysses_exchange,
    "deepspeed.all_to_all_counted": counted_exchange,
    **{entry: linear_attention_stand_ins for module in linear_attention.MODULES
       for entry in linear_attention.entries(module)},
}  # fmt: skip


@pytest.mark.parametrize("entry_id", sorted(e for e, entry in INVENTORY.items() if entry.when_missing == ERROR))
def test_a_name_gone_from_its_library_stops_the_feature_saying_what_changed(entry_id, monkeypatch):
    entry = INVENTORY[entry_id]
    STOPS[entry_id](monkeypatch)  # the feature runs while the name is there
    remove(monkeypatch, entry_id)
    with pytest.raises(UpstreamChanged) as raised:
        STOPS[entry_id](monkeypatch)
    message = str(raised.value)
    version = upstream.installed_version(entry.library)
    assert f"{entry.library} {version}" in message and entry.feature in message and entry.versions in message
    assert repr(entry_id) in message


def announced(caplog, entry_id: str) -> list[str]:
    entry = INVENTORY[entry_id]
    return [r.getMessage() for r in caplog.records if r.name == "hf_offload" and entry.missing in r.getMessage()]


@pytest.fixture
def fresh_announcements(monkeypatch):
    monkeypatch.setattr(upstream, "_announced", set())


def test_without_tritons_cdiv_in_trl_a_stand_in_gives_it():
    """trl.triton_cdiv: where TRL has no `triton` (no Triton installed), the simulated backward still
    launches its grid: a stand-in gives cdiv within the block and is gone after."""
    chunked_logprob = importlib.import_module("trl.kernels.chunked_logprob")
    saved = chunked_logprob.__dict__.pop("triton", None)
    try:
        with trl_simulator.fused_head_as_on_cuda():
            assert chunked_logprob.triton.cdiv(7, 2) == 4
        assert not hasattr(chunked_logprob, "triton")
    finally:
        if saved is not None:
            chunked_logprob.triton = saved


def test_without_trls_offloading_hooks_offloading_says_once_that_they_go_unnoticed(
    monkeypatch, caplog, fresh_announcements
):
    importlib.import_module("trl.models.activation_offloading")
    remove(monkeypatch, "trl.offloading_hooks")
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for _ in range(2):
            hf_offload.enable_activation_offloading(tiny_model("llama"))
    assert len(announced(caplog, "trl.offloading_hooks")) == 1


def test_without_ligers_forwards_package_tiling_says_once_its_loss_head_is_unrecognised(
    monkeypatch, caplog, fresh_announcements
):
    importlib.import_module("liger_kernel.transformers.model.llama")
    remove(monkeypatch, "liger-kernel.forwards")
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        hf_offload.enable_sequence_tiling(tiny_model("llama"))
    assert len(announced(caplog, "liger-kernel.forwards")) == 1


def test_without_accelerates_shared_state_the_process_count_check_is_skipped_and_said(
    monkeypatch, caplog, fresh_announcements
):
    from accelerate.state import PartialState

    monkeypatch.setattr(PartialState, "_shared_state", {"num_processes": 1})
    config = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="accelerate counts 1 process"):  # with it: refused
        sequence_parallel._check_accelerate_processes(2)
    remove(monkeypatch, "accelerate.shared_state")
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        sequence_parallel._check_accelerate_processes(2)
    assert sequence_parallel.check_sequence_parallel(config, 2, world_size=2) == "sdpa"
    assert len(announced(caplog, "accelerate.shared_state")) == 1


def test_a_loss_function_ignoring_ours_runs_the_loss_untiled_and_says_so(monkeypatch, caplog):
    """transformers.loss_function: where PreTrainedModel.loss_function no longer returns
    `_loss_function` (where the tiled loss head puts its own), the model's loss gets the logits: it
    runs untiled, the same loss, said once."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.modeling_utils import PreTrainedModel

    plain, tiled = tiny_model("llama"), tiny_model("llama")
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=4)
    monkeypatch.setattr(PreTrainedModel, "loss_function", property(lambda self: ForCausalLMLoss))
    ids = batch()
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        loss = tiled(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, plain(input_ids=ids, labels=ids).loss, rtol=1e-6, atol=1e-6)
    assert any("untiled" in r.getMessage() for r in caplog.records if r.name == "hf_offload")


def test_kernel_funcs_under_another_name_fail_as_without_hf_offload(monkeypatch):
    """kernels.kernel_funcs: the refusal looks for the name kernels 0.19 reads; under another name
    nothing is refused, and the model fails at its first forward with kernels' own error, as it does
    without hf_offload."""
    pytest.importorskip("kernels", reason="transformers < 5.25 does not install the kernels library")
    model = tiny_model("llama")
    del model.model.layers[0].self_attn.__dict__[kernels_integration.KERNEL_FUNCS_ATTR]
    monkeypatch.setattr(kernels_integration, "KERNEL_FUNCS_ATTR", "_renamed_kernel_funcs")
    hf_offload.enable_activation_offloading(model)
    with pytest.raises(AttributeError, match="_kernel_funcs"):
        model(input_ids=batch())


def test_without_pretrained_model_the_methods_are_not_added_and_that_is_said(monkeypatch, caplog, fresh_announcements):
    from hf_offload import model_methods

    class ModelingUtilsWithout:  # transformers.modeling_utils as a release without PreTrainedModel
        pass

    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        model_methods._add_methods_to(ModelingUtilsWithout())
    said = announced(caplog, "transformers.pretrained_model")
    assert len(said) == 1 and "hf_offload.enable_activation_offloading(model)" in said[0]


def test_without_deepspeeds_ulysses_attention_the_heads_go_through_at_once_said_once(
    monkeypatch, caplog, fresh_announcements
):
    """deepspeed.ulysses_attention: where DeepSpeed's Ulysses has no UlyssesSPAttentionHF (or its
    registered function no longer holds one), the rank's query heads go through the exchange as
    DeepSpeed runs them, said once; someone's own function in its place is left as it is, silently."""
    pytest.importorskip("deepspeed")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ulysses_sp = importlib.import_module(sequence_parallel.ULYSSES_MODULE)

    def registered(*args, **kwargs):  # DeepSpeed's wrapper, as far as its module says
        return None

    registered.__module__ = sequence_parallel.ULYSSES_MODULE

    def someones_own(*args, **kwargs):
        return None

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    monkeypatch.setitem(local, "sdpa", someones_own)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        sequence_parallel.adopt_ulysses("sdpa")
        assert not announced(caplog, "deepspeed.ulysses_attention")
        monkeypatch.setitem(local, "sdpa", registered)  # holds no UlyssesSPAttentionHF
        sequence_parallel.adopt_ulysses("sdpa")
        assert len(announced(caplog, "deepspeed.ulysses_attention")) == 1
        monkeypatch.delattr(ulysses_sp, "UlyssesSPAttentionHF")
        monkeypatch.setitem(local, "sdpa", lambda *args, **kwargs: None)
        local["sdpa"].__module__ = sequence_parallel.ULYSSES_MODULE
        sequence_parallel.adopt_ulysses("sdpa")
    assert len(announced(caplog, "deepspeed.ulysses_attention")) == 1  # once


def test_a_ulysses_attention_with_renamed_attributes_keeps_deepspeeds_forward(monkeypatch, caplog, fresh_announcements):
    """deepspeed.ulysses_attention: a DeepSpeed release renaming what the chunked forward reads of its
    UlyssesSPAttentionHF (world_size to sp_world_size, say) keeps DeepSpeed's own forward, said once,
    instead of an AttributeError from the chunked forward; with the attributes there, it is adopted."""
    pytest.importorskip("deepspeed")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ulysses_sp = importlib.import_module(sequence_parallel.ULYSSES_MODULE)

    def registration(**attributes):
        instance = ulysses_sp.UlyssesSPAttentionHF.__new__(ulysses_sp.UlyssesSPAttentionHF)
        torch.nn.Module.__init__(instance)
        for name, value in attributes.items():
            setattr(instance, name, value)

        def wrapper(*args, **kwargs):  # DeepSpeed's registered function, holding its instance
            return instance(*args, **kwargs)

        wrapper.__module__ = sequence_parallel.ULYSSES_MODULE
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", wrapper)
        return instance

    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        renamed = registration(sp_world_size=2, process_group=None, attn=None)
        sequence_parallel.adopt_ulysses("sdpa")
        assert "forward" not in vars(renamed)
        assert len(announced(caplog, "deepspeed.ulysses_attention")) == 1
        as_checked = registration(world_size=2, process_group=None, attn=None)
        sequence_parallel.adopt_ulysses("sdpa")
    try:
        assert "forward" in vars(as_checked)
    finally:
        sequence_parallel.release_ulysses()


def test_every_place_reading_or_writing_attn_implementation_is_in_the_inventory():
    """transformers.attn_implementation lists every file of the package that reads or writes a config's
    `_attn_implementation`: a new place cannot go unlisted."""
    package = Path(hf_offload.__file__).resolve().parent
    found = {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "upstream.py" and "_attn_implementation" in path.read_text()
    }
    used_by = INVENTORY["transformers.attn_implementation"].used_by
    listed = {name.strip().removeprefix("hf_offload/") for name in used_by.split(",")}
    assert found == listed


def test_transformers_sdpa_repeats_keys_by_the_modules_num_key_value_groups():
    """transformers.num_key_value_groups: transformers' sdpa function repeats keys and values by the
    module's `num_key_value_groups`, so a call over a part of the heads sets it for the call
    (`key_value_groups`) and puts it back; left at another value, the call fails."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_offload.tiling.attention import key_value_groups

    module = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2).model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, 5, 8, generator=generator) for heads in (4, 2, 2))
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1), is_causal=True
    ).transpose(1, 2)
    module.num_key_value_groups = 1  # as left by a call over one rank's heads
    with key_value_groups(module, 2):
        output, _ = sdpa_attention_forward(module, query, key, value, None, is_causal=True)
    assert module.num_key_value_groups == 1
    torch.testing.assert_close(output, expected)
    with pytest.raises(RuntimeError):
        sdpa_attention_forward(module, query, key, value, None, is_causal=True)


FALLBACK_TESTS = {
    "trl.triton_cdiv": test_without_tritons_cdiv_in_trl_a_stand_in_gives_it,
    "trl.offloading_hooks": test_without_trls_offloading_hooks_offloading_says_once_that_they_go_unnoticed,
    "liger-kernel.forwards": test_without_ligers_forwards_package_tiling_says_once_its_loss_head_is_unrecognised,
    "accelerate.shared_state": test_without_accelerates_shared_state_the_process_count_check_is_skipped_and_said,
    "transformers.loss_function": test_a_loss_function_ignoring_ours_runs_the_loss_untiled_and_says_so,
    "kernels.kernel_funcs": test_kernel_funcs_under_another_name_fail_as_without_hf_offload,
    "transformers.pretrained_model": test_without_pretrained_model_the_methods_are_not_added_and_that_is_said,
    "deepspeed.ulysses_attention": test_without_deepspeeds_ulysses_attention_the_heads_go_through_at_once_said_once,
}  # fmt: skip


def test_every_entry_is_checked_by_a_test():
    """An ERROR entry has its feature in STOPS, a FALLBACK entry its test above, a HELD entry the test it
    names in the suite; nothing listed that the inventory lacks."""
    by_kind = {kind: {e for e, entry in INVENTORY.items() if entry.when_missing == kind} for kind in (ERROR, FALLBACK)}
    assert set(STOPS) == by_kind[ERROR]
    assert set(FALLBACK_TESTS) == by_kind[FALLBACK]
    held = {e: entry for e, entry in INVENTORY.items() if entry.when_missing == HELD}
    assert held and set(INVENTORY) == by_kind[ERROR] | by_kind[FALLBACK] | set(held)
    tests = Path(__file__).resolve().parent
    for entry_id, entry in held.items():
        path, _, name = entry.missing.partition("::")
        # Read, not imported: a test module may skip itself where its library is not installed.
        defined = {node.name for node in ast.parse((tests.parent / path).read_text()).body if hasattr(node, "name")}
        assert name.startswith("test_") and name in defined, f"{entry_id}: no test {entry.missing}"


def test_the_docs_hold_the_inventory_as_it_is():
    docs = (Path(__file__).resolve().parent.parent / "docs" / "upstream.md").read_text()
    assert upstream.table() in docs, "docs/upstream.md: paste `python -m hf_offload.integrations.upstream`"


def test_the_estimate_command_reports_a_changed_library_as_such(monkeypatch, capsys):
    """`hf-offload estimate --trainer sft` with TRL's forward kernel renamed: the command says which
    library changed what, not that the model failed (nor Triton's '0 active drivers')."""
    from hf_offload.tools.cli import main

    chunked_logprob = importlib.import_module("trl.kernels.chunked_logprob")
    monkeypatch.setattr(chunked_logprob, "_renamed_forward_kernel", chunked_logprob._forward_kernel, raising=False)
    monkeypatch.delattr(chunked_logprob, "_forward_kernel")
    with pytest.raises(SystemExit):
        main(["estimate", "--preset", "llama-3-8b", "--seq-len", "1024", "--trainer", "sft"])
    error = capsys.readouterr().err
    assert "trl.kernels.chunked_logprob._forward_kernel" in error and "model failed" not in error
    assert sys.modules["trl.kernels.chunked_logprob"] is chunked_logprob


def test_a_release_the_inventory_was_not_checked_on_is_named(monkeypatch):
    """Each test run ends naming what is installed at a version no entry was checked on (conftest's
    terminal summary): here a transformers release after the newest checked."""
    assert "transformers" not in upstream.unchecked_versions()
    real = upstream.installed_version
    monkeypatch.setattr(upstream, "installed_version", lambda lib: "99.0.0" if lib == "transformers" else real(lib))
    assert upstream.unchecked_versions()["transformers"] == "99.0.0"
