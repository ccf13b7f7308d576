"""Every causal-LM type transformers registers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), as a tiny model
with random weights (tests/registry_models.py), for one training step each: offloading is
bit-identical and offloads something, with and without gradient checkpointing; sequence tiling is
close to untiled training, with every layer's MLP found and run slice by slice.

What does not hold for a type is listed here with the reason, and the sweep checks that it still
fails or differs in the way stated: when transformers or hf_offload changes, the lists must too.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

import pytest
import torch
import transformers
from conftest import assert_bit_identical, directional_derivatives, enable_sim, twin
from packaging.version import Version
from registry_models import ConfigRefused, inputs, tiny_model
from torch.overrides import TorchFunctionMode
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_offload
from hf_offload.adapters import UnsupportedModelError, resolve_layers, resolve_mlps
from hf_offload.adapters.base import TOKEN_MIXING, innermost
from hf_offload.tiling import per_token

SEQ, TILE, BATCH = 32, 10, 2  # slices of 10, 10, 10 and 2 tokens: the last one uneven
# Tiling sums each parameter's gradient over 4 slices instead of in one matmul over 64 tokens, and
# its matmuls block differently: float32 rounding moves by a few ulps per sum (about 1e-7 relative),
# far inside these.
CLOSE = dict(rtol=1e-4, atol=1e-6)

CAUSAL_LM_TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
LISTS_WRITTEN_FOR = "5.25.0"  # the transformers release the lists below were last checked against

# Types no tiny model here trains: (exception, message pattern, why).
_DRAFTER = (
    ValueError,
    "inputs_embeds and shared_kv_states cannot be None",
    "a drafter for speculative decoding: it runs on the target model's embeddings and key/value states, not tokens",
)
UNTRAINABLE = {
    "gemma3n": (
        ImportError,
        "requires the timm library",
        "its vision tower is a timm model and timm is not installed (its text model is swept as gemma3n_text)",
    ),
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
    "xlm": (
        UnsupportedModelError,
        r"transformer\.attentions, transformer\.layer_norm1, transformer\.ffns",
        "no module per layer to wrap: XLM keeps its layers' attentions, norms and feed-forwards in parallel lists",
    ),
}
SWEPT = [model_type for model_type in CAUSAL_LM_TYPES if model_type not in UNTRAINABLE]

# Several stacks of GradientCheckpointingLayers, which the generic fallback refuses: swept with the
# adapter its error message suggests.
STACKS = {
    "blt": lambda model: [
        *model.model.local_encoder.layers,
        *model.model.global_transformer.layers,
        *model.model.local_decoder.layers,
    ],  # its entropy patcher's layers run without grad
    "git": lambda model: list(model.git.encoder.layer),  # the text layers; the vision tower's run first
    "hrm_text": lambda model: [*model.model.L_module.layers, *model.model.H_module.layers],  # each runs in cycles
}

# Layers that save nothing for backward.
OFFLOADS_NOTHING = {"reformer": "reversible layers: backward recomputes each layer from the next one's output"}

# Layers with a per-token MLP that resolve_mlps does not find (its names are base.MLP_NAMES): where it is.
MLP_ELSEWHERE = {
    "nemotron_h": "mixer",  # one block class whose mixer is Mamba, attention, an MLP or an MoE by block type
    "xlnet": "ff",
    "zamba": "shared_transf.feed_forward",  # one block shared by the hybrid layers
    "zamba2": "shared_transformer.feed_forward",
}
# MLPs found but run whole: tiling slices a module called with the hidden states alone.
RUNS_WHOLE = {
    "bloom": "called as mlp(hidden_states, residual)",
    "mpt": "called as ffn(hidden_states, residual)",
    "deepseek_v4": "called as mlp(hidden_states, input_ids=input_ids) (hash-routed layers route by token id)",
}
# Called with the previous layer's router states, None in the first layer: only that one runs sliced.
SLICED_IN_THE_FIRST_LAYER_ONLY = {"zaya": "called as mlp(hidden_states, prev_router_hidden_states)"}
# Types transformers does not checkpoint (their supports_gradient_checkpointing is False).
NO_CHECKPOINTING = {
    model_type: "transformers refuses: supports_gradient_checkpointing = False"
    for model_type in ("cpmant", "ctrl", "gpt_neox_japanese", "jetmoe", "openai-gpt", "reformer", "xlnet")
}
# Types whose loss the tiled loss head leaves to the model (their logits are returned whole), and why.
_OWN_CROSS_ENTROPY = "computes its own cross-entropy on logits.view(-1, vocab) instead of calling its loss_function"
LOSS_UNTILED: dict[str, str] = {
    **dict.fromkeys(
        ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "cpmant", "marian", "mbart", "mvp", "pegasus",
         "plbart", "trocr", "whisper", "xlnet"),
        _OWN_CROSS_ENTROPY,
    ),  # fmt: skip
    "git": "cuts the image's positions off its logits (logits[:, image_tokens:-1]) before the loss",
    "musicgen": "one lm_head per codebook (a ModuleList), the loss summed over them",
    "musicgen_melody": "one lm_head per codebook (a ModuleList), the loss summed over them",
    "prophetnet": "lm_head runs on every n-gram stream at once (4-D hidden states), its loss computed by the model",
}
# Types whose attention runs with its heads whole under attention tiling (said once), and why.
_EAGER = "eager attention by default: each model's own function, not in transformers' registry (said when enabling)"
_NO_BLOCK = "no attention block under the names find_attention looks for: tiling attention alone finds nothing"
HEADS_WHOLE: dict[str, str] = {
    **dict.fromkeys(
        ("big_bird", "bigbird_pegasus", "bloom", "deepseek_v4", "flint", "gemma2", "git", "gpt_neo",
         "gpt_neox_japanese", "gpt_oss", "granite_swa", "granitemoe_swa", "hy_v4", "inkling2_loop_text",
         "inkling2_text", "megatron-bert", "mimo_v2_flash", "mpt", "mvp", "openai-gpt", "prophetnet", "reformer",
         "rembert", "roformer", "rwkv", "trocr", "vaultgemma", "xglm"),
        _EAGER,
    ),
    **dict.fromkeys(
        ("cpmant", "ctrl", "dbrx", "falcon_mamba", "mamba", "mamba2", "nemotron_h", "recurrent_gemma", "xlnet",
         "xlstm", "zamba", "zamba2"),
        _NO_BLOCK,
    ),
    "falcon": "calls torch's scaled_dot_product_attention itself",
    "gpt_bigcode": "multi-query attention: one key/value head, no group to split off",
}  # fmt: skip
# Types whose head-tiled attention is close to, not bit-identical with, the whole call's: their
# per-head query and key norms hand attention head-major (contiguous) queries and keys, for which
# SDPA's CPU kernel orders a group's sums differently from the whole call's, and the norms' weight
# gradients, summed over heads and tokens, come out in another order. Each is held to the whole
# call's in float64 as well (float32 casts kept out), within REORDERED: sums in another order, not
# another gradient.
HEADS_CLOSE: dict[str, str] = dict.fromkeys(
    ("afmoe", "beam", "dory", "ergo", "exaone4", "exaone_moe", "hunyuan_v1_dense", "hunyuan_v1_moe", "kolibri1",
     "kolibri1_1", "lara_mini"),
    "per-head query/key norms: head-major queries and keys",
)  # fmt: skip
# float64 sums in another order differ by a few ulps (measured at most 2e-16 relative to the largest
# gradient entry); a wrong gradient differs at the size of the gradient.
REORDERED = 1e-13
# What decoder layers' MLP classes are called, to tell which layers have one.
MLP_CLASS = re.compile(r"(MLP|Mlp|FeedForward|FFN|Ffn|MoE|Moe|MoeBlock|SparseBlock)$")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models: one thread is faster than two that sync at every op, above all on shared cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def quiet():
    # Tiny configs trip many of transformers' warnings (vocabulary, kernels falling back).
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor], object]:
    """One training step on the same batch, from the same random state: (loss, gradients, output)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    output = model(**inputs(model, BATCH, SEQ))
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), grads, output


@contextlib.contextmanager
def adapter_for(model_type: str) -> Iterator[None]:
    if model_type not in STACKS:
        yield
        return
    with pytest.raises(UnsupportedModelError, match=r"concatenated in forward order"):
        resolve_layers(tiny_model(model_type))
    hf_offload.register_adapter(model_type, STACKS[model_type])
    try:
        yield
    finally:
        hf_offload.unregister_adapter(model_type)


def mlp_children(layer: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        child
        for child in innermost(layer).children()
        if MLP_CLASS.search(type(child).__name__) and type(child).__name__ not in TOKEN_MIXING
    ]


def check_mlps_found(model_type: str, model: torch.nn.Module) -> list[torch.nn.Module]:
    """resolve_mlps finds an MLP in each layer that has one (as its class is named), except where
    MLP_ELSEWHERE says; returns those found."""
    _, layers = resolve_layers(model)
    found = resolve_mlps(model)
    if model_type in MLP_ELSEWHERE:
        assert found == [None] * len(layers)
        elsewhere = [
            layer.get_submodule(MLP_ELSEWHERE[model_type])
            for layer in layers
            if has_submodule(layer, MLP_ELSEWHERE[model_type])
        ]
        assert any(MLP_CLASS.search(type(module).__name__) for module in elsewhere), "no MLP where MLP_ELSEWHERE says"
        return []
    missed = [
        index
        for index, (layer, mlp) in enumerate(zip(layers, found, strict=True))
        if mlp_children(layer) and mlp is None
    ]
    assert not missed, f"layers {missed} have an MLP that resolve_mlps does not find"
    return [mlp for mlp in found if mlp is not None]


def has_submodule(layer: torch.nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


@contextlib.contextmanager
def counting_calls(mlps: list[torch.nn.Module]) -> Iterator[list[int]]:
    """Per MLP, how many times the modules inside it run: a tiled MLP runs them once per slice."""
    counts = [0] * len(mlps)
    handles = []
    for index, mlp in enumerate(mlps):
        for module in mlp.modules():
            if module is not mlp:
                handles.append(
                    module.register_forward_pre_hook(lambda *_, i=index: counts.__setitem__(i, counts[i] + 1))
                )
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def counting_splits() -> Iterator[list[int]]:
    """How many attention calls head tiling split into groups."""
    from hf_offload.tiling import attention

    count = [0]
    original = attention._per_group

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    attention._per_group = counted
    try:
        yield count
    finally:
        attention._per_group = original


class KeepFloat64(TorchFunctionMode):
    """Casts of float64 tensors to float32 left out, so that a model computing its norms or router in
    float32 whatever its dtype (Ergo's RMSNorm calls `.float()`) runs in float64 throughout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            if func is torch.Tensor.float:
                return args[0]
            if func is torch.Tensor.to:
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
                kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def heads_difference_in_float64(model_type: str) -> float:
    """The largest difference between attention tiled over heads and the whole call, in float64
    throughout, relative to the largest entry of each gradient (and the loss)."""
    plain = tiny_model(model_type).to(torch.float64)
    if hasattr(plain, "set_experts_implementation"):
        plain.set_experts_implementation("eager")  # grouped_mm takes no float64
    heads = twin(plain)
    hf_offload.enable_sequence_tiling(heads, tile_tokens=TILE, mlp=False, norms=False, projections=False, loss=False)
    with KeepFloat64():
        (loss, gradients, _), (heads_loss, heads_gradients, _) = step(plain), step(heads)
    worst = float((heads_loss - loss).abs() / loss.abs())
    for name, gradient in gradients.items():
        scale = float(gradient.abs().max()) or 1.0
        worst = max(worst, float((heads_gradients[name] - gradient).abs().max()) / scale)
    return worst


def assert_heads_exact(model_type: str, expected: tuple, actual: tuple) -> None:
    """Attention tiled over heads: bit-identical, or for HEADS_CLOSE close in float32 and within
    REORDERED in float64. A type that is neither is told apart: reordered (list it in HEADS_CLOSE
    with the reason) or a wrong gradient."""
    if model_type in HEADS_CLOSE:
        assert_close(expected, actual)
        difference = heads_difference_in_float64(model_type)
        assert difference <= REORDERED, f"float64: {difference:.2e} apart, more than sums in another order"
        return
    try:
        assert_same(expected, actual)
    except AssertionError as error:
        difference = heads_difference_in_float64(model_type)
        verdict = (
            f"sums in another order ({difference:.2e} apart in float64): list {model_type!r} in HEADS_CLOSE with why"
            if difference <= REORDERED
            else f"a wrong gradient ({difference:.2e} apart in float64)"
        )
        raise AssertionError(f"attention tiled over heads is not bit-identical: {verdict}; {error}") from None


def assert_same(expected: tuple, actual: tuple) -> None:
    assert torch.equal(expected[0], actual[0]), "losses differ"
    assert_bit_identical(expected[1], actual[1])


def assert_offloaded_something(model_type: str, model: torch.nn.Module) -> None:
    offloaded = model.activation_offloading_stats().offloaded_tensors
    assert offloaded == 0 if model_type in OFFLOADS_NOTHING else offloaded > 0


def assert_close(expected: tuple, actual: tuple) -> None:
    torch.testing.assert_close(actual[0], expected[0], **CLOSE)
    assert actual[1].keys() == expected[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], **CLOSE, msg=name)


def buildable(model_type: str) -> torch.nn.Module:
    """The type's tiny model, its decoder layers found; a type transformers added since the lists
    above were written fails naming itself and what to do, not deep in the harness."""
    try:
        model = tiny_model(model_type)
    except ConfigRefused as error:
        pytest.fail(str(error))
    try:
        resolve_layers(model)
    except UnsupportedModelError as error:
        pytest.fail(
            f"{model_type!r} falls outside hf_offload's adapters ({error}): register an adapter, or list it in "
            "UNTRAINABLE with the reason"
        )
    return model


@pytest.mark.parametrize("model_type", SWEPT)
def test_offloading_is_exact_and_tiling_close(model_type):
    with adapter_for(model_type):
        plain = buildable(model_type)
        offloaded, tiled, heads = twin(plain), twin(plain), twin(plain)
        plain_mlps = check_mlps_found(model_type, plain)
        with counting_calls(plain_mlps) as plain_calls:
            expected = step(plain)

        enable_sim(offloaded)
        assert_same(expected, step(offloaded))
        assert_offloaded_something(model_type, offloaded)

        hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
        assert tiled.is_sequence_tiling
        with counting_calls([mlp for mlp in resolve_mlps(tiled) if mlp is not None]) as tiled_calls:
            tiled_step = step(tiled)
            assert_close(expected, tiled_step)
        loss_tiled = getattr(tiled_step[2], "logits", None) is None
        assert loss_tiled == (model_type not in LOSS_UNTILED), f"loss head tiled: {loss_tiled}"

        # Attention tiled over heads alone: each head computed as by the whole call, bit for bit.
        only = dict(mlp=False, norms=False, projections=False, loss=False)
        if HEADS_WHOLE.get(model_type) in (_NO_BLOCK, _EAGER):  # said when enabling: nothing else to tile
            with pytest.raises(UnsupportedModelError, match="nothing to tile"):
                hf_offload.enable_sequence_tiling(heads, tile_tokens=TILE, **only)
        else:
            hf_offload.enable_sequence_tiling(heads, tile_tokens=TILE, **only)
            with counting_splits() as splits:
                heads_step = step(heads)
            assert_heads_exact(model_type, expected, heads_step)
            assert (splits[0] > 0) == (model_type not in HEADS_WHOLE), f"attention calls split: {splits[0]}"
        sliced = [after > before for after, before in zip(tiled_calls, plain_calls, strict=True)]
        expected_sliced = [model_type not in RUNS_WHOLE] * len(sliced)
        if model_type in SLICED_IN_THE_FIRST_LAYER_ONLY:
            expected_sliced = [True] + [False] * (len(sliced) - 1)
        assert sliced == expected_sliced, f"MLPs run sliced: {sliced}"

        # With gradient checkpointing the engine offloads what the checkpoints keep: each layer's inputs.
        if model_type in NO_CHECKPOINTING:
            with pytest.raises(ValueError, match="does not support activation checkpointing"):
                plain.activation_checkpointing_enable()
            return
        plain.activation_checkpointing_enable()
        offloaded.activation_checkpointing_enable()
        assert_same(step(plain), step(offloaded))
        assert_offloaded_something(model_type, offloaded)


def test_the_float64_check_tells_a_wrong_gradient_from_sums_in_another_order(monkeypatch):
    """Companion of REORDERED: a second group of heads computed with its softmax scale off by 1e-7
    (a wrong gradient, smaller than float32's rounding can show) is far outside it in float64."""
    from hf_offload.tiling import attention

    assert heads_difference_in_float64("llama") <= REORDERED
    original = attention._kwargs_per_group

    def second_group_off(kwargs, heads, groups):
        pieces = original(kwargs, heads, groups)
        pieces[1] = {**pieces[1], "scaling": pieces[1]["scaling"] * (1 + 1e-7)}
        return pieces

    monkeypatch.setattr(attention, "_kwargs_per_group", second_group_off)
    assert heads_difference_in_float64("llama") > 100 * REORDERED


@pytest.mark.parametrize("model_type", sorted(UNTRAINABLE))
def test_untrainable_types_still_fail_as_stated(model_type):
    error, pattern, _why = UNTRAINABLE[model_type]
    with pytest.raises(error, match=pattern):
        model = tiny_model(model_type)
        enable_sim(model)
        step(model)


def test_the_lists_name_causal_lm_types():
    """Nothing listed that transformers no longer has: checked on the release the lists were written
    for and later ones (an older transformers, as .ci/oldest installs, lacks the newer types)."""
    listed = {
        *UNTRAINABLE, *STACKS, *OFFLOADS_NOTHING, *MLP_ELSEWHERE, *RUNS_WHOLE, *SLICED_IN_THE_FIRST_LAYER_ONLY,
        *LOSS_UNTILED, *DROPOUT_IN_TILED_PARTS, *HEADS_WHOLE, *HEADS_CLOSE,
    }  # fmt: skip
    if Version(transformers.__version__) >= Version(LISTS_WRITTEN_FOR):
        assert listed <= set(CAUSAL_LM_TYPES), f"no longer causal-LM types: {sorted(listed - set(CAUSAL_LM_TYPES))}"
    listed_swept = {
        *STACKS, *OFFLOADS_NOTHING, *MLP_ELSEWHERE, *RUNS_WHOLE, *SLICED_IN_THE_FIRST_LAYER_ONLY, *LOSS_UNTILED
    }  # fmt: skip
    assert not set(UNTRAINABLE) & {*listed_swept, *NO_CHECKPOINTING}


# The types whose tiled parts (an MLP ending in dropout, mostly) draw random numbers when their
# config's dropout is on: with dropout 0.2, backward must recompute each slice with the slice's own
# masks. float64, and a step of 1e-4 along the gradient: the finite difference agrees within 1%
# (measured within 0.3%).
DROPOUT_IN_TILED_PARTS = ("codegen", "cpmant", "gpt2", "gpt_neo", "gptj", "modernbert-decoder", "openai-gpt")


@pytest.mark.parametrize("model_type", DROPOUT_IN_TILED_PARTS)
def test_with_dropout_the_tiled_gradient_is_that_of_the_reported_loss(model_type):
    model = tiny_model(model_type, dropout=0.2).to(torch.float64)
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    batch = inputs(model, BATCH, SEQ)
    model(**batch)  # the attention's projections are tiled at its first call
    tiled = [module for module in model.modules() if per_token.is_tiled(module)]
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for module in tiled for m in module.modules())
    analytic, difference = directional_derivatives(model, batch, epsilon=1e-4)
    assert analytic == pytest.approx(difference, rel=1e-2)
