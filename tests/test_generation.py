"""GRPO's generation simulated (`hf_offload.tools.simulator.generation`): transformers' own
`generate` on the meta device, through the prefill and a few decode steps, extrapolated along the
KV cache's exactly linear growth; held to real CPU allocations of `generate` as TRL calls it
(do_sample, no_grad, training mode, checkpointing off, left-padded prompts)."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import tiny_model

from hf_offload.tools.allocations import peak_allocated
from hf_offload.tools.simulator import Simulator, Training, TrlStep
from hf_offload.tools.simulator import generation as generation_module
from hf_offload.tools.simulator.generation import HostReadNotSimulated, Line, generation_config_as_trl, probed

PROMPT = 16
# A vocabulary of 64 words and eager attention (no kernel whose CPU and CUDA versions allocate
# differently): the KV cache dominates at these lengths, as it does at long ones on a GPU.
CONFIG = dict(vocab_size=64, max_position_embeddings=2048, pad_token_id=0, bos_token_id=2, eos_token_id=3,
              attn_implementation="eager")  # fmt: skip


pytestmark = pytest.mark.usefixtures("quiet_simulation")


@pytest.fixture(scope="module")
def simulator():
    return Simulator(tiny_model(**CONFIG).config, Training(dtype=torch.float32, trl=TrlStep("grpo", kernel="torch")))


@functools.cache
def real_generate_peak(rows: int, completion: int, config: tuple = ()) -> int:
    """The most bytes real `generate` allocates on the CPU for `rows` left-padded prompts (the first
    row one token shorter) and `completion` new tokens, as TRL calls it (every row to the end:
    `run_to_the_end`)."""
    extra = run_to_the_end(completion)
    model = tiny_model(**{**CONFIG, **dict(config)})
    model.train()
    generator = torch.Generator().manual_seed(rows)
    ids = torch.randint(4, 64, (rows, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    ids[0, 0], mask[0, 0] = CONFIG["pad_token_id"], 0
    config = generation_config_as_trl(model, completion, extra)

    def run():
        with torch.no_grad():
            output = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert output.shape == (rows, PROMPT + completion)

    peak, _ops = peak_allocated(run, ignore_bytes=torch.get_rng_state().nbytes)
    return peak


def run_to_the_end(completion: int) -> dict:
    """Every row runs to the completion length (no eos before it), as the simulation's stop check
    says: GRPOConfig.generation_kwargs' min_new_tokens, which TRL merges into its generation config."""
    return {"min_new_tokens": completion}


# Lengths where no tensor of generate's is as large as the RNG state the measurement leaves out (5,056
# bytes: at 64 tokens after 16, 4 rows' eager attention weights are, and the measured peak falls short).
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("completion", [48, 96])
def test_simulated_generation_matches_real_cpu_generate(simulator, rows, completion):
    """The simulated peak at `completion` tokens, extrapolated from 4 decode steps along their
    line, is what torch's profiler counts real `generate` holding, within 1%, at two lengths and
    two generation batch sizes."""
    result = simulator.generate("none", rows=rows, prompt_length=PROMPT, padded=True,
                                generation_kwargs=run_to_the_end(completion))  # fmt: skip
    assert completion - 1 > len(result.steps)  # extrapolated, not simulated
    assert result.peak_bytes(completion) == pytest.approx(real_generate_peak(rows, completion), rel=0.01)


def test_the_check_tells_the_cache_growth_from_the_textbook_formula(simulator):
    """Companion: the cache alone (rows x tokens x layers x KV heads x head_dim x 2 x bytes) with
    the prefill's peak is off by more than 1%: the check sees `DynamicCache`'s copy of one layer
    into a tensor one token longer at every step, the ids and the mask, not just the cache."""
    rows, completion = 4, 96
    result = simulator.generate("none", rows=rows, prompt_length=PROMPT, padded=True,
                                generation_kwargs=run_to_the_end(completion))  # fmt: skip
    textbook = rows * (PROMPT + completion) * result.kv_bytes_per_token
    real = real_generate_peak(rows, completion)
    assert abs(textbook - real) > 0.01 * real
    assert result.peak.per_token > rows * result.kv_bytes_per_token


def test_a_read_the_simulator_cannot_answer_names_transformers_and_where(simulator, monkeypatch):
    """generate reads values of tensors the meta device does not hold; one not in the table
    raises, naming transformers' version, the function and its file and line."""
    import transformers

    kept = tuple(read for read in generation_module._READS if read.function != "__call__")
    monkeypatch.setattr(generation_module, "_READS", kept)
    where = rf"transformers {transformers.__version__}'s __call__ \(.*utils.py:"
    with pytest.raises(HostReadNotSimulated, match=where):
        simulator.generate("none", rows=2, prompt_length=PROMPT)


def test_decode_steps_off_their_line_refuse_the_extrapolation():
    """The lines hold exactly, or `generate`'s decode steps are not what the extrapolation assumes."""
    assert generation_module._line([5.0, 7.0, 9.0, 11.0], "bytes", exact=True) == Line(3.0, 2.0)
    with pytest.raises(RuntimeError, match="do not grow linearly in bytes: step 4"):
        generation_module._line([5.0, 7.0, 9.0, 12.0], "bytes", exact=True)


def test_longest_completion_is_the_last_that_fits(simulator):
    """`longest` is a multiple of the grid whose peak fits, the next one's does not."""
    result = simulator.generate("none", rows=2, prompt_length=PROMPT)
    budget = result.peak_bytes(1000)
    longest = result.longest(budget, granularity=64)
    assert longest % 64 == 0 and result.peak_bytes(longest) <= budget < result.peak_bytes(longest + 64)
    assert result.longest(result.prefill.peak_bytes - 1) is None


def test_the_generation_config_is_trls(tmp_path):
    """What the simulation passes to `generate` is what GRPOTrainer builds (TRL 1.16: sampling with
    its defaults, no compile), read from a real trainer; its generation in training mode without
    grad and checkpointing is held by tests/test_grpo.py's spy."""
    from conftest import quiet_training_args
    from test_grpo import grpo_dataset
    from test_trl import TOKENIZER, lm_model
    from trl import GRPOConfig, GRPOTrainer

    model = lm_model()
    args = GRPOConfig(**quiet_training_args(tmp_path, max_steps=1, per_device_train_batch_size=2), num_generations=2,
                      max_completion_length=7, bf16=False)  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=grpo_dataset(), processing_class=TOKENIZER)  # fmt: skip
    theirs, ours = trainer.generation_config, generation_config_as_trl(model, 7)
    fields = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "cache_implementation", "disable_compile", "pad_token_id")  # fmt: skip
    assert {name: getattr(ours, name) for name in fields} == {name: getattr(theirs, name) for name in fields}


# A vocabulary of 4,096 words: at a short cache the sampler's float32 copies of the logits set
# generate's peak; from a few hundred tokens a per-layer copy of the cache does (eager attention's
# repeat_kv here; DynamicCache's torch.cat with SDPA), which the short run's line does not see.
WIDE = (("vocab_size", 4096), ("max_position_embeddings", 4096))


@pytest.mark.parametrize("completion", [384, 576])
def test_the_peak_is_simulated_where_the_cache_copy_outgrows_the_short_runs(completion):
    """At lengths where a copy of one layer's cache sets the peak, the peak simulated again there
    (`probed`: a prompt as long as the cache before the last step) is what real CPU generate holds,
    within 1.5% and never under; extrapolated from the short run's line alone it falls short (the
    companion: the line of what peaked at 16 tokens)."""
    wide = Simulator(tiny_model(**{**CONFIG, **dict(WIDE)}).config,
                     Training(dtype=torch.float32, trl=TrlStep("grpo", kernel="torch")))  # fmt: skip
    kwargs = run_to_the_end(completion)
    short = wide.generate("none", rows=2, prompt_length=PROMPT, padded=True, generation_kwargs=kwargs)
    held = probed(wide, "none", short, completion, generation_kwargs=kwargs)
    real = real_generate_peak(2, completion, WIDE)
    assert real <= held.peak_bytes(completion) <= 1.015 * real
    assert short.peak_bytes(completion) < 0.99 * real
