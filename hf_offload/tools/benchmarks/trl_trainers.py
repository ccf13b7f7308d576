"""TRL's SFTTrainer and GRPOTrainer with and without activation offloading: peak device memory
and tokens/s.

    python -m hf_offload.tools.benchmarks.trl_trainers [--seq-lens 4096 16384] [--steps 3] [--trainers sft grpo]
        [--setups neither trl_offload hf_offload hf_offload_tiled] [--preset 1b] [--no-checkpointing] [--lora-rank R]
        [--simulate]
    python -m hf_offload.tools.benchmarks.trl_trainers --stage tiling   # long sequences, tiled, beside the simulator
    python -m hf_offload.tools.benchmarks.trl_trainers --stage generation   # GRPO's generation beside the simulator
    python -m hf_offload.tools.benchmarks.trl_trainers --device cpu   # smoke run: tiny preset, a few tokens

`--stage generation`: GRPOTrainer with generation on the GPU, at two completion lengths (1,024
and 4,096 tokens after a 512-token prompt; 4 generations, a generation batch of 4; LoRA r=16;
checkpointing + hf_offload + tiling), with transformers' `generate` (TRL's default) and, where
vLLM imports, vLLM colocated (TRL's defaults: 0.3 of the GPU, no sleep mode) and with sleep mode.
Each phase's peak and time: generation (`torch.cuda.max_memory_allocated` and `_reserved` over
`generate`, or for vLLM the device's used memory from `torch.cuda.mem_get_info`, its pools being
outside PyTorch's counters with sleep mode) and the rest of the step (scoring and the policy step),
beside what `hf-offload estimate --trainer grpo` simulates for each (generation's peak, the step's
peak, the decode time's range).

`--stage tiling`: checkpointing + hf_offload + sequence tiling (`hf_offload_tiled`) where TRL's
fused head computes the loss, SFT at 65,536 and 131,072 tokens and GRPO with 4,096-token
completions after a 512-token prompt, 2 steps each, with `--simulate`: each row's peak beside the
peak `hf-offload estimate --trainer` simulates for the same step (TRL's step on the meta device,
the GPU's Triton head as a stand-in). The measured peak covers the whole run, GRPO's generation
with `model.generate` included; the simulated one is the training step's (the GRPO runs here
compute no old log-probabilities: without vLLM and with generation aligned to the optimizer
steps TRL reuses the policy's).

For each trainer and sequence length it trains a fresh random-weight Llama (the preset's shape,
bf16, built directly on the device) for a few steps in three setups: neither offloading; TRL's
own (`activation_offloading=True`); hf_offload (`model.enable_activation_offloading()`), with
gradient checkpointing on in all three unless --no-checkpointing. It prints a markdown table of
the peak device memory (torch.cuda.max_memory_allocated over the run: weights, gradients,
optimizer state and activations) and the tokens per second of the fastest step after the first,
with ratios against the "neither" row of the same trainer and length, measured in the same run.

SFT: batch 1 (--sft-batch-size), each sequence exactly seq-len tokens. GRPO: one prompt of
seq-len minus --completion-length tokens per step, --generations completions of exactly
--completion-length tokens each (min_new_tokens), TRL's default sampling, beta 0 (TRL's
default: no reference model), a cheap python reward; its step time includes generation, shown
apart in its own column. Tokens per step are read from the trainer's own `num_tokens` log.

TRL 1.16's GRPOConfig has no `activation_offloading`; for GRPO the script then enters TRL's
own offloading context (`get_act_offloading_ctx_manager(model)`) around each `training_step`,
as SFTTrainer does when the flag is on, and says so. A setup that fails (TRL's offloading
raises on a machine without an accelerator) or runs out of memory is recorded with the reason,
and the longer lengths of that setup are skipped.

Needs no network: the tokenizer is a word-level one built here with one word per id of the
model's vocabulary, the datasets are made here (`datasets` must be installed: TRL's trainers
import it). Without CUDA it says so and exits 2, unless --device cpu: a smoke run of the whole
script with the tiny preset, fp32 and hf_offload's CPU simulation, where memory is not measured
and the timings mean nothing. Exits 1 when a run without offloading or with hf_offload failed
other than by running out of memory, 2 without CUDA or without `datasets`.

The defaults (1b, 4096 and 16384 tokens, 3 steps, 12 runs) are estimated at about two minutes
on one H200; the script has not been run on a GPU yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_offload.internal import resolve
from hf_offload.tools import bench
from hf_offload.tools.presets import PRESET_ALIASES, PRESET_CONFIGS, preset_config, preset_names

TRAINERS = ("sft", "grpo")
SETUPS = ("neither", "trl_offload", "hf_offload", "hf_offload_tiled")
# The setups the simulator runs (TRL's own offloading needs an accelerator: not simulated).
SIMULATED_SETUPS = ("neither", "hf_offload", "hf_offload_tiled")
# --stage tiling: the lengths and setup it runs unless given.
TILING_STAGE = dict(setups=["hf_offload_tiled"], sft_seq_lens=[65536, 131072], completion_length=4096,
                    prompt_length=512, steps=2)  # fmt: skip
# --stage generation: completion lengths, prompt, generations, steps, LoRA rank (each unless given).
GENERATION_STAGE = dict(completion_lengths=[1024, 4096], prompt_length=512, generations=4, steps=2, lora_rank=16)
GENERATORS = ("transformers", "vllm", "vllm_sleep")
SPECIAL = ("<pad>", "<unk>", "<bos>", "<eos>")
PAD, UNK, BOS, EOS = range(len(SPECIAL))


@dataclass
class Record:
    trainer: str
    setup: str
    seq_len: int
    status: str  # "ok", "oom", "skipped: ...", "failed: ..."
    peak_device_bytes: int | None = None  # None on the CPU
    step_seconds: float | None = None  # the fastest step after the first
    generate_seconds: float | None = None  # GRPO: time inside model.generate in that step
    tokens_per_step: float | None = None
    tokens_per_second: float | None = None
    offloaded_bytes: int | None = None  # hf_offload's last step
    simulated_peak_bytes: int | None = None  # the simulator's peak for the same step (--simulate)
    leftover_bytes: int | None = None  # device memory still allocated when the run began (an earlier run's leak)


@dataclass
class Options:
    device: torch.device
    dtype: torch.dtype
    preset: str
    steps: int
    checkpointing: bool
    lora_rank: int
    sft_batch_size: int
    generations: int
    completion_length: int
    max_positions: int


def offline_tokenizer(vocab_size: int):
    """A word-level tokenizer with one word per id of the model's vocabulary ("w4" is id 4), so
    that every id a random model samples decodes; no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL)}
    vocab.update({f"w{index}": index for index in range(len(SPECIAL), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL[UNK]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=SPECIAL[PAD],
        unk_token=SPECIAL[UNK],
        bos_token=SPECIAL[BOS],
        eos_token=SPECIAL[EOS],
    )


def build_model(options: Options):
    """Random weights in the preset's shape, initialised on the device in the run's dtype (no host
    copy of a 1B model, no download)."""
    config = preset_config(options.preset)
    tokens = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    config.update(dict(tokens, max_position_embeddings=options.max_positions))
    torch.manual_seed(0)
    return bench.build_on_device(config, options.device, options.dtype)


def words(count: int, vocab_size: int, seed: int) -> str:
    """`count` random words of the offline tokenizer: exactly `count` tokens."""
    ids = torch.randint(len(SPECIAL), vocab_size, (count,), generator=torch.Generator().manual_seed(seed))
    return " ".join(f"w{index}" for index in ids.tolist())


def length_reward(completions, **kwargs) -> list[float]:
    """Cheap and varied within a group, so that advantages are not all zero."""
    return [float(len(completion) % 7) for completion in completions]


class StepTimer:
    """Wall time of each optimizer step (data loading excluded; GRPO's generation included, as
    TRL runs it inside training_step) and the time spent in model.generate during it."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        from transformers import TrainerCallback

        timer = self
        self.synchronize = synchronize
        self.steps: list[float] = []
        self.generate: list[float] = []
        self._in_generate = 0.0

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.synchronize()
                timer._start, timer._in_generate = time.perf_counter(), 0.0

            def on_step_end(self, args, state, control, **kwargs):
                timer.synchronize()
                timer.steps.append(time.perf_counter() - timer._start)
                timer.generate.append(timer._in_generate)

        self.callback = Callback()

    def wrap_generate(self, model) -> None:
        generate = model.generate

        def timed(*args, **kwargs):
            self.synchronize()
            start = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                self.synchronize()
                self._in_generate += time.perf_counter() - start

        model.generate = timed


def checkpointing_field(config_class) -> str:
    """transformers 5.24 renamed TrainingArguments.gradient_checkpointing (kept as an alias)."""
    names = {field.name for field in dataclasses.fields(config_class)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def has_trl_offloading_flag(config_class) -> bool:
    return "activation_offloading" in {field.name for field in dataclasses.fields(config_class)}


def grpo_trainer_with_trl_offloading():
    """GRPOTrainer with TRL's own offloading context around each training_step, exactly where
    SFTTrainer enters it when activation_offloading=True (GRPOConfig has no such flag)."""
    from trl import GRPOTrainer

    get_act_offloading_ctx_manager = resolve("trl.activation_offloading")

    class GRPOTrainerWithTRLOffloading(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.trl_offloading_context = get_act_offloading_ctx_manager(model=self.model)

        def training_step(self, *args, **kwargs):
            with self.trl_offloading_context:
                return super().training_step(*args, **kwargs)

    return GRPOTrainerWithTRLOffloading


def make_trainer(trainer_name: str, setup: str, seq_len: int, model, tokenizer, output_dir: str, options: Options):
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    on_cpu = options.device.type == "cpu"
    common = dict(
        output_dir=output_dir,
        max_steps=options.steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        use_cpu=on_cpu,
        bf16=options.dtype == torch.bfloat16,
    )
    config_class = SFTConfig if trainer_name == "sft" else GRPOConfig
    common[checkpointing_field(config_class)] = options.checkpointing
    trl_flag = setup == "trl_offload" and has_trl_offloading_flag(config_class)
    if trl_flag:
        common["activation_offloading"] = True
    peft_config = None
    if options.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=options.lora_rank, target_modules="all-linear", task_type="CAUSAL_LM")
    vocab = model.config.vocab_size
    if trainer_name == "sft":
        batch = options.sft_batch_size
        texts = [words(seq_len, vocab, seed) for seed in range(options.steps * batch)]
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common, per_device_train_batch_size=batch, max_length=seq_len, packing=False),
            train_dataset=Dataset.from_dict({"text": texts}),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    else:
        prompt_length = seq_len - options.completion_length
        prompts = [words(prompt_length, vocab, seed) for seed in range(options.steps + 1)]
        trainer_class = GRPOTrainer
        if setup == "trl_offload" and not trl_flag:
            trainer_class = grpo_trainer_with_trl_offloading()
        trainer = trainer_class(
            model=model,
            reward_funcs=length_reward,
            args=GRPOConfig(
                **common,
                per_device_train_batch_size=options.generations,
                num_generations=options.generations,
                max_completion_length=options.completion_length,
                generation_kwargs={"min_new_tokens": options.completion_length},
            ),
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    trainer.remove_callback(PrinterCallback)
    return trainer


def measure(trainer_name: str, setup: str, seq_len: int, tokenizer, options: Options) -> Record:
    import hf_offload

    cuda = options.device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    model = trainer = None
    if cuda:  # what a failed run's traceback held is free by now
        gc.collect()
        torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated() if cuda else None
    try:
        model = build_model(options)
        if setup in ("hf_offload", "hf_offload_tiled"):
            # On the CPU the engine simulates a device, and moves every tensor however small.
            extra = dict(simulate_on_cpu=True, min_offload_bytes=0) if not cuda else {}
            model.enable_activation_offloading(**extra)
        if setup == "hf_offload_tiled":
            model.enable_sequence_tiling()
        with tempfile.TemporaryDirectory() as output_dir:
            trainer = make_trainer(trainer_name, setup, seq_len, model, tokenizer, output_dir, options)
            timer = StepTimer(synchronize)
            trainer.add_callback(timer.callback)
            if trainer_name == "grpo":
                timer.wrap_generate(trainer.model)
            if cuda:
                synchronize()
                torch.cuda.reset_peak_memory_stats()
            trainer.train()
            synchronize()
        peak = torch.cuda.max_memory_allocated() if cuda else None
        counted = [entry["num_tokens"] for entry in trainer.state.log_history if "num_tokens" in entry]
        tokens_per_step = counted[-1] / options.steps
        timed = timer.steps[1:] or timer.steps  # the first step warms up (allocator, kernels, pools)
        fastest = timer.steps.index(min(timed), 1 if len(timer.steps) > 1 else 0)
        seconds = timer.steps[fastest]
        offloaded = None
        if setup in ("hf_offload", "hf_offload_tiled"):
            offloaded = hf_offload.activation_offloading_stats(trainer.model).offloaded_bytes
        return Record(
            trainer=trainer_name,
            setup=setup,
            seq_len=seq_len,
            status="ok",
            peak_device_bytes=peak,
            step_seconds=seconds,
            generate_seconds=timer.generate[fastest] if trainer_name == "grpo" else None,
            tokens_per_step=tokens_per_step,
            tokens_per_second=tokens_per_step / seconds,
            offloaded_bytes=offloaded,
            leftover_bytes=leftover,
        )
    finally:
        del trainer, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def simulated_peak(trainer_name: str, setup: str, seq_len: int, options: Options) -> int | None:
    """The peak `hf-offload estimate --trainer` simulates for this run's training step (batch, LoRA,
    checkpointing, offloading, tiling, AdamW as the Trainer runs them; the device's cuBLAS
    workspace), or None for a setup the simulator does not run."""
    from hf_offload.tools.devices import DEVICES
    from hf_offload.tools.simulator import Simulator, Training, TrlStep

    if setup not in SIMULATED_SETUPS:
        return None
    parts = (["checkpointing"] if options.checkpointing else []) + (["hf_offload"] if setup != "neither" else [])
    mode = "+".join(parts) or "none"
    if setup == "hf_offload_tiled":
        mode += "+tiled"
    config = preset_config(options.preset)
    config.update(dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS))
    config.update(dict(max_position_embeddings=options.max_positions))
    if trainer_name == "sft":
        step, batch, length = TrlStep("sft"), options.sft_batch_size, seq_len
    else:
        prompt = seq_len - options.completion_length
        step = TrlStep("grpo", prompt_length=prompt, num_generations=options.generations, grpo_beta=0.0,
                       old_log_probs=False)  # fmt: skip
        batch, length = options.generations, options.completion_length
    name = torch.cuda.get_device_name(options.device) if options.device.type == "cuda" else ""
    device = next((DEVICES[key] for tag, key in (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-80gb"))
                   if tag in name), DEVICES["h200"])  # fmt: skip
    training = Training(dtype=torch.bfloat16, lora_rank=options.lora_rank or None, optimizer_states=2,
                        batch_size=batch, device=device, trl=step)  # fmt: skip
    return Simulator(config, training).run(mode, length).peak_bytes


def run_all(trainers, setups, seq_lens, options: Options, report: Callable[[Record], None] = lambda record: None,
            simulate: bool = False):  # fmt: skip
    tokenizer = offline_tokenizer(PRESET_CONFIGS[PRESET_ALIASES.get(options.preset, options.preset)]["vocab_size"])
    records = []
    for trainer_name in trainers:
        stopped: dict[str, str] = {}
        for setup in setups:
            for seq_len in seq_lens:
                if setup in stopped:
                    record = Record(trainer_name, setup, seq_len, f"skipped: {stopped[setup]} at a shorter length")
                else:
                    try:
                        record = measure(trainer_name, setup, seq_len, tokenizer, options)
                    except Exception as error:  # a setup that fails is recorded, never fatal to the run
                        oom = bench._is_oom(error)
                        stopped[setup] = "out of memory" if oom else "failed"
                        status = "oom" if oom else f"failed: {type(error).__name__}: {str(error)[:160]}"
                        record = Record(trainer_name, setup, seq_len, status)
                if simulate and not record.status.startswith("skipped"):
                    record.simulated_peak_bytes = simulated_peak(trainer_name, setup, seq_len, options)
                records.append(record)
                report(record)
    return records


def _ratio(value, base) -> str:
    if value is None or base is None or not base:
        return "-"
    return f"{value / base:.3f}x"


def markdown_table(records: list[Record]) -> str:
    baseline = {(r.trainer, r.seq_len): r for r in records if r.setup == "neither" and r.status == "ok"}
    lines = [
        "| trainer | setup | seq | peak GiB | simulated GiB | peak vs neither | step ms | of it generate ms "
        "| tokens/step | tokens/s | tokens/s vs neither | offloaded MiB | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def number(value, scale=1.0, digits=1) -> str:
        return "-" if value is None else f"{value / scale:.{digits}f}"

    for r in records:
        base = baseline.get((r.trainer, r.seq_len))
        lines.append(
            f"| {r.trainer} | {r.setup} | {r.seq_len} | {number(r.peak_device_bytes, 2**30, 2)} "
            f"| {number(r.simulated_peak_bytes, 2**30, 2)} "
            f"| {_ratio(r.peak_device_bytes, base and base.peak_device_bytes)} "
            f"| {number(r.step_seconds, 1e-3)} | {number(r.generate_seconds, 1e-3)} "
            f"| {number(r.tokens_per_step, digits=0)} | {number(r.tokens_per_second, digits=0)} "
            f"| {_ratio(r.tokens_per_second, base and base.tokens_per_second)} "
            f"| {number(r.offloaded_bytes, 2**20)} | {r.status} |"
        )
    return "\n".join(lines)


@dataclass
class GenerationRecord:
    """One GRPO run of the generation stage: each phase's measured peak and time, and the
    simulator's figures for the same setup."""

    generator: str  # "transformers", "vllm" (colocated) or "vllm_sleep"
    completion: int
    status: str
    generate_peak_bytes: int | None = None  # PyTorch's allocated bytes over generation (transformers)
    generate_reserved_bytes: int | None = None  # and its caching allocator's reserved bytes
    generate_device_used_bytes: int | None = None  # the device's used memory after generation (vLLM's pools too)
    generate_seconds: float | None = None
    step_peak_bytes: int | None = None  # the rest of the training step: scoring and the policy step
    step_seconds: float | None = None
    simulated_generate_peak_bytes: int | None = None
    simulated_step_peak_bytes: int | None = None
    predicted_generate_seconds: tuple[float, float] | None = None


def _simulated_generation(generator: str, completion: int, options: Options, prompt: int):
    """What `hf-offload estimate --trainer grpo` gives for this run: generation's peak on this GPU,
    the step's peak and generation's time range (the setup hf_offload_tiled, AdamW, bf16)."""
    from hf_offload.tools import grpo_generation
    from hf_offload.tools.devices import DEVICES
    from hf_offload.tools.simulator import Simulator, Training, TrlStep
    from hf_offload.tools.simulator.trl import TrlGeneration

    config = preset_config(options.preset)
    config.update(dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS))
    config.update(dict(max_position_embeddings=options.max_positions))
    how = TrlGeneration(use_vllm=generator != "transformers", vllm_enable_sleep_mode=generator == "vllm_sleep")
    step = TrlStep("grpo", prompt_length=prompt, num_generations=options.generations,
                   generation_batch_size=options.generations, generation=how)  # fmt: skip
    name = torch.cuda.get_device_name(options.device) if options.device.type == "cuda" else ""
    device = next((DEVICES[key] for tag, key in (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-80gb"))
                   if tag in name), DEVICES["h200"])  # fmt: skip
    training = Training(dtype=torch.bfloat16, lora_rank=options.lora_rank or None, optimizer_states=2,
                        batch_size=options.generations, device=device, trl=step)  # fmt: skip
    mode = ("checkpointing+" if options.checkpointing else "") + "hf_offload+tiled"
    simulator = Simulator(config, training)
    simulated = simulator.generate(mode, rows=options.generations, prompt_length=prompt)
    share = None
    if how.colocated:
        profile = simulator.generate("none", rows=1, prompt_length=grpo_generation.VLLM_MAX_NUM_BATCHED_TOKENS)
        share = grpo_generation.vllm_share(simulator, device, how, profile.prefill.peak_bytes)
    plan = grpo_generation.GenerationPlan(how, options.generations, prompt, simulated, simulator.resident_bytes,
                                          device.workspace_bytes, share)  # fmt: skip
    step_result = simulator.run(mode, completion)
    cycle = grpo_generation.cycle_time(plan, completion, device, step_seconds=0.0, scoring_share=0.0,
                                       batch_size=options.generations, simulator=simulator)  # fmt: skip
    return plan.peak_bytes(completion), step_result.peak_bytes, (cycle.generation_low, cycle.generation_high)


def measure_generation(generator: str, completion: int, prompt: int, tokenizer, options: Options) -> GenerationRecord:
    """One GRPO run (hf_offload_tiled) generating with `generator`; the last step's phases."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer


    cuda = options.device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    model = trainer = None
    phases: dict[str, float | int | None] = {}
    try:
        model = build_model(options)
        model.enable_activation_offloading(**({} if cuda else dict(simulate_on_cpu=True, min_offload_bytes=0)))
        model.enable_sequence_tiling()
        peft_config = None
        if options.lora_rank:
            from peft import LoraConfig

            peft_config = LoraConfig(r=options.lora_rank, target_modules="all-linear", task_type="CAUSAL_LM")
        vllm = {}
        if generator != "transformers":
            vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=generator == "vllm_sleep",
                        vllm_max_model_length=prompt + completion)  # fmt: skip
        vocab = model.config.vocab_size
        with tempfile.TemporaryDirectory() as output_dir:
            config = GRPOConfig(
                output_dir=output_dir, max_steps=options.steps, learning_rate=1e-5, logging_steps=1,
                save_strategy="no", report_to=[], disable_tqdm=True, seed=0, use_cpu=not cuda,
                bf16=options.dtype == torch.bfloat16, per_device_train_batch_size=options.generations,
                num_generations=options.generations, max_completion_length=completion,
                generation_kwargs={"min_new_tokens": completion},
                **{checkpointing_field(GRPOConfig): options.checkpointing}, **vllm,
            )  # fmt: skip
            prompts = [words(prompt, vocab, seed) for seed in range(options.steps + 1)]
            trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=config,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                                  peft_config=peft_config)  # fmt: skip
            trainer.remove_callback(PrinterCallback)
            owner = trainer.model if generator == "transformers" else trainer.vllm_generation
            generate, training_step = owner.generate, trainer.training_step

            def measured_generate(*args, **kwargs):
                synchronize()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                output = generate(*args, **kwargs)
                synchronize()
                phases["generate_seconds"] = time.perf_counter() - start
                if cuda:
                    phases["generate_peak"] = torch.cuda.max_memory_allocated()
                    phases["generate_reserved"] = torch.cuda.max_memory_reserved()
                    free, total = torch.cuda.mem_get_info()
                    phases["generate_used"] = total - free
                    torch.cuda.reset_peak_memory_stats()  # from here: scoring and the policy step
                phases["after_generate"] = time.perf_counter()
                return output

            def measured_step(*args, **kwargs):
                synchronize()
                start = time.perf_counter()
                phases["after_generate"] = None
                loss = training_step(*args, **kwargs)
                synchronize()
                begun = phases["after_generate"] or start
                phases["step_seconds"] = time.perf_counter() - begun
                phases["step_peak"] = torch.cuda.max_memory_allocated() if cuda else None
                return loss

            owner.generate = measured_generate
            trainer.training_step = measured_step
            trainer.train()
        return GenerationRecord(
            generator, completion, "ok", generate_peak_bytes=phases.get("generate_peak"),
            generate_reserved_bytes=phases.get("generate_reserved"),
            generate_device_used_bytes=phases.get("generate_used"), generate_seconds=phases.get("generate_seconds"),
            step_peak_bytes=phases.get("step_peak"), step_seconds=phases.get("step_seconds"),
        )  # fmt: skip
    finally:
        del trainer, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def run_generation_stage(generators, completions, prompt: int, options: Options, report, simulate: bool):
    tokenizer = offline_tokenizer(PRESET_CONFIGS[PRESET_ALIASES.get(options.preset, options.preset)]["vocab_size"])
    records = []
    for generator in generators:
        reason = None
        if generator != "transformers":
            try:
                import vllm  # noqa: F401
            except ImportError as error:
                reason = f"skipped: vLLM does not import here ({type(error).__name__})"
        for completion in completions:
            if reason is not None:
                record = GenerationRecord(generator, completion, reason)
            else:
                try:
                    record = measure_generation(generator, completion, prompt, tokenizer, options)
                except Exception as error:  # recorded, never fatal to the run
                    oom = bench._is_oom(error)
                    record = GenerationRecord(generator, completion, "oom" if oom else
                                              f"failed: {type(error).__name__}: {str(error)[:160]}")  # fmt: skip
            if simulate and not record.status.startswith("skipped"):
                simulated = _simulated_generation(generator, completion, options, prompt)
                record.simulated_generate_peak_bytes, record.simulated_step_peak_bytes = simulated[:2]
                record.predicted_generate_seconds = simulated[2]
            records.append(record)
            report(record)
    return records


def generation_table(records: list[GenerationRecord]) -> str:
    def gib(value) -> str:
        return "-" if value is None else f"{value / 2**30:.2f}"

    def seconds(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        "| generator | completion | generate peak GiB | simulated | reserved GiB | device used GiB | generate s "
        "| predicted s | step peak GiB | simulated | step s | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        low_high = r.predicted_generate_seconds
        predicted = "-" if low_high is None else f"{low_high[0]:.1f}-{low_high[1]:.1f}"
        lines.append(
            f"| {r.generator} | {r.completion} | {gib(r.generate_peak_bytes)} "
            f"| {gib(r.simulated_generate_peak_bytes)} | {gib(r.generate_reserved_bytes)} "
            f"| {gib(r.generate_device_used_bytes)} | {seconds(r.generate_seconds)} | {predicted} "
            f"| {gib(r.step_peak_bytes)} | {gib(r.simulated_step_peak_bytes)} | {seconds(r.step_seconds)} "
            f"| {r.status} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run (default cuda)")
    parser.add_argument(
        "--stage", choices=("tiling", "generation"), default=None,
        help="tiling: hf_offload_tiled, SFT at 65536 and 131072 tokens, GRPO with 4096-token completions after a "
        "512-token prompt, 2 steps, --simulate (each unless given); generation: GRPO generating on the GPU at "
        "--completion-lengths (default 1024 4096) after a 512-token prompt, 4 generations, LoRA r=16, each phase's "
        "peak and time beside the simulator's",
    )  # fmt: skip
    parser.add_argument(
        "--generators", nargs="+", choices=GENERATORS, default=list(GENERATORS),
        help="--stage generation: transformers' generate, vLLM colocated, vLLM colocated with sleep mode",
    )  # fmt: skip
    parser.add_argument("--completion-lengths", type=int, nargs="+", help="--stage generation: completion tokens")
    parser.add_argument("--prompt-length", type=int, help="--stage generation: prompt tokens (default 512; cpu 8)")
    parser.add_argument(
        "--simulate", action="store_true",
        help="beside each measured peak, the simulator's for the same step (hf-offload estimate --trainer)",
    )  # fmt: skip
    parser.add_argument("--seq-lens", type=int, nargs="+", help="tokens per sequence (default 4096 16384; cpu 32 48)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run, the first one untimed (default 3; cpu 2)")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument(
        "--setups", nargs="+", choices=SETUPS, default=None,
        help="ratios need 'neither' (default: all but hf_offload_tiled; --stage tiling: hf_offload_tiled)",
    )  # fmt: skip
    parser.add_argument("--preset", choices=preset_names(), help="Llama shape (default 1b; cpu tiny)")
    parser.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off in all setups")
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (default 0: full)")
    parser.add_argument("--sft-batch-size", type=int, default=1)
    parser.add_argument("--generations", type=int, default=2, help="GRPO completions per prompt (default 2)")
    parser.add_argument("--completion-length", type=int, help="GRPO completion tokens (default 32; cpu 4)")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    defaults = dict(seq_lens=[32, 48], steps=2, preset="tiny", completion_length=4) if cpu else {}
    stage = {}
    if args.stage == "generation":
        args.simulate = True
        generation = dict(GENERATION_STAGE)
        if cpu:
            generation.update(completion_lengths=[6, 8], prompt_length=8, generations=2, lora_rank=4)
        for name in ("completion_lengths", "prompt_length"):
            if getattr(args, name) is None:
                setattr(args, name, generation[name])
        if args.lora_rank == 0:
            args.lora_rank = generation["lora_rank"]
        if args.generations == 2 and not cpu:
            args.generations = generation["generations"]
        stage = dict(steps=generation["steps"], trainers=["grpo"])
    if args.stage == "tiling":
        args.simulate = True
        stage = dict(setups=TILING_STAGE["setups"], steps=TILING_STAGE["steps"])
        if not cpu:
            stage.update(completion_length=TILING_STAGE["completion_length"])
    defaults = {**dict(seq_lens=[4096, 16384], steps=3, preset="1b", completion_length=32,
                       setups=[s for s in SETUPS if s != "hf_offload_tiled"]), **stage, **defaults}  # fmt: skip
    # The tiling stage's lengths per trainer: SFT's long sequences, GRPO's prompt + completion.
    args.lengths = None
    if args.stage == "tiling" and args.seq_lens is None and not cpu:
        grpo = TILING_STAGE["prompt_length"] + (args.completion_length or TILING_STAGE["completion_length"])
        args.lengths = {"sft": TILING_STAGE["sft_seq_lens"], "grpo": [grpo]}
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.stage == "generation":
        args.lengths = {"grpo": [args.prompt_length + n for n in args.completion_lengths]}
        args.trainers = ["grpo"]
    checks = [
        (args.steps >= 1, f"--steps must be at least 1, got {args.steps}"),
        (args.generations >= 2, f"--generations must be at least 2 (GRPO compares a group), got {args.generations}"),
        (args.completion_length >= 1, f"--completion-length must be at least 1, got {args.completion_length}"),
        (args.sft_batch_size >= 1, f"--sft-batch-size must be at least 1, got {args.sft_batch_size}"),
        (args.lora_rank >= 0, f"--lora-rank must be 0 (full fine-tuning) or more, got {args.lora_rank}"),
    ]
    if args.lengths is None:
        args.lengths = {trainer: args.seq_lens for trainer in args.trainers}
    if args.stage != "generation":
        args.completion_lengths, args.prompt_length = None, None
    too_short = [n for n in args.lengths.get("grpo", []) if n <= args.completion_length]
    checks.append(
        (
            not too_short or "grpo" not in args.trainers,
            f"--seq-lens {too_short} leave no prompt: each must exceed --completion-length {args.completion_length}",
        )
    )
    checks.append((all(n >= 2 for n in args.seq_lens), f"--seq-lens must be at least 2 tokens, got {args.seq_lens}"))
    for ok, message in checks:
        if not ok:
            parser.error(message)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures GPU memory and needs one (--device cpu runs a smoke test)")
        return 2
    try:
        import datasets
    except ImportError:
        print("datasets is not installed: TRL's trainers import it (pip install datasets)")
        return 2
    from accelerate import PartialState
    from transformers.utils import logging as transformers_logging

    from hf_offload.tools.benchmarks.gpu_check import package_versions

    # TRL's logging goes through accelerate's, which refuses to log before the state exists.
    PartialState(cpu=device.type == "cpu")
    options = Options(
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        preset=args.preset,
        steps=args.steps,
        checkpointing=not args.no_checkpointing,
        lora_rank=args.lora_rank,
        sft_batch_size=args.sft_batch_size,
        generations=args.generations,
        completion_length=args.completion_length,
        max_positions=max(n for lengths in args.lengths.values() for n in lengths),
    )
    import trl

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run: simulated copies)"
    cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
    tuning = f"LoRA r={args.lora_rank}" if args.lora_rank else "full fine-tuning"
    print(f"date: {datetime.date.today().isoformat()}")
    print(f"device: {where}, torch {torch.__version__}{cuda}")
    print(f"packages: {package_versions()}")
    print(
        f"model: {args.preset} Llama shape, random weights, {str(options.dtype).removeprefix('torch.')}, {tuning}, "
        f"gradient checkpointing {'on' if options.checkpointing else 'off'}; {args.steps} steps per run, "
        "the fastest after the first timed"
    )
    print(
        f"SFT: batch {args.sft_batch_size}; GRPO: {args.generations} completions of {args.completion_length} tokens "
        "per prompt, prompt = seq - completion, beta 0, step time includes generation"
    )
    if "grpo" in args.trainers and not has_trl_offloading_flag(trl.GRPOConfig):
        print(
            f"GRPO trl_offload: GRPOConfig in TRL {trl.__version__} has no activation_offloading; this script enters "
            "TRL's own context (get_act_offloading_ctx_manager) around each training_step, as SFTTrainer does"
        )
    if device.type == "cpu":
        print("CPU: no device memory to measure; timings include simulated copies and say nothing about a GPU")
    print(flush=True)

    def report(record: Record) -> None:
        tps = "" if record.tokens_per_second is None else f", {record.tokens_per_second:.0f} tokens/s"
        print(f"  {record.trainer:<5} {record.setup:<12} seq {record.seq_len:>6}: {record.status}{tps}", flush=True)

    def report_generation(record: GenerationRecord) -> None:
        taken = "" if record.generate_seconds is None else f", generate {record.generate_seconds:.1f} s"
        print(f"  grpo {record.generator:<12} completion {record.completion:>6}: {record.status}{taken}", flush=True)

    start = time.perf_counter()
    # Quiet while it runs (the trainers' advice and progress bars would bury the table), and
    # everything put back after, for a caller that runs main() in its own process.
    threads, verbosity = torch.get_num_threads(), transformers_logging.get_verbosity()
    bars = datasets.is_progress_bar_enabled()
    if device.type == "cpu":
        # A tiny model gains nothing from more threads, and on a busy machine their spin-waits
        # made each small matmul 100x slower.
        torch.set_num_threads(1)
    transformers_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            records = []
            if args.stage == "generation":
                records = run_generation_stage(args.generators, args.completion_lengths, args.prompt_length, options,
                                               report_generation, simulate=args.simulate)  # fmt: skip
            for trainer_name in args.trainers if args.stage != "generation" else ():
                records += run_all([trainer_name], args.setups, args.lengths[trainer_name], options, report,
                                   simulate=args.simulate)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
        transformers_logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    print(f"\n{len(records)} runs in {time.perf_counter() - start:.0f} s\n")
    if args.stage == "generation":
        print(generation_table(records))
        return 1 if any(r.generator == "transformers" and r.status.startswith("failed") for r in records) else 0
    print(markdown_table(records))
    leaked = [r for r in records if r.leftover_bytes and r.leftover_bytes > 256 * 2**20]
    for r in leaked:
        print(f"note: {r.trainer} {r.setup} {r.seq_len} began with {r.leftover_bytes / 2**30:.2f} GiB still allocated")
    # A failure of the runs that need nothing but TRL and hf_offload is the script's or ours.
    broken = [r for r in records if r.setup != "trl_offload" and r.status.startswith("failed")]
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
