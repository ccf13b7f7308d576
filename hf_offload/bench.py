"""`hf-offload bench`: sweep sequence lengths under several memory-saving modes and show what
each costs and saves, as JSON, a markdown table and a plot.

On CUDA the memory column is the allocator's real peak. On the CPU there is no device memory:
the column is then byte accounting, the activation bytes that would stay on the device, counted
by saved-tensor hooks (tensors saved outside our scopes, plus what our statistics say stayed or
was held in flight); timings on the CPU include the simulated copies and say little about a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import hf_offload

MODES = (
    "none",
    "hf_offload",
    "checkpointing",
    "checkpointing+hf_offload",
    "transformers_offload",
    "trl_offload",
)

PRESET_CONFIGS = {
    # Small enough for two CPU cores, shaped like a real Llama (GQA, SwiGLU, RoPE).
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=2048),
    # Llama-3.2-1B's shape.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
}  # fmt: skip


@dataclass
class Record:
    mode: str
    seq_len: int
    status: str  # "ok", "oom", "skipped: ...", "failed: ..."
    peak_device_bytes: int | None = None  # the CUDA allocator's peak; None on the CPU
    resident_activation_bytes: int | None = None  # byte accounting, on every device
    offloaded_bytes: int | None = None
    host_bytes: int | None = None  # hf_offload's host pool
    step_seconds: float | None = None
    tokens_per_second: float | None = None


class _SavedBytes:
    """Unique bytes of the non-parameter storages saved for backward while it is active
    (innermost hooks win, so inside our scopes or a checkpoint it sees nothing)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._parameters:
            self._seen[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()

    @property
    def total(self) -> int:
        return sum(self._seen.values())


def build_model(preset: str | None, model_path: str | None, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if model_path:
        path = Path(model_path)
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        if has_weights:
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True))
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**PRESET_CONFIGS[preset]))
    return model.to(device=device, dtype=dtype).train()


def set_checkpointing(model, enabled: bool, *, offload: bool = False) -> None:
    """transformers' activation checkpointing (non-reentrant). Releases without the
    activation_checkpointing_* methods (5.17 has only gradient_checkpointing_*) have no offload=True:
    that mode is then skipped, as an ImportError says to the sweep."""
    if hasattr(model, "activation_checkpointing_enable"):
        if enabled:
            model.activation_checkpointing_enable(offload=offload)
        else:
            model.activation_checkpointing_disable()
        return
    import transformers

    if offload:
        version = transformers.__version__
        raise ImportError(f"transformers {version} has no activation_checkpointing_enable(offload=True)")
    if enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def _configure(model, mode: str, device: torch.device, min_offload_bytes: int | None = None):
    """Put `model` in `mode`; returns a context factory for each forward."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hf_offload.disable_activation_offloading(base)
    set_checkpointing(base, False)
    if mode in ("hf_offload", "checkpointing+hf_offload"):
        options = {} if min_offload_bytes is None else {"min_offload_bytes": min_offload_bytes}
        hf_offload.enable_activation_offloading(base, simulate_on_cpu=device.type == "cpu", **options)
    if mode in ("checkpointing", "checkpointing+hf_offload"):
        set_checkpointing(base, True)
    if mode == "transformers_offload":
        set_checkpointing(base, True, offload=True)
    if mode == "trl_offload":
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        return lambda: get_act_offloading_ctx_manager(model)
    return contextlib.nullcontext


def _measure(model, mode, seq_len, batch_size, steps, device, min_offload_bytes=None) -> Record:
    forward_context = _configure(model, mode, device, min_offload_bytes)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len)).to(device)

    def step(counter: _SavedBytes | None = None) -> None:
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t) if counter else contextlib.nullcontext()
        )
        with forward_context(), hooks:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    offloaded = host = None
    if hf_offload.is_activation_offloading(model):
        # What the same mode saves without hf_offload, less what hf_offload moved off the device,
        # plus what it held there at most while copies were in flight or brought back ahead.
        without = mode.replace("+hf_offload", "").replace("hf_offload", "none")
        _configure(model, without, device)
        counter = _SavedBytes(model)
        step(counter)
        forward_context = _configure(model, mode, device, min_offload_bytes)
        step()  # warm-up
        stats = hf_offload.activation_offloading_stats(model)
        held = max(stats.peak_forward_held_bytes, stats.peak_backward_held_bytes)
        resident = counter.total - stats.offloaded_bytes + held
        offloaded, host = stats.offloaded_bytes, stats.pool_bytes
    else:
        counter = _SavedBytes(model)
        step(counter)  # warm-up, and the byte accounting
        resident = counter.total
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    # The fastest step: on a shared machine the others measure the neighbours too.
    seconds = min(times)
    return Record(
        mode=mode,
        seq_len=seq_len,
        status="ok",
        peak_device_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        resident_activation_bytes=resident,
        offloaded_bytes=offloaded,
        host_bytes=host,
        step_seconds=seconds,
        tokens_per_second=batch_size * seq_len / seconds,
    )


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, (torch.OutOfMemoryError, MemoryError))


def sweep(
    model, *, modes, seq_lens, batch_size, steps, device, min_offload_bytes=None, progress: bool = True
) -> Iterator[Record]:
    from tqdm.auto import tqdm

    stopped: dict[str, str] = {}
    pairs = [(mode, seq_len) for mode in modes for seq_len in seq_lens]
    for mode, seq_len in tqdm(pairs, desc="hf-offload bench", disable=not progress):
        if mode in stopped:
            yield Record(mode, seq_len, f"skipped: {stopped[mode]} at a shorter length")
            continue
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            yield _measure(model, mode, seq_len, batch_size, steps, device, min_offload_bytes)
        except ImportError as error:
            stopped[mode] = "not importable"
            yield Record(mode, seq_len, f"skipped: {error}")
        except Exception as error:  # a mode that fails is recorded, never fatal to the sweep
            model.zero_grad(set_to_none=True)
            stopped[mode] = "out of memory" if _is_oom(error) else "failed"
            status = "oom" if _is_oom(error) else f"failed: {type(error).__name__}: {str(error)[:160]}"
            yield Record(mode, seq_len, status)
    _configure(model, "none", device)


def markdown_table(records: list[Record], *, device: torch.device) -> str:
    memory = "peak device GiB" if device.type == "cuda" else "resident activations MiB (byte accounting)"
    lines = [
        f"| mode | seq | {memory} | offloaded MiB | host pool MiB | step ms | tokens/s | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:

        def mib(value):
            return "-" if value is None else f"{value / 2**20:.1f}"

        if device.type == "cuda":
            peak = "-" if r.peak_device_bytes is None else f"{r.peak_device_bytes / 2**30:.2f}"
        else:
            peak = mib(r.resident_activation_bytes)
        step = "-" if r.step_seconds is None else f"{r.step_seconds * 1e3:.1f}"
        tps = "-" if r.tokens_per_second is None else f"{r.tokens_per_second:.0f}"
        lines.append(
            f"| {r.mode} | {r.seq_len} | {peak} | {mib(r.offloaded_bytes)} | {mib(r.host_bytes)} | {step} | {tps} "
            f"| {r.status} |"
        )
    return "\n".join(lines)


def plot(records: list[Record], path: Path, *, device: torch.device, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory_axis, speed_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in dict.fromkeys(r.mode for r in records):
        ok = [r for r in records if r.mode == mode and r.status == "ok"]
        if not ok:
            continue
        lengths = [r.seq_len for r in ok]
        if device.type == "cuda":
            memory = [r.peak_device_bytes / 2**30 for r in ok]
        else:
            memory = [r.resident_activation_bytes / 2**20 for r in ok]
        memory_axis.plot(lengths, memory, marker="o", label=mode)
        speed_axis.plot(lengths, [r.tokens_per_second for r in ok], marker="o", label=mode)
    memory_axis.set_ylabel("peak device memory (GiB)" if device.type == "cuda" else "resident activations (MiB)")
    speed_axis.set_ylabel("tokens / s")
    for axis in (memory_axis, speed_axis):
        axis.set_xlabel("sequence length")
        axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
    speed_axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_bench(args) -> int:
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    preset = args.preset or ("1b" if device.type == "cuda" else "tiny")
    model = build_model(None if args.model else preset, args.model, device, dtype)
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_rank, target_modules="all-linear"))
    name = args.model or f"built-in {preset} Llama shape"
    tuning = f"LoRA r={args.lora_rank}" if args.lora_rank else "full fine-tuning"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (byte accounting, simulated copies)"
    title = f"{name}, {args.dtype}, batch {args.batch_size}, {tuning} - {where}"
    records = list(
        sweep(
            model,
            modes=args.modes,
            seq_lens=args.seq_lens,
            batch_size=args.batch_size,
            steps=args.steps,
            device=device,
            min_offload_bytes=args.min_offload_bytes,
            progress=not args.no_progress,
        )
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(
        json.dumps({"setup": title, "device": device.type, "records": [asdict(r) for r in records]}, indent=2)
    )
    table = markdown_table(records, device=device)
    (out / "bench.md").write_text(f"{title}\n\n{table}\n")
    written = [out / "bench.json", out / "bench.md"]
    try:
        plot(records, out / "bench.png", device=device, title=title)
        written.append(out / "bench.png")
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'hf-offload[bench]')")
    print(title)
    print(table)
    print(f"wrote {', '.join(map(str, written))}")
    return 0
