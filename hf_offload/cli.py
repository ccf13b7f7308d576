"""The `hf-offload` command. Each subcommand adds its parser in a `_add_*_command` function and
names the function that runs it with `set_defaults(run=...)`."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import __version__
from .adapters import UnsupportedModelError, resolve_layers
from .demo import build_tiny_llama, load_local_model, run_demo


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
        "--device",
        type=_available_device,
        default=_default_device(),
        help=f"torch device to train on (default {_default_device()})",
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


def _add_estimate_command(commands: argparse._SubParsersAction) -> None:
    from .estimate import DTYPE_BYTES, PRESETS

    estimate = commands.add_parser(
        "estimate",
        help="predict activation memory, what offloading saves, and whether its copies hide behind compute",
        description=(
            "Predict the activation bytes a decoder-only model saves per layer and in total, the device memory "
            "offloading saves, the host memory it needs, and whether one layer's copies fit in one layer's "
            "compute. Nothing is run or downloaded."
        ),
    )
    source = estimate.add_mutually_exclusive_group()
    source.add_argument(
        "--preset", choices=sorted(PRESETS), default="llama-3-8b", help="a common model shape (default llama-3-8b)"
    )
    source.add_argument(
        "--model", type=_local_model_dir, metavar="PATH", help="local model directory with a config.json"
    )
    estimate.add_argument("--seq-len", type=_int_at_least(1, "seq-len"), default=8192, help="default 8192")
    estimate.add_argument("--batch-size", type=_int_at_least(1, "batch-size"), default=1, help="default 1")
    estimate.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="default bf16")
    estimate.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on")
    estimate.add_argument(
        "--lora-rank", type=_int_at_least(1, "lora-rank"), default=None, help="LoRA on every linear layer"
    )
    estimate.add_argument(
        "--lora-dtype", choices=sorted(DTYPE_BYTES), default=None, help="adapter dtype (default: --dtype)"
    )
    estimate.add_argument("--keep-last-layers", type=_int_at_least(0, "keep-last-layers"), default=1)
    estimate.add_argument(
        "--link-gbps", type=_positive_float("link-gbps"), default=25.0, help="host link GB/s per direction (25)"
    )
    estimate.add_argument(
        "--tflops", type=_positive_float("tflops"), default=200.0, help="sustained TFLOP/s of the device (200)"
    )
    estimate.set_defaults(run=_run_estimate, command_parser=estimate)


def _run_estimate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .estimate import DTYPE_BYTES, PRESETS, Shape, estimate, format_estimate

    try:
        shape = Shape.from_path(args.model) if args.model else PRESETS[args.preset]
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"argument --model: cannot read a decoder-only config from {str(args.model)!r}: {error}")
    result = estimate(
        shape,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        dtype_bytes=DTYPE_BYTES[args.dtype],
        checkpointing=args.checkpointing,
        lora_rank=args.lora_rank,
        lora_dtype_bytes=DTYPE_BYTES[args.lora_dtype] if args.lora_dtype else None,
        keep_last_layers=args.keep_last_layers,
        link_gbps=args.link_gbps,
        tflops=args.tflops,
    )
    print(format_estimate(result, link_gbps=args.link_gbps, tflops=args.tflops))
    return 0


def _add_bench_command(commands: argparse._SubParsersAction) -> None:
    from .bench import MODES, PRESET_CONFIGS

    bench = commands.add_parser(
        "bench",
        help="sweep sequence lengths under each memory-saving mode: memory, speed, JSON, table and plot",
        description=(
            "Measure peak memory (on CUDA; byte accounting on the CPU), step time and tokens/s over sequence "
            "lengths for: no offloading, hf_offload, checkpointing, checkpointing + hf_offload, transformers' "
            "offload=True and TRL's offloading (when trl is installed). A mode stops at its first out-of-memory."
        ),
    )
    bench.add_argument("--preset", choices=sorted(PRESET_CONFIGS), default=None, help="tiny on CPU, 1b on CUDA")
    bench.add_argument("--model", type=_local_model_dir, metavar="PATH", help="local model directory or config")
    bench.add_argument("--seq-lens", type=_int_at_least(2, "seq-lens"), nargs="+", default=[256, 512, 1024, 2048])
    bench.add_argument("--batch-size", type=_int_at_least(1, "batch-size"), default=1)
    bench.add_argument("--steps", type=_int_at_least(1, "steps"), default=3, help="timed steps after a warm-up")
    bench.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    bench.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="bf16 on CUDA, fp32 on CPU")
    bench.add_argument("--lora-rank", type=_int_at_least(1, "lora-rank"), default=None, help="LoRA on all linears")
    bench.add_argument("--device", type=_available_device, default=_default_device())
    bench.add_argument(
        "--min-offload-bytes", type=_int_at_least(0, "min-offload-bytes"), default=None, help="hf_offload's option"
    )
    bench.add_argument("--out", default="bench_out", help="directory for bench.json, bench.md, bench.png")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(run=_run_bench, command_parser=bench)


def _run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .bench import run_bench

    if args.dtype is None:
        args.dtype = "bf16" if args.device.type == "cuda" else "fp32"
    return run_bench(args)


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


def _local_model_dir(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a local directory (models are never downloaded)")
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} has no config.json")
    return path


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _available_device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != device.type:
        available = "cpu" if accelerator is None else f"cpu, {accelerator.type}"
        raise argparse.ArgumentTypeError(f"device {text!r} is not available here; available: {available}")
    if device.index is not None and device.index >= torch.accelerator.device_count():
        raise argparse.ArgumentTypeError(
            f"device {text!r} does not exist; there are {torch.accelerator.device_count()} {device.type} device(s)"
        )
    return device


if __name__ == "__main__":
    raise SystemExit(main())
