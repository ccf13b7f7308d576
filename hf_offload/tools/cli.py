"""The `hf-offload` command. Each subcommand adds its parser in a `_add_*_command` function and
names the function that runs it with `set_defaults(run=...)`."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from hf_offload import __version__

# Parsing and the checks that need no model import nothing heavy (torch and transformers take
# 5-20 s): a bad argument fails at once. What needs torch (is a device available) comes next, and
# what needs transformers (a config's model_type) after it. tests/test_cli_arguments.py holds
# each command to that order.


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args, args.command_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-offload", description="Activation offloading for Hugging Face causal language models."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    _add_demo_command(commands)
    _add_estimate_command(commands)
    _add_bench_command(commands)
    return parser


def _add_demo_command(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="train a model with and without offloading and check that the losses are bit-identical",
        description=(
            "Train a model for a few steps without and then with activation offloading, from the same "
            "weights on the same random batches, and check that the losses are bit-identical. On a CPU the "
            "real engine runs in simulation and saves no memory; on CUDA the peak memory of both runs is shown. "
            "On an accelerator both runs use deterministic kernels (eager attention, "
            "torch.use_deterministic_algorithms(True, warn_only=True), CUBLAS_WORKSPACE_CONFIG=:4096:8), without "
            "which two runs differ even without offloading. Exits with 0 when both runs match, 1 when they "
            "differ on deterministic kernels, 3 when they differ but the kernels were not deterministic (an op "
            "without a deterministic implementation ran, or the --control runs differ): then the comparison "
            "cannot tell whether offloading did it."
        ),
    )
    demo.add_argument("--steps", type=_int_at_least(1, "steps"), default=3, help="training steps per run (default 3)")
    demo.add_argument(
        "--model",
        type=_local_model_dir,
        default=None,
        metavar="PATH",
        help="local model directory with a config.json (default: a tiny randomly initialised Llama)",
    )
    demo.add_argument(
        "--seq-len",
        # A causal LM predicts each token from the ones before it; one token leaves nothing to predict.
        type=_int_at_least(2, "seq-len"),
        default=256,
        help="tokens per sequence (default 256)",
    )
    demo.add_argument(
        "--batch-size", type=_int_at_least(1, "batch-size"), default=2, help="sequences per step (default 2)"
    )
    demo.add_argument(
        "--device", type=_device_name, default=None, help=f"torch device to train on (default {DEFAULT_DEVICE})"
    )
    demo.add_argument(
        "--seed", type=_int_at_least(0, "seed"), default=0, help="seed for the weights and batches (default 0)"
    )
    demo.add_argument(
        "--control",
        action="store_true",
        help="also train twice without offloading: those two runs must match, or the kernels do not repeat",
    )
    demo.set_defaults(run=_run_demo, command_parser=demo)


def _run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    args.device = _resolve_device(args.device, parser)

    from hf_offload import UnsupportedModelError
    from hf_offload.internal import resolve_layers

    from .demo import build_tiny_llama, load_local_model, run_demo
    from .determinism import DeterministicKernels

    # First, before anything touches CUDA: PyTorch reads CUBLAS_WORKSPACE_CONFIG at its first cuBLAS call.
    kernels = DeterministicKernels(args.device)
    if args.model is None:
        model = build_tiny_llama(args.seed)
    else:
        try:
            model = load_local_model(args.model)
        except (OSError, ValueError) as error:
            parser.error(f"argument --model: cannot load a causal LM from {str(args.model)!r}: {error}")
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(max_positions, int) and args.seq_len > max_positions:
        parser.error(f"argument --seq-len: {args.seq_len} is longer than this model's {max_positions} positions")
    try:
        # Offloading is enabled only for the second run; an unsupported model should fail before the first.
        resolve_layers(model)
    except UnsupportedModelError as error:
        parser.error(f"argument --model: {error}")
    return run_demo(
        model,
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        device=args.device,
        seed=args.seed,
        control=args.control,
        kernels=kernels,
    )


# `estimate --seq-len` when not given (a model with a shorter table of positions gets its length).
DEFAULT_ESTIMATE_SEQ_LEN = 8192
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}  # fmt: skip


def _add_estimate_command(commands: argparse._SubParsersAction) -> None:
    from .devices import DEVICES
    from .modes import ALL_MODES
    from .presets import preset_names

    estimate = commands.add_parser(
        "estimate",
        help="simulate a training step: device and host memory per mode, where the peak is, the longest sequence",
        description=(
            "Simulate one training step of the model on PyTorch's meta device (tensors with shapes and "
            "autograd but no memory or compute): the real transformers, PEFT, checkpointing, hf_offload "
            "engine and loss run, and the allocations are counted. For each mode: the peak of allocated "
            "device bytes and what holds it, hf_offload's host memory and the bytes it moves, the FLOPs "
            "and a step time from the device's rates. With --device-memory (or --device), the longest "
            "sequence that fits in each mode, by bisection. Only the model's config.json is read; no "
            "weights, no accelerator."
        ),
    )
    source = estimate.add_mutually_exclusive_group()
    source.add_argument(
        "--preset", choices=preset_names(), default="llama-3-8b", help="a common model shape (default llama-3-8b)"
    )
    source.add_argument(
        "--model", type=_model_source, metavar="PATH_OR_ID",
        help="a local model directory (or its config.json), or a hub id (only its config.json is read)",
    )  # fmt: skip
    estimate.add_argument(
        "--trust-remote-code", action="store_true", help="allow a config whose model code comes from the hub"
    )
    estimate.add_argument(
        "--seq-len", type=_int_at_least(2, "seq-len"), default=None,
        help=f"tokens per sequence (default {DEFAULT_ESTIMATE_SEQ_LEN}, or a model's table of positions where it has "
        "fewer: GPT-2's n_positions)",
    )  # fmt: skip
    estimate.add_argument(
        "--batch-size", type=_int_at_least(1, "batch-size"), default=1, help="sequences per step (default 1)"
    )
    estimate.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the weights' dtype (default bf16)")
    estimate.add_argument(
        "--autocast", choices=("bf16", "fp16"), default=None,
        help="mixed precision: forward and loss under autocast to this dtype (the Trainer's bf16=True on a float32 "
        "model: --dtype fp32 --autocast bf16)",
    )  # fmt: skip
    estimate.add_argument(
        "--padded", action="store_true",
        help="a padded batch: an attention mask with padding, as a collator makes (the kernels then take a "
        "sequence x sequence mask)",
    )  # fmt: skip
    estimate.add_argument(
        "--checkpointing", action="store_true", help="only the modes with gradient checkpointing (default: all four)"
    )
    estimate.add_argument(
        "--modes", nargs="+", choices=ALL_MODES, default=None, metavar="MODE",
        help="the modes to simulate, as the bench names them",
    )  # fmt: skip
    estimate.add_argument(
        "--liger", "--fused-loss", dest="liger", action="store_true",
        help="each mode also with Liger's fused linear cross-entropy (MODE+liger; a memory-equivalent stand-in runs)",
    )  # fmt: skip
    estimate.add_argument(
        "--tile", action="store_true",
        help="each mode also with sequence tiling: enable_sequence_tiling() with its defaults (MODE+tiled)",
    )  # fmt: skip
    estimate.add_argument(
        "--tile-tokens", type=_int_at_least(1, "tile-tokens"), default=None, metavar="N",
        help="the +tiled modes' tokens per slice (enable_sequence_tiling(tile_tokens=N); default: tiling's own)",
    )  # fmt: skip
    estimate.add_argument(
        "--tile-heads", type=_int_at_least(1, "tile-heads"), default=None, metavar="N",
        help="the +tiled modes' query heads per piece of attention (enable_sequence_tiling(tile_heads=N)); with "
        "--sp, per chunk of Ulysses's exchange: heads / sp is DeepSpeed's single exchange (default: tiling's own)",
    )  # fmt: skip
    estimate.add_argument(
        "--lora-rank", type=_int_at_least(1, "lora-rank"), default=None, help="LoRA adapters of this rank"
    )
    estimate.add_argument(
        "--lora-targets", default="all-linear", metavar="NAMES",
        help="the modules LoRA adapts: all-linear (default) or names separated by commas, e.g. q_proj,v_proj",
    )  # fmt: skip
    estimate.add_argument(
        "--lora-dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="adapter dtype (default fp32: PEFT casts adapters to fp32 unless autocast_adapter_dtype=False)",
    )
    _add_four_bit_arguments(estimate)
    _add_trl_arguments(estimate)
    estimate.add_argument("--keep-last-layers", type=_int_at_least(0, "keep-last-layers"), default=1)
    estimate.add_argument("--prefetch-layers", type=_int_at_least(0, "prefetch-layers"), default=1)
    estimate.add_argument(
        "--optimizer-states",
        type=int,
        choices=(0, 2),
        default=2,
        help="2: AdamW's step, with its two states per trainable parameter (default); 0: forward and backward only",
    )
    estimate.add_argument(
        "--device",
        choices=sorted(DEVICES),
        default=None,
        help="device preset for the rates and memory (default: the h200 rates; see --list-devices)",
    )
    estimate.add_argument("--list-devices", action="store_true", help="print the device presets and exit")
    estimate.add_argument(
        "--device-memory",
        type=_positive_float("device-memory"),
        default=None,
        metavar="GIB",
        help="device memory in GiB: find the longest sequence that fits in each mode (default: --device's)",
    )
    estimate.add_argument(
        "--host-memory",
        type=_positive_float("host-memory"),
        default=None,
        metavar="GIB",
        help="host RAM per GPU (per rank) in GiB: ZeRO-3's share of the weights and optimizer (--offload-params) "
        "comes out of it, hf_offload may use 80%% of the rest, and tensors over that stay on the device (default: "
        "with --device, the host memory per GPU of the machine that GPU comes in, --list-devices; without, unlimited)",
    )
    estimate.add_argument(
        "--unlimited-host", action="store_true",
        help="no limit on host memory (the output says how much the answer needs per node)",
    )  # fmt: skip
    estimate.add_argument(
        "--reserve", nargs="+", default=None, metavar="NAME=GIB",
        help="device memory the longest sequence leaves free, by item: reduce_bucket and prefetch (ZeRO-3), nccl "
        "(with --sp), allocator, extra (added); default: each item from DeepSpeed's, torch's and NCCL's defaults, "
        "shown in the output",
    )  # fmt: skip
    estimate.add_argument(
        "--disk-memory",
        type=_positive_float("disk-memory"),
        default=None,
        metavar="GIB",
        help="free disk space in GiB for hf_offload's disk tier (enable_activation_offloading(disk_dir=...) takes "
        "80%% of it): where each layer's inputs live, the host and disk they need, and whether the disk hides "
        "(needs --host-memory; default: no disk tier)",
    )
    estimate.add_argument(
        "--disk-gbps",
        type=_positive_float("disk-gbps"),
        default=None,
        metavar="N",
        help="the disk tier's GB/s each way (default 2: one NVMe drive's low end; needs --disk-memory)",
    )
    estimate.add_argument(
        "--max-device-gib",
        type=_positive_float("max-device-gib"),
        default=None,
        metavar="GIB",
        help="give hf_offload a device-memory budget (max_device_bytes = GIB x 2**30) and show what it keeps",
    )
    estimate.add_argument(
        "--granularity",
        type=_int_at_least(1, "granularity"),
        default=1024,
        metavar="N",
        help="the longest sequence's grid, with --device or --device-memory (default 1024)",
    )
    estimate.add_argument(
        "--link-gbps", type=_positive_float("link-gbps"), default=None, help="host link GB/s per direction"
    )
    estimate.add_argument(
        "--tflops", type=_positive_float("tflops"), default=None, help="sustained dense bf16 matmul TFLOP/s"
    )
    estimate.add_argument(
        "--efficiency",
        type=_positive_float("efficiency"),
        default=None,
        help="fraction of the matmul rate the step's matmuls reach (default 1.0, fitted on the H200)",
    )
    estimate.add_argument(
        "--sp", type=_int_at_least(1, "sp"), default=1, metavar="N",
        help="sequence parallelism over N ranks (DeepSpeed Ulysses): one rank's step, on seq / N tokens, attention "
        "over the whole sequence with heads / N (default 1: none)",
    )  # fmt: skip
    estimate.add_argument(
        "--offload-params", action="store_true",
        help="weights, gradients and optimizer state on the host, as DeepSpeed ZeRO-3 with offload_param and "
        "offload_optimizer to the CPU: on the device only the layers in use, gathered",
    )  # fmt: skip
    estimate.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    estimate.set_defaults(run=_run_estimate, command_parser=estimate)


def _add_four_bit_arguments(estimate: argparse.ArgumentParser) -> None:
    """QLoRA's 4-bit base, named as transformers' BitsAndBytesConfig and PEFT name its parts."""
    group = estimate.add_argument_group("4-bit base (QLoRA; the options are BitsAndBytesConfig's fields)")
    group.add_argument(
        "--load-in-4bit", action="store_true",
        help="the base loaded in 4 bits by bitsandbytes, as from_pretrained(..., quantization_config="
        "BitsAndBytesConfig(load_in_4bit=True, ...)) loads it (lm_head stays in --dtype); needs --lora-rank",
    )  # fmt: skip
    group.add_argument(
        "--bnb-4bit-quant-type", choices=("fp4", "nf4"), default=None,
        help="the 4-bit data type (default fp4, BitsAndBytesConfig's; QLoRA's recipe is nf4)",
    )  # fmt: skip
    group.add_argument(
        "--bnb-4bit-use-double-quant", action="store_true",
        help="quantize the quantization statistics too (0.516 instead of 0.5625 bytes per weight)",
    )  # fmt: skip
    group.add_argument(
        "--bnb-4bit-compute-dtype", choices=sorted(DTYPES), default=None,
        help="the dtype bitsandbytes dequantizes into and multiplies in (default fp32, BitsAndBytesConfig's; "
        "QLoRA's recipe is bf16)",
    )  # fmt: skip
    group.add_argument(
        "--prepare-model-for-kbit-training", action="store_true",
        help="PEFT's prepare_model_for_kbit_training before LoRA: every parameter that is not 4-bit (norms, "
        "embeddings, lm_head) in float32 (default: they keep --dtype, as Unsloth keeps them)",
    )  # fmt: skip


def _add_trl_arguments(estimate: argparse.ArgumentParser) -> None:
    """A TRL trainer's step; the options are the TRL configs' fields of the same names, with their
    defaults (GRPOConfig's, DPOConfig's)."""
    group = estimate.add_argument_group("TRL's trainers (TRL 1.16's step: its fused loss head, not the model's)")
    group.add_argument(
        "--trainer", choices=("sft", "dpo", "grpo"), default=None,
        help="simulate this TRL trainer's step: SFTTrainer's, DPOTrainer's (chosen and rejected rows, the reference "
        "pass under no_grad; for full fine-tuning the reference model TRL loads beside the policy) or GRPOTrainer's "
        "(generation on this GPU as TRL runs it, then the no-grad scoring and the policy steps). For dpo and grpo "
        "the length searched is the completion's",
    )  # fmt: skip
    group.add_argument(
        "--prompt-length", type=_int_at_least(1, "prompt-length"), default=None, metavar="N",
        help="dpo, grpo: prompt tokens before each completion (default 512)",
    )  # fmt: skip
    group.add_argument(
        "--completion-length", type=_int_at_least(2, "completion-length"), default=None, metavar="N",
        help="dpo, grpo: completion tokens (GRPOConfig.max_completion_length) where the step is shown (default: "
        "--seq-len's value)",
    )  # fmt: skip
    group.add_argument(
        "--ref-model", action="store_true",
        help="dpo: a reference model given to DPOTrainer(ref_model=...), which TRL keeps on the GPU (with LoRA too)",
    )  # fmt: skip
    group.add_argument(
        "--precompute-ref-log-probs", action="store_true",
        help="dpo: DPOConfig.precompute_ref_log_probs: the reference log-probs computed before training (no "
        "reference pass in the step, and without --ref-model no reference model kept)",
    )  # fmt: skip
    group.add_argument(
        "--sync-ref-model", action="store_true",
        help="dpo, grpo: sync_ref_model: the reference model synced to the policy (in place: no memory of its own; "
        "TRL refuses it with LoRA, with --precompute-ref-log-probs, and for grpo with beta 0)",
    )  # fmt: skip
    group.add_argument(
        "--num-generations", type=_int("num-generations"), default=None, metavar="G",
        help="grpo: completions per prompt (GRPOConfig.num_generations; default 8, at least 2)",
    )  # fmt: skip
    group.add_argument(
        "--generation-batch-size", type=_int_at_least(1, "generation-batch-size"), default=None, metavar="N",
        help="grpo: completions generated together on this GPU, then scored and stepped through --batch-size rows at "
        "a time (GRPOConfig.generation_batch_size; default: --batch-size x --steps-per-generation)",
    )  # fmt: skip
    group.add_argument(
        "--steps-per-generation", type=_int_at_least(1, "steps-per-generation"), default=None, metavar="S",
        help="grpo: policy steps per generation batch (GRPOConfig.steps_per_generation; TRL's default is "
        "gradient_accumulation_steps; here the fewest TRL accepts: --num-generations / gcd(--batch-size, "
        "--num-generations), 8 at batch 1 and 8 generations)",
    )  # fmt: skip
    group.add_argument(
        "--beta", type=_non_negative_float("beta"), default=None, metavar="B",
        help="grpo: the KL term's weight (GRPOConfig.beta; default 0, TRL's, which computes no reference "
        "log-probs; above 0 without LoRA TRL loads a reference model beside the policy)",
    )  # fmt: skip
    group.add_argument(
        "--old-log-probs", action=argparse.BooleanOptionalAction, default=None,
        help="grpo: whether the step computes the old policy's log-probs under no_grad (default: as TRL decides with "
        "its defaults: with --use-vllm, for its importance sampling correction; without, no: generation aligned "
        "with the optimizer's steps. --old-log-probs for misaligned steps or num_iterations > 1)",
    )  # fmt: skip
    group.add_argument(
        "--use-vllm", action="store_true",
        help="grpo: generate with vLLM (GRPOConfig.use_vllm; default: transformers' generate on the training model)",
    )  # fmt: skip
    group.add_argument(
        "--vllm-mode", choices=("colocate", "server"), default=None,
        help="grpo: vLLM on this GPU beside the trainer (colocate, TRL's default) or a server on other GPUs",
    )  # fmt: skip
    group.add_argument(
        "--vllm-gpu-memory-utilization", type=_positive_float("vllm-gpu-memory-utilization"), default=None,
        metavar="F", help="grpo, colocate: the share of the GPU's memory vLLM takes (default 0.3, TRL's)",
    )  # fmt: skip
    group.add_argument(
        "--vllm-enable-sleep-mode", action="store_true",
        help="grpo, colocate: vLLM sleeps (level 2: weights and KV cache freed) while the step runs",
    )  # fmt: skip
    group.add_argument(
        "--vllm-max-model-length", type=_int_at_least(1, "vllm-max-model-length"), default=None, metavar="N",
        help="grpo: vLLM's context, prompt and completion (GRPOConfig.vllm_max_model_length, TRL passes it as "
        "LLM(max_model_len=N); default: vLLM derives it from the model's positions and refuses a longer one)",
    )  # fmt: skip
    group.add_argument(
        "--vllm-version", type=_vllm_version, default=None, metavar="X.Y[.Z]",
        help="grpo: the vLLM release assumed, within TRL 1.16's range (0.22.0-0.31.0; default the newest). A 4-bit "
        "policy with colocated vLLM needs a release whose loader takes quantization=\"bitsandbytes\"",
    )  # fmt: skip
    group.add_argument(
        "--rope-scaling", type=_rope_scaling, default=None, metavar="TYPE:FACTOR[:ORIGINAL]",
        help="scale the model's RoPE positions as its config.json's rope_scaling would (yarn, linear or dynamic; "
        "e.g. yarn:4:32768, as Qwen documents for Qwen3: 131,072 positions; ORIGINAL defaults to the config's "
        "max_position_embeddings). GRPO's generation stops at the model's positions",
    )  # fmt: skip


def _trl_step(args: argparse.Namespace):
    from .simulator import TrlStep
    from .simulator.trl import TrlGeneration, default_steps_per_generation

    if args.trainer is None:
        return None
    generations = 8 if args.num_generations is None else args.num_generations
    rows = None
    if args.trainer == "grpo":
        rows = args.generation_batch_size
        if rows is None:
            steps = args.steps_per_generation or default_steps_per_generation(args.batch_size, generations)
            rows = args.batch_size * steps
    utilization = args.vllm_gpu_memory_utilization
    how = TrlGeneration(
        use_vllm=args.use_vllm,
        vllm_mode=args.vllm_mode or "colocate",
        vllm_gpu_memory_utilization=0.3 if utilization is None else utilization,
        vllm_enable_sleep_mode=args.vllm_enable_sleep_mode,
        vllm_max_model_length=args.vllm_max_model_length,
        vllm_version=args.vllm_version,
    )
    return TrlStep(
        args.trainer,
        prompt_length=512 if args.prompt_length is None else args.prompt_length,
        num_generations=generations,
        generation_batch_size=rows,
        grpo_beta=0.0 if args.beta is None else args.beta,
        old_log_probs=args.old_log_probs,
        precompute_ref_log_probs=args.precompute_ref_log_probs,
        ref_model=args.ref_model,
        sync_ref_model=args.sync_ref_model,
        generation=how,
    )


def _check_trl_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser, modes: list[str]) -> None:
    from .modes import parse_mode

    trainer = args.trainer
    for option, value, trainers in (
        ("--prompt-length", args.prompt_length, ("dpo", "grpo")),
        ("--completion-length", args.completion_length, ("dpo", "grpo")),
        ("--ref-model", args.ref_model or None, ("dpo",)),
        ("--precompute-ref-log-probs", args.precompute_ref_log_probs or None, ("dpo",)),
        ("--sync-ref-model", args.sync_ref_model or None, ("dpo", "grpo")),
        ("--num-generations", args.num_generations, ("grpo",)),
        ("--generation-batch-size", args.generation_batch_size, ("grpo",)),
        ("--steps-per-generation", args.steps_per_generation, ("grpo",)),
        ("--beta", args.beta, ("grpo",)),
        ("--old-log-probs", None if args.old_log_probs is None else True, ("grpo",)),
        ("--use-vllm", args.use_vllm or None, ("grpo",)),
    ):
        if value is not None and trainer not in trainers:
            given = "no --trainer" if trainer is None else f"--trainer {trainer}"
            shown = "" if value is True else f" {value:g}"
            parser.error(f"argument {option}:{shown} is for --trainer {' or '.join(trainers)}, not {given}")
    vllm_options = (
        ("--vllm-mode", args.vllm_mode),
        ("--vllm-gpu-memory-utilization", args.vllm_gpu_memory_utilization),
        ("--vllm-enable-sleep-mode", args.vllm_enable_sleep_mode or None),
        ("--vllm-max-model-length", args.vllm_max_model_length),
        ("--vllm-version", args.vllm_version),
    )
    for option, value in vllm_options:
        if value is not None and not args.use_vllm:
            parser.error(f"argument {option}: configures vLLM: give --use-vllm too (TRL ignores it without use_vllm)")
        if value is not None and option not in ("--vllm-mode", "--vllm-version", "--vllm-max-model-length") \
                and args.vllm_mode == "server":
            parser.error(f"argument {option}: is for --vllm-mode colocate (the server sizes its own GPUs)")
    if args.vllm_gpu_memory_utilization is not None and args.vllm_gpu_memory_utilization > 1:
        parser.error(
            f"argument --vllm-gpu-memory-utilization: a fraction of the GPU's memory in (0, 1], got "
            f"{args.vllm_gpu_memory_utilization:g}"
        )
    if args.use_vllm and args.load_in_4bit and (args.vllm_mode or "colocate") == "colocate":
        from .generation_limits import DEFAULT_VLLM_VERSION, refuse_four_bit_vllm

        try:
            refuse_four_bit_vllm(args.vllm_version or DEFAULT_VLLM_VERSION)
        except ValueError as error:
            parser.error(f"argument --use-vllm: {error}")
    if trainer is None:
        return
    if args.liger or any(parse_mode(mode).liger for mode in modes):
        parser.error(
            f"argument --trainer: {trainer}: TRL's trainers refuse Liger's fused cross-entropy (they run their own "
            "fused head); drop --liger and the +liger modes"
        )
    for option, on in (("--sp", args.sp > 1), ("--padded", args.padded), ("--offload-params", args.offload_params)):
        if on:
            parser.error(f"argument --trainer: {trainer} with {option} is not simulated (drop {option})")
    if args.sync_ref_model and args.lora_rank is not None:
        name = "DPOTrainer" if trainer == "dpo" else "GRPOTrainer"
        parser.error(f"argument --sync-ref-model: with LoRA {name} keeps no reference model to sync (TRL refuses it)")
    if trainer == "dpo" and args.sync_ref_model and args.precompute_ref_log_probs:
        parser.error("argument --sync-ref-model: not with --precompute-ref-log-probs (TRL refuses it: the "
                     "precomputed reference log-probs would go stale)")  # fmt: skip
    if trainer != "grpo":
        return
    # TRL's own words for GRPO's batch arithmetic; the module imports torch, so only here.
    from .simulator.trl import (
        BOTH_GENERATION_SIZES,
        default_steps_per_generation,
        not_divisible_by_batch,
        not_divisible_by_generations,
        too_few_generations,
    )

    generations = 8 if args.num_generations is None else args.num_generations
    if generations < 2:
        parser.error(f"argument --num-generations: {too_few_generations(generations)}")
    if args.sync_ref_model and not args.beta:
        parser.error("argument --sync-ref-model: with beta 0 (TRL's default) GRPOTrainer keeps no reference model "
                     "to sync (TRL refuses it): give --beta above 0")  # fmt: skip
    if args.generation_batch_size is not None and args.steps_per_generation is not None:
        parser.error(f"argument --steps-per-generation: {BOTH_GENERATION_SIZES}")
    rows = args.generation_batch_size
    if rows is None:
        rows = args.batch_size * (args.steps_per_generation or default_steps_per_generation(args.batch_size,
                                                                                            generations))  # fmt: skip
    option = "--generation-batch-size" if args.generation_batch_size is not None else "--steps-per-generation"
    if rows % args.batch_size:
        parser.error(f"argument {option}: {not_divisible_by_batch(rows, args.batch_size)}")
    if rows % generations:
        parser.error(f"argument {option}: {not_divisible_by_generations(rows, generations)}")


def _check_four_bit_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """An option of a 4-bit base without --load-in-4bit, or a 4-bit base without what it needs."""
    given = {
        "--bnb-4bit-quant-type": args.bnb_4bit_quant_type is not None,
        "--bnb-4bit-use-double-quant": args.bnb_4bit_use_double_quant,
        "--bnb-4bit-compute-dtype": args.bnb_4bit_compute_dtype is not None,
        "--prepare-model-for-kbit-training": args.prepare_model_for_kbit_training,
    }
    if not args.load_in_4bit:
        option = next((name for name, present in given.items() if present), None)
        if option is not None:
            parser.error(f"argument {option}: describes a 4-bit base: give --load-in-4bit too")
        return
    if args.lora_rank is None:
        parser.error("argument --load-in-4bit: a 4-bit base is trained through adapters: give --lora-rank")
    if args.offload_params:
        parser.error("argument --load-in-4bit: a 4-bit base with --offload-params is not simulated")


def _four_bit(args: argparse.Namespace):
    """The 4-bit base the options ask for (checked by _check_four_bit_arguments), or None."""
    import torch

    from .simulator.four_bit import FourBit

    if not args.load_in_4bit:
        return None
    compute = DTYPES[args.bnb_4bit_compute_dtype] if args.bnb_4bit_compute_dtype else "float32"
    return FourBit(
        bnb_4bit_quant_type=args.bnb_4bit_quant_type or "fp4",
        bnb_4bit_use_double_quant=args.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=getattr(torch, compute),
        prepare_model_for_kbit_training=args.prepare_model_for_kbit_training,
    )


def _estimate_modes(args: argparse.Namespace) -> list[str]:
    from .modes import ESTIMATE_CHECKPOINTING_MODES, ESTIMATE_MODES, LIGER, LONGEST_CONTEXT_MODE, TILED, parse_mode

    if args.modes is not None:
        modes = list(args.modes)
    else:
        modes = list(ESTIMATE_CHECKPOINTING_MODES if args.checkpointing else ESTIMATE_MODES)
        if (args.device is not None or args.device_memory is not None) and not args.tile:
            modes.append(LONGEST_CONTEXT_MODE)  # how long can I train: the answer includes the recipe's mode
    if args.liger:
        modes += [mode + LIGER for mode in modes if not parse_mode(mode).liger]
    if args.tile:
        modes += [mode + TILED for mode in modes if not parse_mode(mode).tiled]
    return list(dict.fromkeys(modes))


def _check_estimate_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Every check of `estimate`'s arguments that needs no model: in one place, before the
    model's config is read (a hub id goes to the network) and anything simulated, so that a bad
    combination fails at once, naming the option and what would be valid. Checks of a single
    value are its argparse type (`--model`: `_model_source`). Options added later put their
    checks here. Returns the modes to simulate."""
    from .modes import NEEDS_ACCELERATOR, TILED, parse_mode

    if args.efficiency is not None and args.efficiency > 1:
        parser.error(f"argument --efficiency: must be a fraction in (0, 1], got {args.efficiency}")
    if args.unlimited_host and args.host_memory is not None:
        parser.error(f"argument --unlimited-host: not with --host-memory {args.host_memory:g} (choose one)")
    if args.disk_memory is not None and (args.unlimited_host or (args.host_memory is None and args.device is None)):
        parser.error(
            f"argument --disk-memory: {args.disk_memory:g} GiB of disk needs --host-memory GIB or --device's machine "
            "(with unlimited host memory nothing goes to disk)"
        )
    _check_reserve_arguments(args, parser)
    if args.disk_gbps is not None and args.disk_memory is None:
        parser.error(f"argument --disk-gbps: {args.disk_gbps:g} GB/s needs --disk-memory GIB (no disk tier without it)")
    if args.sp > 1 and args.padded:
        parser.error("argument --sp: a padded batch under sequence parallelism is not simulated (drop --padded)")
    _check_four_bit_arguments(args, parser)
    if args.trust_remote_code and args.model is None:
        parser.error("argument --trust-remote-code: only with --model (the presets run transformers' own code)")
    if args.lora_targets != "all-linear":
        if args.lora_rank is None:
            parser.error(f"argument --lora-targets: {args.lora_targets!r} needs --lora-rank N (no adapters without it)")
        if not all(name.strip() for name in args.lora_targets.split(",")):
            parser.error(
                f"argument --lora-targets: {args.lora_targets!r} has an empty name; give all-linear or module names "
                "separated by commas, e.g. q_proj,v_proj"
            )
    if args.granularity != 1024 and args.device is None and args.device_memory is None:
        parser.error(
            f"argument --granularity: {args.granularity} is the longest sequence's grid, searched only with --device "
            "or --device-memory"
        )
    modes = _estimate_modes(args)
    _check_trl_arguments(args, parser, modes)
    if args.tile_tokens is not None and not any(parse_mode(mode).tiled for mode in modes):
        parser.error(f"argument --tile-tokens: {args.tile_tokens} tokens per slice needs --tile or a {TILED} mode")
    if args.tile_heads is not None and not any(parse_mode(mode).tiled for mode in modes):
        parser.error(f"argument --tile-heads: {args.tile_heads} query heads per piece needs --tile or a {TILED} mode")
    for mode in modes:
        base = parse_mode(mode).base
        if base in NEEDS_ACCELERATOR:
            parser.error(f"argument --modes: {mode} cannot be simulated ({NEEDS_ACCELERATOR[base]})")
        if base.endswith("_auto") and args.device_memory is None and args.device is None:
            parser.error(f"argument --modes: {mode} reads the device's free memory: give --device-memory or --device")
    return modes


def _check_reserve_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`--reserve NAME=GIB ...`: known names, numbers, and only items the run has."""
    if args.reserve is None:
        return
    from .reserve import parse_reserve

    try:
        args.reserve_bytes = parse_reserve(args.reserve)
    except ValueError as error:
        parser.error(f"argument --reserve: {error}")
    if args.device is None and args.device_memory is None:
        parser.error("argument --reserve: the reserve is what the longest sequence leaves free: give --device or "
                     "--device-memory")  # fmt: skip
    needs = {"reduce_bucket": (args.offload_params, "--offload-params (ZeRO-3)"),
             "prefetch": (args.offload_params, "--offload-params (ZeRO-3)"),
             "nccl": (args.sp > 1, "more than one rank (--sp N)")}  # fmt: skip
    for name in args.reserve_bytes:
        present, what = needs.get(name, (True, ""))
        if not present:
            parser.error(f"argument --reserve: this run has no {name} (it comes only with {what})")


def _run_estimate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .devices import format_devices

    if args.list_devices:
        print(format_devices())
        return 0
    modes = _check_estimate_arguments(args, parser)

    import logging
    import sys
    import warnings

    import torch

    from .devices import DEVICES
    from .estimate import Request, format_estimate, format_json, run_estimate
    from .presets import ConfigError, load_config, preset_config
    from .simulator import Training

    if args.liger or any("+liger" in mode for mode in modes):
        try:
            import liger_kernel.transformers  # noqa: F401
        except ImportError as error:
            parser.error(f"argument --liger: needs liger-kernel (pip install 'hf-offload[liger]'): {error}")
    try:
        config = load_config(args.model, trust_remote_code=args.trust_remote_code) if args.model else None
    except ConfigError as error:
        parser.error(f"argument --model: {error}")
    if config is None:
        config, name = preset_config(args.preset), f"{args.preset} preset"
    else:
        name = str(args.model)
    if args.rope_scaling is not None:
        from .generation_limits import with_rope_scaling

        try:
            config = with_rope_scaling(config, args.rope_scaling)
        except ValueError as error:
            parser.error(f"argument {error}")
    device = DEVICES[args.device or "h200"]
    memory_gib = args.device_memory or (device.memory_gib if args.device else None)
    memory = None if memory_gib is None else int(memory_gib * 2**30)
    targets = args.lora_targets if args.lora_targets == "all-linear" else tuple(args.lora_targets.split(","))
    # The host: given, the named device's machine's per GPU, or unlimited (asked for, or no machine named).
    host_gib, host_from = args.host_memory, "given" if args.host_memory is not None else None
    if host_gib is None and args.device is not None and not args.unlimited_host:
        host_gib, host_from = device.host_memory_gib, "device"
    training = Training(
        dtype=getattr(torch, DTYPES[args.dtype]),
        lora_rank=args.lora_rank,
        lora_targets=targets,
        lora_dtype=getattr(torch, DTYPES[args.lora_dtype]),
        optimizer_states=args.optimizer_states,
        batch_size=args.batch_size,
        keep_last_layers=args.keep_last_layers,
        prefetch_layers=args.prefetch_layers,
        host_memory_bytes=None if host_gib is None else int(host_gib * 2**30),
        disk_memory_bytes=None if args.disk_memory is None else int(args.disk_memory * 2**30),
        device=device,
        device_memory_bytes=memory,
        device_budget_bytes=None if args.max_device_gib is None else int(args.max_device_gib * 2**30),
        tile_tokens=args.tile_tokens,
        tiling=None if args.tile_heads is None else {"tile_heads": args.tile_heads},
        autocast=None if args.autocast is None else getattr(torch, DTYPES[args.autocast]),
        padded=args.padded,
        sp_size=args.sp,
        offload_params=args.offload_params,
        four_bit=_four_bit(args),
        trl=_trl_step(args),
    )
    given = args.completion_length if args.completion_length is not None else args.seq_len
    seq_len = DEFAULT_ESTIMATE_SEQ_LEN if given is None else given
    request = Request(
        config=config,
        name=name,
        training=training,
        modes=modes,
        seq_len=seq_len,
        seq_len_given=given is not None,
        memory_bytes=memory,
        granularity=args.granularity,
        tflops=args.tflops,
        link_gbps=args.link_gbps,
        efficiency=args.efficiency,
        disk_gbps=args.disk_gbps,
        reserve=getattr(args, "reserve_bytes", None),
        host_from=host_from,
    )
    # transformers and the engine speak up about what the simulation does on purpose (checkpointing
    # turns the cache off, the CPU has no accelerator); the estimate reports what matters.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("hf_offload").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    from hf_offload.internal import UpstreamChanged

    try:
        estimate = run_estimate(request, echo=progress)
    except UpstreamChanged as error:  # another library's release moved what the simulator stands in for
        _failed(parser, f"cannot simulate {name}: {error}")
    except (ValueError, TypeError, KeyError) as error:
        parser.error(f"cannot simulate {name}: {error}")
    except RuntimeError as error:  # the model's own code refused the step (a shape it cannot take, say)
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        failed = f"{type(error).__name__}: {first}"
        _failed(parser, f"cannot simulate {name} at {seq_len} tokens: the model failed: {failed}")
    print(format_json(estimate) if args.json else format_estimate(estimate, device_given=args.device is not None))
    return 0


def _failed(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """A failure that is not the arguments': said without the usage text (argparse's `error` prints
    it, as if the arguments were wrong), exit status 1."""
    import sys

    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    raise SystemExit(1)


def _add_bench_command(commands: argparse._SubParsersAction) -> None:
    from .modes import ALL_MODES, MODES
    from .presets import preset_names

    bench = commands.add_parser(
        "bench",
        help="sweep sequence lengths under each memory-saving mode, or find each mode's longest sequence",
        description=(
            "Measure peak memory (on CUDA; byte accounting on the CPU), step time and tokens/s over sequence "
            "lengths for: no offloading, hf_offload, checkpointing, checkpointing + hf_offload, transformers' "
            "offload=True and TRL's offloading (when trl is installed); each also with Liger's fused linear "
            "cross-entropy (MODE+liger, or --liger for all). A mode stops at its first out-of-memory. With "
            "--find-max-seq, find each mode's longest sequence at batch 1 instead: by search (double, then bisect "
            "to --granularity) or, much faster for large models, predicted from the peaks at two short lengths "
            "(--method slope)."
        ),
    )
    bench.add_argument(
        "--preset",
        choices=preset_names(),
        default=None,
        help="a built-in shape (default tiny on CPU, 1b on CUDA)",
    )
    bench.add_argument(
        "--model", type=_local_model_dir, metavar="PATH",
        help="a local model directory: its weights if it has any, else its config.json with random weights",
    )  # fmt: skip
    bench.add_argument(
        "--seq-lens",
        type=_int_at_least(2, "seq-lens"),
        nargs="+",
        default=None,
        help="sweep lengths (default 256 512 1024 2048)",
    )
    bench.add_argument(
        "--batch-size", type=_int_at_least(1, "batch-size"), default=1, help="sequences per step (default 1)"
    )
    bench.add_argument(
        "--steps",
        type=_int_at_least(1, "steps"),
        default=None,
        help="timed steps after a warm-up (default 3; 1 with --find-max-seq)",
    )
    bench.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(MODES), metavar="MODE",
                       help=f"default: all without Liger; choices: {', '.join(ALL_MODES)}")  # fmt: skip
    bench.add_argument(
        "--liger",
        action="store_true",
        help="run each mode also with Liger's fused linear cross-entropy, as MODE+liger (needs liger-kernel and CUDA)",
    )
    bench.add_argument(
        "--tile", action="store_true", help="run each mode also with hf_offload's sequence tiling, as MODE+tiled"
    )
    bench.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="bf16 on CUDA, fp32 on CPU")
    bench.add_argument("--lora-rank", type=_int_at_least(1, "lora-rank"), default=None, help="LoRA on all linears")
    bench.add_argument(
        "--device",
        type=_device_name,
        default=None,
        help=f"torch device to measure on: cpu, cuda or cuda:N (default {DEFAULT_DEVICE})",
    )
    bench.add_argument(
        "--min-offload-bytes", type=_int_at_least(0, "min-offload-bytes"), default=None, help="hf_offload's option"
    )
    bench.add_argument(
        "--memory-limit",
        type=_positive_float("memory-limit"),
        default=None,
        metavar="GiB",
        help=(
            "on CUDA: cap this process's allocator at this many GiB (as on a smaller GPU); on the CPU: count a step "
            "whose resident activation bytes (byte accounting) exceed it as out of memory"
        ),
    )
    search = bench.add_argument_group("--find-max-seq")
    search.add_argument(
        "--find-max-seq", action="store_true", help="find each mode's longest sequence (batch 1) instead of a sweep"
    )
    search.add_argument(
        "--method",
        choices=["search", "slope"],
        default=None,
        help="search: measure (default); slope: predict from two lengths, see --slope-lens and --verify",
    )
    search.add_argument(
        "--start", type=_int_at_least(2, "start"), default=None, help="first length searched (4096 on CUDA, 256 on CPU)"
    )
    search.add_argument(
        "--granularity",
        type=_int_at_least(1, "granularity"),
        default=None,
        help="the answer is exact to this many tokens (default 1024)",
    )
    search.add_argument(
        "--seq-limit",
        type=_int_at_least(2, "seq-limit"),
        default=None,
        help="longest length searched (default 1048576 on CUDA, 16384 on CPU)",
    )
    search.add_argument(
        "--slope-lens",
        type=_int_at_least(2, "slope-lens"),
        nargs=2,
        default=None,
        metavar=("A", "B"),
        help="slope: the two lengths measured (default 4096 8192 on CUDA, 1024 2048 on CPU)",
    )
    search.add_argument(
        "--verify", action="store_true", help="slope: run one step at the predicted length and say whether it fit"
    )
    bench.add_argument(
        "--simulate", action=argparse.BooleanOptionalAction, default=None,
        help="also simulate each step (hf-offload estimate) and show its peak beside the measured one (default: CUDA)",
    )  # fmt: skip
    bench.add_argument("--out", default="bench_out", help="directory for the JSON, markdown and plot")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(run=_run_bench, command_parser=bench)


def _run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .modes import LIGER, TILED, parse_mode

    search_options = ("method", "start", "granularity", "seq_limit", "slope_lens")
    if not args.find_max_seq:
        given = [name for name in search_options if getattr(args, name) is not None] + (
            ["verify"] if args.verify else []
        )
        if given:
            parser.error(f"argument --{given[0].replace('_', '-')}: only with --find-max-seq")
    else:
        if args.seq_lens is not None:
            parser.error(
                "argument --seq-lens: not with --find-max-seq, which chooses its lengths (see --start, --slope-lens)"
            )
        if args.batch_size != 1:
            parser.error(f"argument --batch-size: --find-max-seq measures batch 1, got {args.batch_size}")
        args.method = args.method or "search"
        if args.method == "search" and args.verify:
            parser.error("argument --verify: only with --method slope (the search measures every length it reports)")
        if args.method == "slope" and args.slope_lens is not None and not args.slope_lens[0] < args.slope_lens[1]:
            a, b = args.slope_lens
            parser.error(f"argument --slope-lens: the second length must be longer than the first, got {a} {b}")

    # The defaults and checks that depend on the device, then the model's config (transformers).
    args.device = _resolve_device(args.device, parser)
    cuda = args.device.type == "cuda"
    if args.find_max_seq:
        args.start = args.start or (4096 if cuda else 256)
        args.seq_limit = args.seq_limit or (1 << 20 if cuda else 16384)
        args.slope_lens = args.slope_lens or ([4096, 8192] if cuda else [1024, 2048])
        if args.method == "search" and args.seq_limit < args.start:
            parser.error(f"argument --seq-limit: {args.seq_limit} is below --start {args.start}")
        if args.method == "slope" and not cuda and args.memory_limit is None:
            parser.error(
                "argument --method: the slope method on the CPU needs --memory-limit (there is no device memory "
                "to predict against)"
            )
    if cuda and args.memory_limit is not None:
        import torch

        total = torch.cuda.get_device_properties(args.device).total_memory / 2**30
        if args.memory_limit > total:
            parser.error(f"argument --memory-limit: {args.memory_limit} GiB is more than this device's {total:.2f} GiB")
    if args.model is not None:
        from .presets import ConfigError, load_config

        try:  # a model the bench can build and train as a causal LM, before anything runs
            load_config(args.model)
        except ConfigError as error:
            parser.error(f"argument --model: {error}")

    from .bench import run_bench

    if args.dtype is None:
        args.dtype = "bf16" if cuda else "fp32"
    if args.liger:
        args.modes = [*args.modes, *(mode + LIGER for mode in args.modes if not parse_mode(mode).liger)]
    if args.tile:
        args.modes = [*args.modes, *(mode + TILED for mode in args.modes if not parse_mode(mode).tiled)]
    args.modes = list(dict.fromkeys(args.modes))
    if args.find_max_seq:
        args.steps = args.steps or 1
        args.granularity = args.granularity or 1024
    else:
        args.seq_lens = args.seq_lens or [256, 512, 1024, 2048]
        args.steps = args.steps or 3
    return run_bench(args)


def _vllm_version(text: str) -> str:
    from .generation_limits import check_vllm_version

    try:
        return check_vllm_version(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _rope_scaling(text: str) -> dict:
    from .generation_limits import parse_rope_scaling

    try:
        return parse_rope_scaling(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_float(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {value}")
        return value

    parse.__name__ = name
    return parse


def _non_negative_float(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number >= 0, got {text!r}") from None
        if not value >= 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number >= 0, got {text!r}")
        return value

    parse.__name__ = name
    return parse


def _int(name: str) -> Callable[[str], int]:
    """Any integer: the bounds are checked later, in the words of the config that sets them."""

    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None

    parse.__name__ = name
    return parse


def _int_at_least(minimum: int, name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value

    parse.__name__ = name  # argparse names the type in some of its own messages
    return parse


def _model_source(text: str) -> str:
    """`estimate --model`: what can be checked without importing anything (presets.check_model_argument)."""
    from .presets import ConfigError, check_model_argument

    try:
        return check_model_argument(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _local_model_dir(text: str) -> Path:
    from .presets import ConfigError, read_config_file

    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a local directory (models are never downloaded)")
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} has no config.json")
    try:
        read_config_file(path / "config.json")
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return path


DEFAULT_DEVICE = "cuda when available, else cpu"


def _device_name(text: str) -> str:
    """`--device` as far as it can be checked without torch: a device type and an optional index."""
    if not re.fullmatch(r"[a-z_]+(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; use cpu, cuda or cuda:N")
    return text


def _resolve_device(text: str | None, parser: argparse.ArgumentParser):
    """`--device` (None: DEFAULT_DEVICE) as a torch device available here: the checks that need
    torch, after those that do not."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        parser.error(f"argument --device: {text!r} is not a torch device; use cpu, cuda or cuda:N")
    if device.type == "cpu":
        return device
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != device.type:
        available = "cpu" if accelerator is None else f"cpu, {accelerator.type}"
        parser.error(f"argument --device: device {text!r} is not available here; available: {available}")
    if device.index is not None and device.index >= torch.accelerator.device_count():
        parser.error(
            f"argument --device: device {text!r} does not exist; there are {torch.accelerator.device_count()} "
            f"{device.type} device(s)"
        )
    return device


if __name__ == "__main__":
    raise SystemExit(main())
