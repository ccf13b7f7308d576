"""`hf-offload bench --find-max-seq`: the search and the slope method as pure functions, then on a
real (tiny) model on the CPU, where `--memory-limit` turns the byte accounting into a simulated
out-of-memory so that the whole flow runs here; Liger's FLCE path; the presets and how their
weights are built."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bit_identical, tiny_model, train_step
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_offload
import hf_offload.tools.bench as bench
from hf_offload.tools import modes
from hf_offload.tools.bench import Record, find_max_seq, fit_bytes_per_token, predict_max_seq, slope_max_seq
from hf_offload.tools.cli import main
from hf_offload.tools.presets import preset_config

CPU = torch.device("cpu")


def predicate(longest: int, mode: str = "m", fail_at: dict[int, str] | None = None):
    """A synthetic `fits`: lengths up to `longest` fit, longer ones run out of memory."""
    probed = []

    def fits(length: int) -> Record:
        probed.append(length)
        if fail_at and length in fail_at:
            return Record(mode, length, fail_at[length])
        return Record(mode, length, "ok" if length <= longest else "oom", step_seconds=1.0, tokens_per_second=1.0)

    return fits, probed


# -- the search ------------------------------------------------------------------------------


@pytest.mark.parametrize("longest", [1024, 1500, 4095, 4096, 5000, 70_000, 131_071])
@pytest.mark.parametrize("granularity", [1024, 256, 1])
def test_search_is_exact_to_the_granularity(longest, granularity):
    fits, probed = predicate(longest)
    result = find_max_seq(fits, start=1024, granularity=granularity, limit=1 << 20)
    assert result.status == "ok" and result.mode == "m"
    # The true maximum lies in [max_seq_len, first_oom) and that interval is at most one step wide.
    assert result.max_seq_len <= longest < result.first_oom.seq_len
    assert result.first_oom.seq_len - result.max_seq_len <= granularity
    # With a start on the grid the answer is the longest multiple of the granularity that fits.
    assert result.max_seq_len == longest // granularity * granularity
    assert result.at_max.seq_len == result.max_seq_len and result.first_oom.status == "oom"
    # Doubling then bisection: one probe per doubling, then about log2(bracket / granularity).
    doublings = math.floor(math.log2(longest / 1024)) + 2
    bracket = result.probes[doublings - 1].seq_len - result.probes[doublings - 2].seq_len
    assert len(probed) <= doublings + math.ceil(math.log2(bracket / granularity)) + 1
    assert probed[:doublings] == [1024 * 2**i for i in range(doublings)]
    assert len(set(probed)) == len(probed), "a length was probed twice"


def test_search_probes_step_by_step():
    fits, probed = predicate(5000)
    result = find_max_seq(fits, start=1024, granularity=1024, limit=1 << 20)
    assert probed == [1024, 2048, 4096, 8192, 6144, 5120]
    assert (result.max_seq_len, result.first_oom.seq_len) == (4096, 5120)


def test_search_from_a_start_off_the_grid():
    fits, probed = predicate(3000)
    result = find_max_seq(fits, start=1000, granularity=1024, limit=1 << 20)
    assert probed == [1000, 2000, 4000, 2048, 3072]
    assert (result.max_seq_len, result.first_oom.seq_len) == (2048, 3072)


def test_a_mode_that_runs_out_of_memory_at_the_start():
    fits, probed = predicate(100)
    result = find_max_seq(fits, start=1024, granularity=1024, limit=1 << 20)
    assert probed == [1024]
    assert result.status == "oom at the start"
    assert result.max_seq_len is None and result.at_max is None and result.first_oom.seq_len == 1024


def test_the_search_stops_at_the_limit():
    fits, probed = predicate(1 << 30)
    result = find_max_seq(fits, start=1024, granularity=1024, limit=5000)
    assert probed == [1024, 2048, 4096, 5000]
    assert result.status == "reached the limit" and result.max_seq_len == 5000 and result.first_oom is None
    fits, probed = predicate(4500)
    result = find_max_seq(fits, start=1024, granularity=256, limit=5000)
    assert probed[:4] == [1024, 2048, 4096, 5000] and result.max_seq_len == 4352  # 4500 // 256 * 256


def test_a_failure_that_is_not_out_of_memory_stops_the_search():
    fits, probed = predicate(1 << 30, fail_at={4096: "failed: RuntimeError: no Triton driver"})
    result = find_max_seq(fits, start=1024, granularity=1024, limit=1 << 20)
    assert probed == [1024, 2048, 4096]
    assert result.status == "stopped at 4096: failed: RuntimeError: no Triton driver"
    assert result.max_seq_len == 2048 and result.first_oom is None
    fits, probed = predicate(1 << 30, fail_at={1024: "skipped: No module named 'liger_kernel'"})
    result = find_max_seq(fits, start=1024, granularity=1024, limit=1 << 20)
    assert probed == [1024] and result.max_seq_len is None and "skipped" in result.status


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(start=0, granularity=1, limit=8), "start must be a positive integer, got 0"),
        (dict(start=8, granularity=0, limit=8), "granularity must be a positive integer, got 0"),
        (dict(start=8, granularity=1, limit=4), r"limit \(4\) must be >= start \(8\)"),
    ],
)
def test_bad_search_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        find_max_seq(predicate(10)[0], **options)


# -- the slope method -----------------------------------------------------------------------------


def test_slope_fit_and_prediction():
    assert fit_bytes_per_token([(4096, 1000 + 4096 * 300), (8192, 1000 + 8192 * 300)]) == (300, 1000)
    # The longest multiple of the granularity under the budget; None when nothing grows or fits.
    assert predict_max_seq(300, 1000, 1000 + 300 * 70_000, 1024) == 69_632
    assert predict_max_seq(300, 1000, 1000 + 300 * 70_000, 1) == 70_000
    assert predict_max_seq(0, 1000, 10**9, 1024) is None
    assert predict_max_seq(300, 2000, 1000, 1024) is None
    with pytest.raises(ValueError, match="two different lengths"):
        fit_bytes_per_token([(4096, 1), (4096, 2)])


def test_slope_method_measures_two_lengths_and_verifies_once():
    calls = []

    def measure(length, verifying=False):
        calls.append((length, verifying))
        peak = 5_000 + 300 * length
        if peak > 5_000 + 300 * 70_000:
            return Record("m", length, "oom")
        return Record("m", length, "ok", peak_device_bytes=peak, offloaded_bytes=8 * length, step_seconds=1.0)

    def predict(budget):
        return slope_max_seq(
            measure,
            lengths=(4096, 8192),
            budget=budget,
            granularity=1024,
            peak=lambda r: r.peak_device_bytes,
            verify=True,
        )

    result = predict(5_000 + 300 * 70_000)
    assert calls == [(4096, False), (8192, False), (69_632, True)]
    assert result.status == "ok" and result.predicted_max_seq_len == 69_632
    assert (result.bytes_per_token, result.fixed_bytes) == (300, 5_000)
    assert result.predicted_offloaded_bytes == 8 * 69_632 and result.verify.status == "ok"
    # The same with a device that holds less than the fit says: the verification says so.
    result = predict(5_000 + 300 * 80_000)
    assert result.verify.status == "oom" and result.status == "predicted length did not fit"


def test_slope_method_says_when_hf_offload_moved_nothing_at_the_short_length():
    # At the shorter length every tensor was under min_offload_bytes and stayed: the two points are
    # not on the line the mode follows at long lengths.
    def measure(length, verifying=False):
        moved = 0 if length < 1000 else 8 * length
        return Record("m", length, "ok", peak_device_bytes=100 * length - 5 * moved, offloaded_bytes=moved)

    result = slope_max_seq(
        measure, lengths=(512, 1024), budget=10**6, granularity=64, peak=lambda r: r.peak_device_bytes
    )
    assert result.status.startswith("unreliable: hf_offload moved a different share of the bytes")
    assert result.predicted_max_seq_len is not None


def test_slope_method_stops_when_a_short_length_fails():
    result = slope_max_seq(
        lambda length, verifying=False: Record("m", length, "failed: RuntimeError: 0 active drivers"),
        lengths=(4096, 8192),
        budget=10**12,
        granularity=1024,
        peak=lambda r: r.peak_device_bytes,
    )
    assert result.status == "stopped at 4096: failed: RuntimeError: 0 active drivers"
    assert result.predicted_max_seq_len is None and len(result.probes) == 1


# -- on a real model, on the CPU ----------------------------------------------------------------


def test_search_and_slope_agree_under_a_simulated_limit():
    model = tiny_model()
    mode = "checkpointing+hf_offload"
    # A limit some 100 tokens long, measured rather than assumed.
    at_40 = bench._probe(model, mode, 40, 1, 1, CPU, 0).resident_activation_bytes
    limit = int(at_40 * 2.5)
    options = dict(modes=[mode], device=CPU, granularity=8, memory_limit=limit, min_offload_bytes=0, log=None)
    (searched,) = bench.max_seq(model, method="search", start=16, limit=1024, **options)
    assert searched.status == "ok"
    assert searched.at_max.resident_activation_bytes <= limit
    assert searched.first_oom.status == "oom" and searched.first_oom.seq_len - searched.max_seq_len <= 8
    assert all(p.status == "oom" for p in searched.probes if p.seq_len > searched.max_seq_len)
    (sloped,) = bench.max_seq(model, method="slope", slope_lens=(16, 32), verify=True, **options)
    # Activation bytes are linear in length on the CPU, so the two methods must agree exactly.
    assert sloped.predicted_max_seq_len == searched.max_seq_len
    assert sloped.verify.status == "ok" and sloped.verify.seq_len == searched.max_seq_len
    assert sloped.offloaded_bytes_per_token > 0 and sloped.predicted_offloaded_bytes > 0
    assert not hf_offload.is_activation_offloading(model), "the search leaves the model as it found it"


def test_a_probe_that_runs_out_of_memory_mid_forward_leaves_the_model_usable():
    model = tiny_model()
    reference = copy.deepcopy(model)
    mode = "checkpointing+hf_offload"
    before = bench._probe(model, mode, 24, 1, 1, CPU, 0)
    mlp = model.model.layers[1].mlp
    forward = mlp.forward

    def out_of_memory_above_48(hidden_states):
        if hidden_states.shape[1] > 48:
            raise torch.OutOfMemoryError("injected in the middle of the forward pass")
        return forward(hidden_states)

    mlp.forward = out_of_memory_above_48
    (result,) = bench.max_seq(model, modes=[mode], device=CPU, start=12, granularity=4, limit=512, log=None,
                              min_offload_bytes=0)  # fmt: skip
    assert (result.max_seq_len, result.first_oom.seq_len) == (48, 52)
    assert sum(p.status == "oom" for p in result.probes) >= 2
    del mlp.forward
    assert all(p.grad is None for p in model.parameters())
    # The same probe again measures the same bytes, and the model still trains exactly as before.
    after = bench._probe(model, mode, 24, 1, 1, CPU, 0)
    assert after.status == "ok"
    assert (after.resident_activation_bytes, after.offloaded_bytes) == (
        before.resident_activation_bytes,
        before.offloaded_bytes,
    )
    ids = torch.randint(97, (2, 12), generator=torch.Generator().manual_seed(3))
    _, expected = train_step(reference, ids)
    _, actual = train_step(model, ids)
    assert_bit_identical(expected, actual)


def test_a_verification_step_is_one_step_and_still_reports_what_was_offloaded():
    model = tiny_model()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    mode = "checkpointing+hf_offload"
    # As on CUDA: no byte accounting, no warm-up.
    record = bench._measure(model, mode, 24, 1, 1, CPU, 0, accounting=False, warmup=False)
    assert len(forwards) == 1
    assert record.status == "ok" and record.resident_activation_bytes is None
    assert record.offloaded_bytes == bench._measure(model, mode, 24, 1, 1, CPU, 0).offloaded_bytes > 0
    with pytest.raises(ValueError, match="accounting=True is needed"):
        bench._measure(model, mode, 24, 1, 1, CPU, 0, accounting=False, memory_limit=2**20)
    bench._configure(model, "none", CPU)


# -- Liger's fused linear cross-entropy ----------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_liger_flce_is_an_instance_forward_and_comes_off_again(family):
    model = tiny_model(family)
    class_forward = type(model).forward
    modes.set_liger_flce(model, True)
    assert modes.is_liger_flce(model) and "forward" in model.__dict__
    assert type(model).forward is class_forward, "Liger must patch the instance, never the class"
    assert model.forward.__func__.__module__ == f"liger_kernel.transformers.model.{family}"
    modes.set_liger_flce(model, False)
    assert not modes.is_liger_flce(model) and "forward" not in model.__dict__
    # Nothing else of Liger's was applied: the layers keep transformers' own modules.
    assert type(model.model.norm).__module__.startswith("transformers.")
    assert type(model.model.layers[0].mlp).__module__.startswith("transformers.")


def test_liger_on_the_cpu_is_recorded_as_failed_not_fatal():
    model = tiny_model()
    (result,) = bench.max_seq(model, modes=["checkpointing+liger"], device=CPU, start=16, granularity=8, limit=64,
                              log=None)  # fmt: skip
    # Liger's kernels are Triton, which has no CPU driver: the step fails, with the reason.
    assert result.max_seq_len is None and len(result.probes) == 1
    assert result.status.startswith("stopped at 16: failed: ") and "driver" in result.status
    assert not modes.is_liger_flce(model), "the failed mode was taken off again"


def pure_torch_flce(calls):
    """A stand-in for `liger_fused_linear_cross_entropy` for CPU tests (Liger's own is Triton-only).
    Like Liger's it computes the loss and the hidden states' gradient in the forward pass, outside
    autograd, and keeps only that gradient, never the vocabulary-wide logits; unlike Liger's it does
    not chunk, so the logits exist for a moment. A frozen head (LoRA) only."""

    class FusedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, target, ignore_index):
            with torch.no_grad():
                logits = F.linear(hidden, weight).float()
                valid = target != ignore_index
                rows, picked = torch.arange(len(target)), target.clamp_min(0)
                count = valid.sum().clamp_min(1)
                loss = ((logits.logsumexp(-1) - logits[rows, picked]) * valid).sum() / count
                grad_logits = torch.softmax(logits, -1)
                grad_logits[rows, picked] -= 1
                grad_hidden = (grad_logits * (valid[:, None] / count)).to(weight.dtype) @ weight
            ctx.save_for_backward(grad_hidden)
            return loss

        @staticmethod
        def backward(ctx, grad_loss):
            (grad_hidden,) = ctx.saved_tensors
            return grad_hidden * grad_loss, None, None, None

    def flce(input, weight, target, ignore_index=-100, reduction="mean", **unused):
        assert reduction == "mean" and not weight.requires_grad
        calls.append(tuple(input.shape))
        return FusedLinearCrossEntropy.apply(input, weight, target, ignore_index)

    return flce


def test_liger_modes_run_through_with_a_stand_in_kernel(monkeypatch):
    import liger_kernel.transformers.functional as liger_functional
    from peft import LoraConfig, get_peft_model

    calls = []
    monkeypatch.setattr(liger_functional, "liger_fused_linear_cross_entropy", pure_torch_flce(calls))
    model = get_peft_model(tiny_model(vocab_size=512), LoraConfig(r=4, target_modules="all-linear"))
    plain = bench._probe(model, "checkpointing+hf_offload", 32, 1, 1, CPU, 0)
    liger = bench._probe(model, "checkpointing+hf_offload+liger", 32, 1, 1, CPU, 0)
    assert liger.status == "ok" and liger.mode == "checkpointing+hf_offload+liger"
    assert calls and calls[0] == (32, 32), "Liger's loss was not the one computed"
    # The head keeps hidden-sized gradients instead of the 512-wide logits.
    assert liger.resident_activation_bytes < plain.resident_activation_bytes
    assert liger.offloaded_bytes == plain.offloaded_bytes  # hf_offload's part is the same
    # The same loss and gradients as transformers' own head.
    ids = torch.randint(512, (1, 32), generator=torch.Generator().manual_seed(0))
    bench._configure(model, "none", CPU)
    expected_loss, expected = train_step(model, ids)
    bench._configure(model, "none+liger", CPU)
    loss, actual = train_step(model, ids)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(actual, expected)
    bench._configure(model, "none", CPU)
    assert not modes.is_liger_flce(model.get_base_model())


# -- presets and building weights --------------------------------------------------------------


@pytest.mark.parametrize(
    "preset,model_type,parameters,queries_per_kv_head",
    # The published parameter counts of Meta-Llama-3-8B and Qwen2-7B.
    [("llama-3-8b", "llama", 8_030_261_248, 4), ("qwen2-7b", "qwen2", 7_615_616_512, 7)],
)
def test_large_presets_have_the_real_models_shapes(preset, model_type, parameters, queries_per_kv_head):
    config = preset_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert config.model_type == model_type
    assert sum(p.numel() for p in model.parameters()) == parameters
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.out_features == queries_per_kv_head * attention.k_proj.out_features
    assert (attention.q_proj.bias is not None) == (model_type == "qwen2")


class FactoryDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtypes of every floating tensor of at least 4096 elements that any op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel() >= 4096:
                self.dtypes.add(tensor.dtype)
        return out


def small_config():
    return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)  # fmt: skip


def test_building_on_the_device_never_makes_fp32_weights():
    with FactoryDtypes() as seen:
        model = bench.build_on_device(small_config(), CPU, torch.bfloat16)
    assert seen.dtypes == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.training
    # Companion: the check catches a build that makes fp32 weights first and casts them.
    with FactoryDtypes() as seen:
        AutoModelForCausalLM.from_config(small_config()).to(torch.bfloat16)
    assert torch.float32 in seen.dtypes


def test_build_model_builds_large_shapes_in_place_on_an_accelerator(monkeypatch):
    built = []
    monkeypatch.setattr(bench, "build_on_device", lambda config, device, dtype: built.append((config, device, dtype)))
    bench.build_model("llama-3-8b", None, torch.device("cuda"), torch.bfloat16)
    ((config, device, dtype),) = built
    assert (config.vocab_size, config.num_key_value_heads, device.type, dtype) == (128256, 8, "cuda", torch.bfloat16)
    assert config.rope_parameters["rope_theta"] == 500000.0
    # The tiny preset keeps the CPU path (same weights everywhere), and so does anything on the CPU.
    assert bench.build_model("tiny", None, CPU, torch.float32).model.embed_tokens.weight.dtype == torch.float32
    assert len(built) == 1


def test_memory_limit_on_cuda_caps_the_allocator_and_restores_it(monkeypatch):
    fractions = []

    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2**30)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    cuda = torch.device("cuda", 0)
    with bench.memory_limit_applied(cuda, 40 * 2**30):
        assert fractions == [0.5]
        assert bench.device_budget(cuda, 40 * 2**30) == 40 * 2**30
    assert fractions == [0.5, 1.0]
    assert bench.device_budget(cuda, None) == 72 * 2**30  # free plus what the allocator holds
    too_much = pytest.raises(ValueError, match=r"--memory-limit 100.00 GiB is more than this device's 80.00 GiB")
    with too_much, bench.memory_limit_applied(cuda, 100 * 2**30):
        pass
    assert "set_per_process_memory_fraction" in bench.limit_meaning(cuda, 40 * 2**30)
    assert "simulated out-of-memory" in bench.limit_meaning(CPU, 2**20)


# -- the command line ---------------------------------------------------------------------------------


@pytest.fixture
def micro_model_dir(tmp_path):
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=97).save_pretrained(tmp_path / "model")  # fmt: skip
    return tmp_path / "model"


def find_max_seq_cli(tmp_path, model_dir, *extra):
    out = tmp_path / "out"
    argv = ["bench", "--find-max-seq", "--model", str(model_dir), "--out", str(out), "--min-offload-bytes", "0", *extra]
    assert main(argv) == 0
    return json.loads((out / "max_seq.json").read_text()), out


def test_find_max_seq_from_the_command_line(tmp_path, micro_model_dir, capsys):
    result, out = find_max_seq_cli(
        tmp_path, micro_model_dir, "--modes", "none", "checkpointing+hf_offload", "--start", "32", "--granularity",
        "32", "--memory-limit", "0.00025",
    )  # fmt: skip
    by_mode = {r["mode"]: r for r in result["results"]}
    none, ours = by_mode["none"], by_mode["checkpointing+hf_offload"]
    assert none["status"] == ours["status"] == "ok"
    assert 32 <= none["max_seq_len"] < ours["max_seq_len"]
    assert none["at_max"]["resident_activation_bytes"] <= 0.00025 * 2**30
    assert none["first_oom"]["status"] == "oom" and none["first_oom"]["seq_len"] - none["max_seq_len"] <= 32
    assert result["memory_limit_bytes"] == int(0.00025 * 2**30) and "simulated" in result["memory_limit_meaning"]
    table = (out / "max_seq.md").read_text()
    assert f"| checkpointing+hf_offload | {ours['max_seq_len']} |" in table
    assert "simulated out-of-memory" in table and (out / "max_seq.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "doubling then bisecting to 32 tokens" in printed and "simulated out-of-memory" in printed


def test_slope_method_from_the_command_line(tmp_path, micro_model_dir):
    result, out = find_max_seq_cli(
        tmp_path, micro_model_dir, "--method", "slope", "--slope-lens", "16", "32", "--granularity", "8", "--verify",
        "--modes", "checkpointing", "--memory-limit", "0.0005",
    )  # fmt: skip
    (sloped,) = result["results"]
    assert sloped["status"] == "ok" and sloped["verify"]["status"] == "ok"
    assert sloped["predicted_max_seq_len"] % 8 == 0 and sloped["verify"]["seq_len"] == sloped["predicted_max_seq_len"]
    assert sloped["verify"]["resident_activation_bytes"] <= 0.0005 * 2**30
    assert "| checkpointing |" in (out / "max_seq.md").read_text()


@pytest.mark.parametrize(
    "extra,fragment",
    [
        (["--verify"], "argument --verify: only with --find-max-seq"),
        (["--method", "slope"], "argument --method: only with --find-max-seq"),
        (["--find-max-seq", "--seq-lens", "64"], "argument --seq-lens: not with --find-max-seq"),
        (["--find-max-seq", "--method", "slope"], "the slope method on the CPU needs --memory-limit"),
        (["--find-max-seq", "--verify"], "argument --verify: only with --method slope"),
        (["--find-max-seq", "--method", "slope", "--memory-limit", "1", "--slope-lens", "512", "256"],
         "the second length must be longer than the first, got 512 256"),
        (["--find-max-seq", "--start", "4096", "--seq-limit", "1024"], "--seq-limit: 1024 is below --start 4096"),
        (["--find-max-seq", "--batch-size", "2"], "--find-max-seq measures batch 1, got 2"),
        (["--memory-limit", "0"], "memory-limit must be > 0, got 0.0"),
        (["--modes", "hf_offload+ligr"], "invalid choice: 'hf_offload+ligr'"),
    ],
)  # fmt: skip
def test_bad_find_max_seq_arguments_are_named(extra, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *extra])
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err


def test_liger_flag_adds_each_mode_with_liger(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda args: seen.append(args.modes) or 0)
    assert main(["bench", "--modes", "none", "checkpointing", "checkpointing+liger", "--liger"]) == 0
    assert seen == [["none", "checkpointing", "checkpointing+liger", "none+liger"]]


# -- on a GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_search_and_slope_under_a_real_allocator_limit():
    cuda = torch.device("cuda")
    model = bench.build_model("tiny", None, cuda, torch.bfloat16)
    weights = torch.cuda.memory_allocated(cuda)
    limit = weights + 2 * 2**30
    options = dict(modes=["checkpointing"], device=cuda, granularity=1024, memory_limit=limit, log=None)
    (searched,) = bench.max_seq(model, method="search", start=4096, limit=1 << 20, **options)
    assert searched.status == "ok" and searched.first_oom is not None
    assert searched.at_max.peak_device_bytes <= limit
    (sloped,) = bench.max_seq(model, method="slope", slope_lens=(4096, 8192), verify=True, **options)
    # Allocator rounding and fragmentation make the prediction approximate on a GPU.
    assert abs(sloped.predicted_max_seq_len - searched.max_seq_len) <= 0.25 * searched.max_seq_len
    assert torch.cuda.memory_allocated(cuda) < weights + 2**20, "probes left memory behind"
