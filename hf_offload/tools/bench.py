"""`hf-offload bench`: sweep sequence lengths under several memory-saving modes and show what
each costs and saves, as JSON, a markdown table and a plot; or, with `--find-max-seq`, find the
longest sequence each mode trains (by search, or predicted from two short steps).

On CUDA the memory column is the allocator's real peak. On the CPU there is no device memory:
the column is then byte accounting, the activation bytes that would stay on the device, counted
by saved-tensor hooks (tensors saved outside our scopes, plus what our statistics say stayed or
was held in flight); timings on the CPU include the simulated copies and say little about a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import hf_offload
from hf_offload.internal import device_memory, empty_host_cache, resolve, unwrap_model
from hf_offload.tools.modes import (
    NEEDS_ACCELERATOR,
    WITHOUT_HF_OFFLOAD,
    parse_mode,
    set_checkpointing,
    set_liger_flce,
)
from hf_offload.tools.presets import preset_config


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
    device_budget_bytes: int | None = None  # the _auto modes: the budget hf_offload planned with
    layers_kept_for_budget: int | None = None  # ... and how many offloadable layers it kept
    simulated_peak_bytes: int | None = None  # hf-offload estimate's simulation of the same step


class ModeUnavailable(ImportError):
    """A mode this machine cannot run (recorded as skipped, like a package that is missing)."""


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


def build_on_device(config, device: torch.device, dtype: torch.dtype):
    """A randomly initialised model whose weights are created, initialised and kept in `dtype` on
    `device`: an 8B model never exists in fp32 or on the CPU (that takes minutes and 32 GB).
    Seed torch's generators first for repeatable weights."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


def build_model(preset: str | None, model_path: str | None, device: torch.device, dtype: torch.dtype):
    """The tiny preset is built on the CPU in fp32 and then moved, so that its weights are the same
    on every machine; every other shape on an accelerator is built in place (`build_on_device`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_path:
        path = Path(model_path)
        if any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
            return model.to(device=device).train()
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        config = preset_config(preset)
    torch.manual_seed(0)
    if device.type != "cpu" and preset != "tiny":
        return build_on_device(config, device, dtype)
    model = AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype).train()


def _accelerate_state() -> None:
    """TRL's offloading logs through accelerate's logger, which raises unless accelerate's process
    state exists (TRL's trainers create it; a bare model does not). It logs at the first unpack of
    the first backward when more than 60% of the host's RAM is in use (TRL 1.16,
    trl/models/activation_offloading.py), so whether a run fails depended on what earlier modes
    left pinned. A single process's state is harmless to create."""
    from accelerate import PartialState

    PartialState()


# Forward hooks TRL's context manager registered, per model, to be removed when the mode changes:
# TRL keeps no handles, and its no-op hooks on lm_head would hide the head's saved tensors from
# the byte accounting of every later mode.
_TRL_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _trl_context(model):
    get_act_offloading_ctx_manager = resolve("trl.activation_offloading")

    _accelerate_state()
    before = {module: (set(module._forward_pre_hooks), set(module._forward_hooks)) for module in model.modules()}
    # One manager per configuration, entered around every forward, as TRL's trainers use it.
    manager = get_act_offloading_ctx_manager(model)
    _TRL_HOOKS[model] = [
        (module, set(module._forward_pre_hooks) - pre, set(module._forward_hooks) - post)
        for module, (pre, post) in before.items()
    ]
    return lambda: manager


def _remove_trl_hooks(model) -> None:
    for module, pre, post in _TRL_HOOKS.pop(model, []):
        for key in pre:
            module._forward_pre_hooks.pop(key, None)
        for key in post:
            module._forward_hooks.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)


def _configure(model, mode: str, device: torch.device, min_offload_bytes: int | None = None, memory_limit=None):
    """Put `model` in `mode`; returns a context factory for each forward. The `_auto` modes read
    the device's free memory at each step; on the CPU, where there is none, they take
    `memory_limit` (the byte accounting's limit) as the budget, and are unavailable without it."""
    parsed = parse_mode(mode)
    base_mode = parsed.base
    # check_available: a CUDA build of torch on a machine without a GPU names CUDA as its accelerator
    # (torch 2.14.1's pip wheel here) though it has none to run on.
    if base_mode in NEEDS_ACCELERATOR and torch.accelerator.current_accelerator(check_available=True) is None:
        why = NEEDS_ACCELERATOR[base_mode]
        raise ModeUnavailable(f"{base_mode} needs an accelerator, and there is none here: {why}")
    base = unwrap_model(model)
    _remove_trl_hooks(model)
    set_liger_flce(base, False)
    hf_offload.disable_activation_offloading(base)
    set_checkpointing(base, False)
    if parsed.liger:
        set_liger_flce(base, True)
    hf_offload.disable_sequence_tiling(base)
    if parsed.tiled:
        hf_offload.enable_sequence_tiling(base)
    if base_mode in WITHOUT_HF_OFFLOAD:
        options = {} if min_offload_bytes is None else {"min_offload_bytes": min_offload_bytes}
        if base_mode.endswith("_auto"):
            if device.type != "cpu":
                options["max_device_bytes"] = "auto"
            elif memory_limit is not None:
                options["max_device_bytes"] = memory_limit
            else:
                raise ModeUnavailable(f"{base_mode} reads the device's free memory; on the CPU give --memory-limit")
        hf_offload.enable_activation_offloading(base, simulate_on_cpu=device.type == "cpu", **options)
    if base_mode.startswith("checkpointing"):
        set_checkpointing(base, True)
    if base_mode == "transformers_offload":
        set_checkpointing(base, True, offload=True)
    if base_mode == "trl_offload":
        return _trl_context(model)
    return contextlib.nullcontext


class SimulatedOutOfMemory(torch.OutOfMemoryError):
    """On the CPU with a memory limit: the step's resident activation bytes exceeded it."""


def random_ids(model, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """The bench's input: random tokens of the model's vocabulary, the same for a given length."""
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len)).to(device)


def _measure(
    model,
    mode,
    seq_len,
    batch_size,
    steps,
    device,
    min_offload_bytes=None,
    *,
    memory_limit: int | None = None,
    accounting: bool = True,
    warmup: bool = True,
) -> Record:
    """One mode at one length: a warm-up step, then `steps` timed ones (the fastest is kept).
    `accounting` adds the byte accounting (the CPU's memory figure; for an hf_offload mode it costs
    one more step, without hf_offload, which on a GPU can run out of memory where the mode itself
    fits). `warmup=False` times the first step (one step in all, without accounting).
    `memory_limit` on the CPU turns resident activation bytes above it into a simulated
    out-of-memory (on CUDA the allocator enforces the limit itself)."""
    forward_context = _configure(model, mode, device, min_offload_bytes, memory_limit)
    parsed = parse_mode(mode)
    budgeted = parsed.budget
    # A budget's plan needs the bytes per layer of one step first: never time that step.
    warmup = warmup or budgeted
    ids = random_ids(model, batch_size, seq_len, device)
    if memory_limit is not None and device.type == "cpu" and not accounting:
        raise ValueError("a memory limit on the CPU is applied to the byte accounting: accounting=True is needed")

    def step(counter: _SavedBytes | None = None) -> None:
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t) if counter else contextlib.nullcontext()
        )
        with forward_context(), hooks:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    offloaded = host = resident = None
    if hf_offload.is_activation_offloading(model):
        if accounting:
            # What the same mode saves without hf_offload, counted outside any hooks of ours.
            without = parsed.without_hf_offload()
            _configure(model, without, device)
            counter = _SavedBytes(model)
            step(counter)
            forward_context = _configure(model, mode, device, min_offload_bytes, memory_limit)
        if warmup or accounting:
            step()
            if budgeted:
                if device.type == "cpu":
                    # The CPU's limit holds all the step saves: the decoder layers may keep that,
                    # less what is saved outside them (the first step measured the layers' share).
                    # Enabling again reconfigures the engine and keeps what it measured.
                    outside = counter.total - hf_offload.activation_offloading_stats(model).layer_activation_bytes
                    options = {} if min_offload_bytes is None else {"min_offload_bytes": min_offload_bytes}
                    budget = max(memory_limit - outside, 0)
                    hf_offload.enable_activation_offloading(
                        unwrap_model(model), simulate_on_cpu=True, max_device_bytes=budget, **options
                    )
                step()  # the first step measured the layers (all offloaded); this one follows the plan
            stats = hf_offload.activation_offloading_stats(model)
        if accounting:
            # What stays outside hf_offload's reach, plus the most of the layers' own activations on
            # the device at once (what kept layers saved, copies in flight or brought back ahead).
            resident = counter.total - stats.layer_activation_bytes + stats.peak_resident_bytes
    elif accounting:
        counter = _SavedBytes(model)
        step(counter)  # warm-up, and the byte accounting
        resident = counter.total
    elif warmup:
        step()
    if device.type == "cpu" and memory_limit is not None and resident > memory_limit:
        raise SimulatedOutOfMemory(
            f"simulated: {resident} resident activation bytes > the {memory_limit}-byte limit (byte accounting)"
        )
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
    budget = kept_for_budget = None
    if hf_offload.is_activation_offloading(model):
        stats = hf_offload.activation_offloading_stats(model)
        offloaded, host = stats.offloaded_bytes, stats.pool_bytes
        if stats.max_device_bytes is not None:
            budget, kept_for_budget = stats.max_device_bytes, stats.layers_kept_for_budget
    # The fastest step: on a shared machine the others measure the neighbours too.
    seconds = min(times)
    return Record(
        mode=mode,
        seq_len=seq_len,
        status="ok",
        peak_device_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        resident_activation_bytes=resident,
        offloaded_bytes=offloaded,
        host_bytes=host,
        step_seconds=seconds,
        tokens_per_second=batch_size * seq_len / seconds,
        device_budget_bytes=budget,
        layers_kept_for_budget=kept_for_budget,
    )


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, (torch.OutOfMemoryError, MemoryError))


def _release_memory(device: torch.device) -> None:
    """What a failed or finished probe left: its graph (once the exception is gone), the allocator's
    cached blocks, and on CUDA the pinned host blocks torch keeps cached after hf_offload's pool is
    dropped (tens of GB after a long hf_offload run; they count as used RAM for everything after)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        empty_host_cache()


def _probe(model, mode, seq_len, batch_size, steps, device, min_offload_bytes=None, **options) -> Record:
    """`_measure`, with every failure turned into a record and the model left usable: gradients
    dropped and memory released after the exception (and the graph its traceback holds) is gone."""
    if device.type == "cuda":
        _release_memory(device)  # each probe starts from what the model itself holds
    try:
        return _measure(model, mode, seq_len, batch_size, steps, device, min_offload_bytes, **options)
    except ImportError as error:
        record = Record(mode, seq_len, f"skipped: {error}")
    except Exception as error:  # a mode that fails is recorded, never fatal
        status = "oom" if _is_oom(error) else f"failed: {type(error).__name__}: {str(error)[:160]}"
        record = Record(mode, seq_len, status)
    model.zero_grad(set_to_none=True)
    _release_memory(device)
    return record


def sweep(
    model,
    *,
    modes,
    seq_lens,
    batch_size,
    steps,
    device,
    min_offload_bytes=None,
    memory_limit=None,
    progress: bool = True,
) -> Iterator[Record]:
    from tqdm.auto import tqdm

    stopped: dict[str, str] = {}
    pairs = [(mode, seq_len) for mode in modes for seq_len in seq_lens]
    for mode, seq_len in tqdm(pairs, desc="hf-offload bench", disable=not progress):
        if mode in stopped:
            yield Record(mode, seq_len, f"skipped: {stopped[mode]} at a shorter length")
            continue
        options = {} if memory_limit is None else {"memory_limit": memory_limit}
        record = _probe(model, mode, seq_len, batch_size, steps, device, min_offload_bytes, **options)
        if record.status.startswith("skipped"):
            stopped[mode] = "unavailable"
        elif record.status == "oom":
            stopped[mode] = "out of memory"
        elif record.status != "ok":
            stopped[mode] = "failed"
        yield record
    _configure(model, "none", device)


@dataclass
class MaxSeq:
    """The longest sequence one mode trained (method "search") or is predicted to train (method
    "slope"), with the probes that decided it."""

    mode: str
    method: str  # "search" or "slope"
    status: str  # "ok", "reached the limit", "oom at the start", or the failure that stopped it
    max_seq_len: int | None = None  # search: the longest length that fitted
    at_max: Record | None = None  # search: the probe there (peak, step time)
    first_oom: Record | None = None  # search: the shortest length that did not fit
    probes: list[Record] = field(default_factory=list)
    budget_bytes: int | None = None  # the device memory the run had (None on the CPU without a limit)
    # slope only:
    bytes_per_token: float | None = None
    fixed_bytes: float | None = None
    predicted_max_seq_len: int | None = None
    # hf_offload modes: the bytes it moved to the host, per token and at the predicted length (its
    # pinned pool holds at least that much and at most 1.1x: buffers are sized to what they hold).
    offloaded_bytes_per_token: float | None = None
    predicted_offloaded_bytes: float | None = None
    verify: Record | None = None  # the one step at the predicted length, when asked for


def _grid_midpoint(fitting: int, failing: int, granularity: int) -> int | None:
    """A multiple of `granularity` strictly between the two lengths, near the middle; None when
    there is none (the two are then at most `granularity` apart)."""
    first = (fitting // granularity + 1) * granularity
    last = (failing - 1) // granularity * granularity
    if first > last:
        return None
    middle = (fitting + failing) // 2 // granularity * granularity
    return min(max(middle, first), last)


def find_max_seq(fits: Callable[[int], Record], *, start: int, granularity: int, limit: int) -> MaxSeq:
    """The longest length for which `fits(length).status == "ok"`, assuming that is monotone in
    the length: double from `start` until a probe runs out of memory (status "oom") or `limit` is
    probed, then bisect on multiples of `granularity` between the longest fit and the shortest
    out-of-memory. The answer is then exact to `granularity`: the true maximum is at least
    `max_seq_len` and below `first_oom.seq_len`, at most `granularity` above it. Any other status
    (a mode that fails, or cannot be imported) is not a memory boundary: the search stops there and
    says so, keeping what it had found."""
    for name, value in (("start", start), ("granularity", granularity), ("limit", limit)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if limit < start:
        raise ValueError(f"limit ({limit}) must be >= start ({start})")
    result = MaxSeq(mode="", method="search", status="ok")

    def probe(length: int) -> Record:
        record = fits(length)
        result.probes.append(record)
        result.mode = record.mode
        return record

    def stop(record: Record) -> MaxSeq:
        result.status = f"stopped at {record.seq_len}: {record.status}"
        return result

    length = start
    while True:
        record = probe(length)
        if record.status == "oom":
            result.first_oom = record
            break
        if record.status != "ok":
            return stop(record)
        result.max_seq_len, result.at_max = length, record
        if length >= limit:
            result.status = "reached the limit"
            return result
        length = min(2 * length, limit)
    if result.at_max is None:
        result.status = "oom at the start"
        return result
    while (length := _grid_midpoint(result.max_seq_len, result.first_oom.seq_len, granularity)) is not None:
        record = probe(length)
        if record.status == "ok":
            result.max_seq_len, result.at_max = length, record
        elif record.status == "oom":
            result.first_oom = record
        else:
            return stop(record)
    return result


def fit_bytes_per_token(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line through (tokens, bytes): (bytes per token, fixed bytes)."""
    if len({tokens for tokens, _ in points}) < 2:
        raise ValueError(f"a slope needs two different lengths, got {[tokens for tokens, _ in points]}")
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return slope, mean_y - slope * mean_x


def predict_max_seq(bytes_per_token: float, fixed_bytes: float, budget: int, granularity: int) -> int | None:
    """The longest multiple of `granularity` whose predicted peak fits `budget`; None when memory
    did not grow with length or not even `granularity` tokens fit."""
    if bytes_per_token <= 0:
        return None
    tokens = math.floor((budget - fixed_bytes) / bytes_per_token)
    longest = tokens // granularity * granularity
    return longest if longest >= granularity else None


def slope_max_seq(
    measure: Callable[..., Record],
    *,
    lengths: tuple[int, int],
    budget: int,
    granularity: int,
    peak: Callable[[Record], int | None],
    verify: bool = False,
) -> MaxSeq:
    """Predict the longest length from the peaks at two short ones. `measure(length)` measures one
    length; `measure(length, verifying=True)` is the one step at the predicted length (no warm-up). `peak` reads
    the memory figure of a record (the device peak on CUDA, resident activations on the CPU)."""
    result = MaxSeq(mode="", method="slope", status="ok", budget_bytes=budget)
    for length in lengths:
        record = measure(length)
        result.probes.append(record)
        result.mode = record.mode
        if record.status != "ok":
            result.status = f"stopped at {length}: {record.status}"
            return result
    points = [(r.seq_len, peak(r)) for r in result.probes]
    result.bytes_per_token, result.fixed_bytes = fit_bytes_per_token(points)
    if all(r.offloaded_bytes is not None for r in result.probes):
        moved = [(r.seq_len, r.offloaded_bytes) for r in result.probes]
        result.offloaded_bytes_per_token, moved_fixed = fit_bytes_per_token(moved)
    result.predicted_max_seq_len = predict_max_seq(result.bytes_per_token, result.fixed_bytes, budget, granularity)
    if result.predicted_max_seq_len is None:
        result.status = (
            "memory did not grow with length" if result.bytes_per_token <= 0 else "nothing fits: over budget already"
        )
        return result
    if result.offloaded_bytes_per_token is not None:
        result.predicted_offloaded_bytes = moved_fixed + result.offloaded_bytes_per_token * result.predicted_max_seq_len
        shares = [r.offloaded_bytes / r.seq_len for r in result.probes]
        if max(shares) - min(shares) > 0.05 * max(shares):
            # Tensors under min_offload_bytes at the shorter length stay on the device, so what stays
            # there does not grow like at longer lengths: the line is not the mode's line.
            result.status = (
                "unreliable: hf_offload moved a different share of the bytes at the two lengths "
                "(tensors under min_offload_bytes?); use longer --slope-lens"
            )
    if verify:
        result.verify = measure(result.predicted_max_seq_len, verifying=True)
        if result.verify.status != "ok":
            did_not_fit = "predicted length did not fit" if result.verify.status == "oom" else result.verify.status
            result.status = did_not_fit if result.status == "ok" else f"{result.status}; {did_not_fit}"
    return result


def device_budget(device: torch.device, memory_limit: int | None) -> int | None:
    """Bytes this process can have allocated: the limit, or on CUDA what is free plus what its
    allocator already holds. None on the CPU without a limit (there is no device memory)."""
    if device.type == "cuda":
        available, _total = device_memory(device)  # what a step can still take
        reachable = available + torch.cuda.memory_allocated(device)
        return reachable if memory_limit is None else min(memory_limit, reachable)
    return memory_limit


def limit_meaning(device: torch.device, memory_limit: int | None) -> str:
    if device.type == "cuda":
        if memory_limit is None:
            return (
                "no --memory-limit: the whole device (the CUDA allocator runs out of memory where the device does; "
                "the slope method predicts against what is free plus what this process already holds)"
            )
        return (
            f"--memory-limit {memory_limit / 2**30:g} GiB caps this process's CUDA caching allocator "
            "(torch.cuda.set_per_process_memory_fraction): a step whose allocations would take the allocator's "
            "reserved memory above it runs out of memory, as on a device with that much memory free. Weights, "
            "gradients, activations, the loss and allocator fragmentation all count."
        )
    if memory_limit is None:
        return "no --memory-limit: nothing runs out of memory on the CPU"
    return (
        f"--memory-limit {memory_limit / 2**30:g} GiB on the CPU is a simulated out-of-memory: a step whose "
        "resident activation bytes (byte accounting: tensors saved for backward that would stay on the device) "
        "exceed it counts as out of memory. Weights, gradients and temporary buffers do not count; there is no "
        "device memory on the CPU."
    )


@contextlib.contextmanager
def memory_limit_applied(device: torch.device, memory_limit: int | None):
    """On CUDA, cap the caching allocator at `memory_limit` bytes for the duration; on the CPU
    the limit is applied by `_measure` instead."""
    if device.type != "cuda" or memory_limit is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if memory_limit > total:
        raise ValueError(
            f"--memory-limit {memory_limit / 2**30:.2f} GiB is more than this device's {total / 2**30:.2f} GiB"
        )
    torch.cuda.set_per_process_memory_fraction(memory_limit / total, device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def max_seq(
    model,
    *,
    modes,
    device: torch.device,
    method: str = "search",
    start: int = 4096,
    granularity: int = 1024,
    limit: int = 1 << 20,
    slope_lens: tuple[int, int] = (4096, 8192),
    verify: bool = False,
    steps: int = 1,
    memory_limit: int | None = None,
    min_offload_bytes: int | None = None,
    log: Callable[[str], None] | None = print,
) -> list[MaxSeq]:
    """Batch 1: for each mode, the longest sequence that completes a training step
    (`find_max_seq`), or its prediction from two lengths (`slope_max_seq`)."""
    if method not in ("search", "slope"):
        raise ValueError(f"method must be 'search' or 'slope', got {method!r}")
    for mode in modes:
        parse_mode(mode)
    # The byte accounting runs one more step, without hf_offload, that on a GPU would run out of
    # memory long before the mode does; the CPU needs it as its memory figure.
    options = dict(memory_limit=memory_limit, accounting=device.type == "cpu")
    results = []
    with memory_limit_applied(device, memory_limit):
        budget = device_budget(device, memory_limit)
        if method == "slope" and budget is None:
            raise ValueError("the slope method on the CPU needs a memory limit to predict against")
        for mode in modes:

            def measure(length: int, verifying: bool = False, mode=mode) -> Record:
                record = _probe(
                    model, mode, length, 1, 1 if verifying else steps, device, min_offload_bytes,
                    **options, warmup=not verifying,
                )  # fmt: skip
                if log:
                    log(f"  {mode:<32} seq {length:>8}: {_describe(record, device)}")
                return record

            if method == "search":
                result = find_max_seq(measure, start=start, granularity=granularity, limit=limit)
            else:
                result = slope_max_seq(
                    measure,
                    lengths=slope_lens,
                    budget=budget,
                    granularity=granularity,
                    peak=lambda r: _peak(r, device),
                    verify=verify,
                )
            result.mode, result.budget_bytes = mode, budget
            results.append(result)
    _configure(model, "none", device)
    _release_memory(device)
    return results


def _peak(record: Record, device: torch.device) -> int | None:
    return record.peak_device_bytes if device.type == "cuda" else record.resident_activation_bytes


def _unit(device: torch.device) -> tuple[int, str]:
    """GiB for device peaks; MiB for the CPU's byte accounting, whose models are small."""
    return (2**30, "GiB") if device.type == "cuda" else (2**20, "MiB")


def _amount(value, device: torch.device) -> str:
    scale, _ = _unit(device)
    return "-" if value is None else f"{value / scale:.2f}"


def _describe(record: Record, device: torch.device) -> str:
    if record.status != "ok":
        return record.status
    return f"ok, {_amount(_peak(record, device), device)} {_unit(device)[1]}, {record.step_seconds * 1e3:.0f} ms"


def max_seq_table(results: list[MaxSeq], *, device: torch.device) -> str:
    unit = _unit(device)[1]
    memory = f"peak {unit}" if device.type == "cuda" else f"resident activations {unit}"

    def amount(value) -> str:
        return _amount(value, device)

    if results and results[0].method == "slope":
        lengths = sorted({p.seq_len for r in results for p in r.probes[:2]})
        a, b = (lengths + ["A", "B"])[:2]
        lines = [
            f"| mode | {memory} at {a} | at {b} | KiB per token | fixed {unit} | predicted max seq "
            f"| offloaded {unit} there | verified | {memory} there | step ms there | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            peaks = [amount(_peak(p, device)) for p in r.probes[:2]] + ["-"] * (2 - len(r.probes[:2]))
            per_token = "-" if r.bytes_per_token is None else f"{r.bytes_per_token / 2**10:.1f}"
            verified = "-" if r.verify is None else ("fits" if r.verify.status == "ok" else r.verify.status)
            there = r.verify if r.verify is not None and r.verify.status == "ok" else None
            step = "-" if there is None else f"{there.step_seconds * 1e3:.0f}"
            lines.append(
                f"| {r.mode} | {peaks[0]} | {peaks[1]} | {per_token} | {amount(r.fixed_bytes)} "
                f"| {r.predicted_max_seq_len or '-'} | {amount(r.predicted_offloaded_bytes)} | {verified} "
                f"| {amount(_peak(there, device) if there else None)} | {step} | {r.status} |"
            )
        return "\n".join(lines)
    lines = [
        f"| mode | max seq | {memory} there | step ms there | tokens/s there | first OOM | probes | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        at = r.at_max
        step = "-" if at is None else f"{at.step_seconds * 1e3:.0f}"
        tps = "-" if at is None else f"{at.tokens_per_second:.0f}"
        oom = "-" if r.first_oom is None else str(r.first_oom.seq_len)
        lines.append(
            f"| {r.mode} | {r.max_seq_len or '-'} | {amount(_peak(at, device) if at else None)} | {step} | {tps} "
            f"| {oom} | {len(r.probes)} | {r.status} |"
        )
    return "\n".join(lines)


def plot_max_seq(results: list[MaxSeq], path: Path, *, device: torch.device, budget: int | None, title: str) -> None:
    """Peak memory against length for each mode, with an x where the mode ran out of memory
    (drawn on the budget line: a step that ran out of memory has no peak to show). The slope
    method adds its fitted line, dashed, up to the predicted length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale, unit = _unit(device)
    figure, axis = plt.subplots(figsize=(9, 5))
    for r in results:
        probes = sorted([*r.probes, *([r.verify] if r.verify else [])], key=lambda p: p.seq_len)
        ok = [p for p in probes if p.status == "ok"]
        (line,) = axis.plot([p.seq_len for p in ok], [_peak(p, device) / scale for p in ok], marker="o", label=r.mode)
        color = line.get_color()
        if r.method == "slope" and r.predicted_max_seq_len is not None:
            lengths = [r.probes[0].seq_len, r.predicted_max_seq_len]
            fitted = [(r.fixed_bytes + r.bytes_per_token * n) / scale for n in lengths]
            axis.plot(lengths, fitted, linestyle="--", color=color, alpha=0.6)
        failed = next((p for p in probes if p.status == "oom"), None)
        if failed is not None and budget is not None:
            axis.plot([failed.seq_len], [budget / scale], marker="x", markersize=12, mew=2.5, color=color)
    if budget is not None:
        axis.axhline(budget / scale, color="grey", linestyle=":", label="memory budget")
    axis.set_xlabel("sequence length (batch 1)")
    axis.set_ylabel(f"peak device memory ({unit})" if device.type == "cuda" else f"resident activations ({unit})")
    axis.set_xlim(left=0)
    axis.set_ylim(bottom=0)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown_table(records: list[Record], *, device: torch.device) -> str:
    """One row per record; with the simulator's peaks, two more columns: the simulated peak and
    measured / simulated (on the CPU there is no measured device peak to hold it to)."""
    from hf_offload.tools.fidelity import fidelity

    memory = "peak device GiB" if device.type == "cuda" else "resident activations MiB (byte accounting)"
    simulated = any(r.simulated_peak_bytes is not None for r in records)
    extra = " simulated peak GiB | measured / simulated |" if simulated else ""
    lines = [
        f"| mode | seq | {memory} |{extra} offloaded MiB | host pool MiB | step ms | tokens/s | status |",
        "|---|---|---|" + ("---|---|" if simulated else "") + "---|---|---|---|---|",
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
        status = r.status
        if r.device_budget_bytes is not None:
            kept = r.layers_kept_for_budget
            status += f" (budget {r.device_budget_bytes / 2**30:.2f} GiB: {kept} layer{'' if kept == 1 else 's'} kept)"
        columns = ""
        if simulated:
            predicted = "-" if r.simulated_peak_bytes is None else f"{r.simulated_peak_bytes / 2**30:.2f}"
            columns = f" {predicted} | {fidelity(r)} |"
        lines.append(
            f"| {r.mode} | {r.seq_len} | {peak} |{columns} {mib(r.offloaded_bytes)} | {mib(r.host_bytes)} | {step} "
            f"| {tps} | {status} |"
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


def _setup(args, device: torch.device):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    preset = args.preset or ("1b" if device.type == "cuda" else "tiny")
    model = build_model(None if args.model else preset, args.model, device, dtype)
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_rank, target_modules="all-linear"))
    family = {"llama": "Llama", "qwen2": "Qwen2"}.get(model.config.model_type, model.config.model_type)
    name = args.model or f"built-in {preset} {family} shape"
    tuning = f"LoRA r={args.lora_rank}" if args.lora_rank else "full fine-tuning"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (byte accounting, simulated copies)"
    return model, f"{name}, {args.dtype}, batch {args.batch_size}, {tuning} - {where}"


def _simulating(args, device: torch.device) -> bool:
    """The simulator's peak beside each measured one: by default on CUDA, where there is one."""
    simulate = getattr(args, "simulate", None)
    return device.type == "cuda" if simulate is None else simulate


def run_bench(args) -> int:
    device = torch.device(args.device)
    model, title = _setup(args, device)
    memory_limit = None if args.memory_limit is None else int(args.memory_limit * 2**30)
    if getattr(args, "find_max_seq", False):
        return run_max_seq(args, model, title, device, memory_limit)
    with memory_limit_applied(device, memory_limit):
        records = list(
            sweep(
                model,
                modes=args.modes,
                seq_lens=args.seq_lens,
                batch_size=args.batch_size,
                steps=args.steps,
                device=device,
                min_offload_bytes=args.min_offload_bytes,
                memory_limit=memory_limit,
                progress=not args.no_progress,
            )
        )
    if _simulating(args, device):
        from hf_offload.tools.fidelity import annotate, simulator_for

        annotate(records, simulator_for(model, device=device, batch_size=args.batch_size,
                                        min_offload_bytes=args.min_offload_bytes))  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(
        json.dumps({"setup": title, "device": device.type, "records": [asdict(r) for r in records]}, indent=2)
    )
    table = markdown_table(records, device=device)
    note = "" if memory_limit is None else f"Memory limit: {limit_meaning(device, memory_limit)}\n\n"
    (out / "bench.md").write_text(f"{title}\n\n{note}{table}\n")
    written = [out / "bench.json", out / "bench.md"]
    try:
        plot(records, out / "bench.png", device=device, title=title)
        written.append(out / "bench.png")
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'hf-offload[bench]')")
    print(title)
    if note:
        print(note.strip())
    print(table)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


def _host_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def run_max_seq(args, model, title: str, device: torch.device, memory_limit: int | None) -> int:
    meaning = limit_meaning(device, memory_limit)
    method = args.method
    how = (
        f"search from {args.start} tokens, doubling then bisecting to {args.granularity} tokens, up to {args.seq_limit}"
        if method == "search"
        else f"slope from {args.slope_lens[0]} and {args.slope_lens[1]} tokens, rounded down to "
        f"{args.granularity} tokens" + (", verified with one step" if args.verify else "")
    )
    print(f"{title}\nlongest sequence, batch 1: {how}\nmemory limit: {meaning}", flush=True)
    results = max_seq(
        model,
        modes=args.modes,
        device=device,
        method=method,
        start=args.start,
        granularity=args.granularity,
        limit=args.seq_limit,
        slope_lens=tuple(args.slope_lens),
        verify=args.verify,
        steps=args.steps,
        memory_limit=memory_limit,
        min_offload_bytes=args.min_offload_bytes,
    )
    budget = results[0].budget_bytes  # what the predictions were made against
    notes = []
    ram = _host_ram_bytes()
    for r in results:
        if ram and r.predicted_offloaded_bytes and r.predicted_offloaded_bytes > ram / 2:
            notes.append(
                f"{r.mode}: at the predicted length hf_offload moves {r.predicted_offloaded_bytes / 2**30:.2f} GiB to "
                f"pinned host memory (its pool up to 1.1x that), against "
                f"{ram / 2**30:.2f} GiB of RAM on this host: host memory may limit it before the device does"
            )
    table = max_seq_table(results, device=device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "max_seq.json").write_text(
        json.dumps(
            {
                "setup": title,
                "device": device.type,
                "method": method,
                "how": how,
                "memory_limit_bytes": memory_limit,
                "memory_limit_meaning": meaning,
                "budget_bytes": budget,
                "results": [asdict(r) for r in results],
            },
            indent=2,
        )
    )
    text = "\n\n".join([title, f"Longest sequence, batch 1: {how}.", f"Memory limit: {meaning}", table, *notes])
    (out / "max_seq.md").write_text(text + "\n")
    written = [out / "max_seq.json", out / "max_seq.md"]
    try:
        plot_max_seq(results, out / "max_seq.png", device=device, budget=budget, title=title)
        written.append(out / "max_seq.png")
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'hf-offload[bench]')")
    print(table)
    for note in notes:
        print(note)
    print(f"wrote {', '.join(map(str, written))}")
    return 0
