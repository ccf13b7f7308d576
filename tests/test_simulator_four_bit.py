"""The simulator's 4-bit bases (`simulator/four_bit.py`), held to bitsandbytes' real allocations on
the CPU, and the options of `hf-offload estimate` that ask for them."""

from __future__ import annotations

import contextlib

# bitsandbytes is a test dependency (pyproject's test extras): its absence is a failure, not a skip.
import bitsandbytes
import pytest
import torch
from conftest import tiny_model
from test_estimate import estimate_json, restore_logging  # noqa: F401 (restore_logging: an autouse fixture)

from hf_offload.tools.allocations import peak_allocated
from hf_offload.tools.cli import main
from hf_offload.tools.simulator import Simulator, Training
from hf_offload.tools.simulator import step as step_module
from hf_offload.tools.simulator.four_bit import FourBit, quantized_state_tensors

FP32, BF16 = torch.float32, torch.bfloat16


pytestmark = pytest.mark.usefixtures("quiet_simulation")


def _config(layers: int, width: int) -> dict:
    # Hidden 256 with heads of 64: every 4-bit weight a whole number of blocks of 64 and 256.
    return dict(hidden_size=256, intermediate_size=width, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, vocab_size=64, max_position_embeddings=2048)  # fmt: skip


def real_4bit_model(base: torch.nn.Module, four_bit: FourBit, dtype: torch.dtype, directory, lora_rank: int,
                    targets) -> torch.nn.Module:  # fmt: skip
    """The user's path: a checkpoint loaded with the BitsAndBytesConfig, prepared as asked, LoRA on top."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base.to(dtype).save_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=four_bit.config(), dtype=dtype, attn_implementation="eager"
    )
    if four_bit.prepare_model_for_kbit_training:
        from peft import prepare_model_for_kbit_training

        # As the simulator calls it: checkpointing is the mode's (prepare's default also makes the
        # embeddings' output require grad, which is kept).
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules=targets))
    model.train()
    return model


# (mode, 4-bit base, model dtype, tokens, tile, MLP width, layers, LoRA targets): each simulated and
# run for real on the CPU with bitsandbytes. Double quantization is left out where the forward's
# dequantized weight holds the peak: CUDA's product keeps the dequantized statistics alive through
# its matmul and the CPU's frees them first (1/16 byte per weight), which the stand-in follows CUDA in.
FOUR_BIT_STEPS = {
    # MatMul4Bit's backward dequantizes the weight again: the peak.
    "nf4-double-quant-checkpointing": ("checkpointing", FourBit("nf4", True, FP32), FP32, 256, None, 1024, 2,
                                       "all-linear"),
    # A long context's tiled step peaks in a layer's backward, 4-bit slices learnt and replayed.
    "fp4-tiled": ("checkpointing+tiled", FourBit("fp4", True, FP32), FP32, 1024, 128, 256, 2, "all-linear"),
    # bitsandbytes casts the input to the compute dtype and the output back; backward dequantizes in
    # the weight's dtype and casts the weight to the gradient's.
    "bf16-compute": ("none", FourBit("nf4", True, BF16), FP32, 256, None, 1024, 2, "all-linear"),
    # PEFT's preparation: a bf16 checkpoint whose other parameters go to float32; its 4-bit weights
    # dequantize in bf16 and are cast to float32 in backward.
    "prepared-bf16-base": ("checkpointing", FourBit("nf4", True, FP32, prepare_model_for_kbit_training=True), BF16,
                           256, None, 1024, 2, "all-linear"),
    # One layer with LoRA on down_proj alone: no base layer's input requires grad, so backward
    # dequantizes nothing and the forward's dequantized weights (the stand-in's) hold the peak.
    "forward-dequantized": ("none", FourBit("nf4", False, FP32), FP32, 64, None, 1024, 1, ("down_proj",)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FOUR_BIT_STEPS))
def test_simulated_4bit_peak_matches_real_bitsandbytes_allocations(case, tmp_path):
    """The simulated peak over the weights equals what torch's profiler counts the CPU allocator
    holding at its peak in the same step through bitsandbytes' real 4-bit layers (within 1%)."""
    mode, four_bit, dtype, seq, tile, width, layers, targets = FOUR_BIT_STEPS[case]
    base = tiny_model(attn_implementation="eager", **_config(layers, width))
    training = Training(dtype=dtype, lora_rank=4, lora_targets=targets, lora_dtype=FP32, four_bit=four_bit,
                        tile_tokens=tile)  # fmt: skip
    sim = Simulator(base.config, training)
    simulated = sim.run(mode, seq)
    import hf_offload

    model = real_4bit_model(base, four_bit, dtype, tmp_path, 4, targets)
    if mode.startswith("checkpointing"):
        model.get_base_model().activation_checkpointing_enable()
    if mode.endswith("+tiled"):
        hf_offload.enable_sequence_tiling(model.get_base_model(), tile_tokens=tile)
    ids = torch.randint(64, (1, seq))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)

    measured, _ = peak_allocated(step, ignore_bytes=torch.get_rng_state().nbytes)
    if "tiled" in case:
        assert simulated.peak.tag[1].startswith("layer")
    assert simulated.tracked_peak_bytes - sim.resident_bytes == pytest.approx(measured, rel=0.01)


def test_the_4bit_check_catches_a_simulation_that_forgets_the_dequantized_weight(monkeypatch, tmp_path):
    """Companion: without `dequantizing_gemm` bitsandbytes' product on meta tensors is its fake
    kernel, which makes only the output; where the forward's dequantized weights hold the peak, the
    simulated peak then misses the real one by more than 1%."""
    monkeypatch.setattr(step_module, "dequantizing_gemm", contextlib.nullcontext)
    with pytest.raises(AssertionError, match="comparison failed"):
        test_simulated_4bit_peak_matches_real_bitsandbytes_allocations("forward-dequantized", tmp_path)


@pytest.mark.parametrize("double_quant", [False, True])
def test_the_weights_simulated_are_the_packed_weights_and_their_statistics(double_quant, tmp_path):
    """What the simulator holds for a 4-bit base is what bitsandbytes holds on the CPU, storage for
    storage; per 4-bit weight of n parameters: the packed weight (n / 2 bytes), a float32 absmax
    per block of 64 and the 16-entry 4-bit code (0.5625 bytes per parameter at 8B); with double
    quantization a byte per block instead, requantized in blocks of 256 with a float32 absmax, a
    256-entry float32 code and the offset (about 0.516)."""
    four_bit = FourBit("nf4", double_quant, BF16)
    base = tiny_model(**_config(2, 512))
    sim = Simulator(base.config, Training(dtype=BF16, lora_rank=4, four_bit=four_bit))
    model = real_4bit_model(base, four_bit, BF16, tmp_path, 4, "all-linear")
    storages = {}
    for tensor in [*model.parameters(), *model.buffers(), *quantized_state_tensors(model)]:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    assert sim.resident_bytes == sum(storages.values())

    for module in model.modules():
        if not isinstance(module, bitsandbytes.nn.Linear4bit):
            continue
        n = module.in_features * module.out_features
        held = module.weight.untyped_storage().nbytes()
        held += sum(t.untyped_storage().nbytes() for t in quantized_state_tensors(module))
        blocks = n // 64
        statistics = blocks + 4 * -(-blocks // 256) + 256 * 4 + 4 if double_quant else 4 * blocks
        assert held == n // 2 + statistics + 16 * 4


def test_estimate_options_name_bitsandbytes_fields(capsys):
    """--load-in-4bit and BitsAndBytesConfig's fields reach the simulated step and the JSON's setup;
    the 4-bit base holds less than the bf16 one."""
    base = ["--preset", "tiny", "--lora-rank", "4", "--seq-len", "256", "--modes", "checkpointing",
            "--optimizer-states", "0"]  # fmt: skip
    plain = estimate_json(capsys, *base)
    four = estimate_json(capsys, *base, "--load-in-4bit", "--bnb-4bit-quant-type", "nf4",
                         "--bnb-4bit-use-double-quant", "--bnb-4bit-compute-dtype", "bf16")  # fmt: skip
    assert four["setup"]["four_bit"] == {
        "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16",
        "prepare_model_for_kbit_training": False,
    }  # fmt: skip
    assert plain["setup"]["four_bit"] is None
    def weights(result):
        return next(p["bytes"] for p in result["modes"]["checkpointing"]["peak"]["parts"] if p["phase"] == "weights")

    assert weights(four) < 0.6 * weights(plain)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--bnb-4bit-quant-type", "nf4"], "--bnb-4bit-quant-type: describes a 4-bit base: give --load-in-4bit"),
        (["--prepare-model-for-kbit-training"], "argument --prepare-model-for-kbit-training: describes a 4-bit base"),
        (["--load-in-4bit"], "argument --load-in-4bit: a 4-bit base is trained through adapters: give --lora-rank"),
        (["--load-in-4bit", "--bnb-4bit-quant-type", "int4"], "invalid choice: 'int4'"),
    ],
)  # fmt: skip
def test_bad_4bit_arguments_are_named(capsys, args, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--preset", "tiny", *args])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_a_4bit_base_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="bnb_4bit_quant_type must be one of"):
        FourBit("int4")
    with pytest.raises(ValueError, match="give lora_rank with four_bit"):
        Training(four_bit=FourBit())
