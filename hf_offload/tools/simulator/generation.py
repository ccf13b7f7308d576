"""GRPO's generation on the training GPU, simulated: transformers' own `generate` on the meta
device, as TRL 1.16's GRPOTrainer calls it when it does not use vLLM (its default).

What TRL calls (`GRPOTrainer._generate_single_turn`, read in TRL 1.16): `model.generate(input_ids,
attention_mask, generation_config)` on the training model, left-padded prompts, in training mode,
under `no_grad`, gradient checkpointing switched off around it, with `do_sample=True`,
`max_new_tokens=max_completion_length`, TRL's sampling defaults (temperature 1, top_p 1, top_k 0:
no logits warper) and `disable_compile=True`; the whole local generation batch in one call, each
row with its own KV cache (transformers' `DynamicCache`, which grows by `torch.cat` every step).

`simulate_generation` runs that call for real on the meta device, through the prefill and a few
decode steps, and counts what it allocates (the simulator's `MemoryTracker`). Every decode step
runs the same ops on a cache one token longer, so what it holds, reads and writes grows by the
same bytes each step: the simulated steps are checked to lie exactly on one line (or it raises),
and the line gives the step of any completion length. Only that growth is extrapolated; the
prefill and the steps simulated are as run. (tests/test_generation.py holds the extrapolated peak
to real CPU allocations of `generate` within 1%.)

The meta device holds no values, and `generate` reads a few (`HostReads`): each read is answered
from a table that names the question, the answer and why it changes nothing the GPU would
allocate differently, checked with transformers 5.25.0; a read not in the table raises, naming
transformers' version, the function and the line.
- The stop check (`StopCheck.__call__`, `bool(unfinished_sequences.max() == 0)` every step): no
  row has finished before `max_new_tokens`. The batch decodes until its longest completion ends,
  so this is the step at which the longest completion is `max_completion_length` long.
- Whether the prompts' attention mask is all ones (`generate` then drops it): as the simulated
  prompts are, padded or not (TRL pads each prompt on the left to the longest in the batch).
- Warnings only (an eos id among the pad ids, a negative eos id, right padding, a negative
  encoder id): answered "no", which is what TRL's inputs give.
"""

from __future__ import annotations

import contextlib
import linecache
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_offload.internal import UpstreamChanged

# The transformers release whose `generate` the host-read table was read from.
CHECKED_TRANSFORMERS = "5.25.0"
# Decode steps simulated after the prefill (and one more, which ends generate): the first can
# differ (what `generate` sets up once); the others are held to one line.
DECODE_STEPS = 4
GENERATION = "generation"


class HostReadNotSimulated(UpstreamChanged):
    """`generate` read a value from a meta tensor at a place the simulator does not answer: a
    transformers release moved what the simulator stands in for (inventory entry
    "transformers.generate_reads")."""


@dataclass(frozen=True)
class _Read:
    function: str  # the transformers function asking
    fragment: str  # in the source of the statement asking
    why: str


# (function, fragment) -> why; the answer is computed by `HostReads._answer`.
_READS = (
    _Read("__call__", "unfinished_sequences.max() == 0",
          "StopCheck: no row finishes before max_new_tokens (the batch's longest completion reaches it)"),
    _Read("generate", '(model_kwargs["attention_mask"] == 1).all()',
          "whether the prompts are padded: as simulated"),
    _Read("generate", "torch.any(attention_mask[:, -1] == 0).item()",
          "right padding (a warning only): TRL pads prompts on the left"),
    _Read("_prepare_special_tokens", "torch.isin(eos_token_tensor, pad_token_tensor).any()",
          "an eos id equal to the pad id (a warning only)"),
    _Read("_prepare_special_tokens", "(eos_token_tensor < 0).any()", "a negative eos id (a warning only)"),
    _Read("_get_logits_processor", "(encoder_input_ids < 0).any()",
          "negative encoder ids (only for encoder_repetition_penalty, which TRL leaves unset)"),
)  # fmt: skip


class HostReads(TorchDispatchMode):
    """Answers `generate`'s reads of meta tensors' values (`_local_scalar_dense`) from `_READS`,
    found by the transformers function asking and the source of its statement (the line and the
    few after it: a condition over several lines reads at its first)."""

    def __init__(self, *, max_length: int, padded: bool) -> None:
        super().__init__()
        self.max_length = max_length
        self.padded = padded
        self.answered: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return self._answer()
        return func(*args, **(kwargs or {}))

    def _answer(self):
        frame = sys._getframe(1)
        while frame is not None and "/transformers/" not in frame.f_code.co_filename.replace("\\", "/"):
            frame = frame.f_back
        if frame is None:
            raise HostReadNotSimulated("a value was read from a meta tensor outside transformers' generate")
        code = frame.f_code
        source = " ".join(linecache.getline(code.co_filename, frame.f_lineno + i).strip() for i in range(6))
        for read in _READS:
            if code.co_name == read.function and read.fragment in source:
                self.answered[read.fragment] = self.answered.get(read.fragment, 0) + 1
                if read.fragment == "unfinished_sequences.max() == 0":
                    return frame.f_locals["length"] >= self.max_length
                if read.fragment.startswith('(model_kwargs["attention_mask"]'):
                    return not self.padded
                return False
        import transformers

        raise HostReadNotSimulated(
            f"transformers {transformers.__version__}'s {code.co_name} ({code.co_filename}:{frame.f_lineno}) reads a "
            "value of a tensor, which the meta device does not hold, where the simulator has no answer: its answers "
            f"were read from transformers {CHECKED_TRANSFORMERS}'s generate (simulator/generation.py, _READS; "
            "inventory entry 'transformers.generate_reads', docs/upstream.md)"
        )


@dataclass(frozen=True)
class Line:
    """A quantity of decode step k (the forward whose cache holds the prompt and k generated
    tokens, k >= 1): `base + per_token * k`."""

    base: float
    per_token: float

    def at(self, step: int) -> float:
        return self.base + self.per_token * step

    def total(self, first: int, last: int) -> float:
        """The sum over steps first..last."""
        if last < first:
            return 0.0
        count = last - first + 1
        return count * self.base + self.per_token * (first + last) * count / 2


@dataclass
class StepCounts:
    """What one forward of `generate` (and the sampling after it) held and did."""

    peak_bytes: int  # the most live above what was live before generate
    matmul_flops: int = 0
    attention_flops: int = 0
    compute: dict = field(default_factory=dict)  # (kind, dtype) -> FLOPs, as the time model takes them
    traffic_bytes: int = 0  # what the FLOP-less ops read and write
    operand_bytes: int = 0  # what matmuls and attention read and write (weights, the KV cache)
    ops: int = 0  # aten ops run: kernels launched, as eager PyTorch launches them


@dataclass
class GenerationResult:
    """`generate` for `rows` prompts of `prompt_length` tokens, simulated: the prefill as run, the
    decode steps as lines in the step (exact, checked on the simulated steps)."""

    rows: int
    prompt_length: int
    padded: bool
    prefill: StepCounts
    steps: list[StepCounts]  # decode steps 1..DECODE_STEPS as simulated (the one after them ends generate)
    peak: Line  # bytes above resident, decode step k
    operand: Line
    traffic: Line
    ops: int  # per decode step (the same every step)
    kv_bytes_per_token: int  # what one row's cache grows by per token (all layers, keys and values)
    compute: dict  # (kind, dtype) -> Line
    seconds: float = 0.0
    answered: dict = field(default_factory=dict)
    # Decode steps simulated again on a longer cache (`probed`): what peaks there may not be what
    # peaks at short lengths (DynamicCache's copy of one layer outgrows a fixed temporary, such as
    # bitsandbytes' dequantized weight), so each probe adds its own line, in this run's steps.
    probes: list[GenerationResult] = field(default_factory=list)

    def peak_lines(self) -> list[Line]:
        """The peak's lines in this run's decode steps: this run's and each probe's (a probe whose
        prompt is `offset` tokens longer is at this run's step k + offset at its step k). The peak
        at any step is the most bytes live at one of its ops, each exactly linear in the step: every
        line is one of them, so the peak is at least each line, and is one where simulated."""
        lines = [self.peak]
        for probe in self.probes:
            offset = probe.prompt_length - self.prompt_length
            lines.append(Line(probe.peak.base - probe.peak.per_token * offset, probe.peak.per_token))
        return lines

    def peak_bytes(self, completion: int) -> int:
        """The most `generate` holds above resident for completions of `completion` tokens: the
        prefill, or the last decode step (step completion - 1: the prefill makes the first token)."""
        last = completion - 1
        decode = 0
        if last >= 1:
            simulated = [step.peak_bytes for step in self.steps[:last]]
            decode = max(simulated)
            if last > len(self.steps):
                decode = max(decode, *(int(line.at(last)) for line in self.peak_lines()))
        return max(self.prefill.peak_bytes, decode)

    def longest(self, budget: int, *, granularity: int = 1, limit: int = 1 << 24) -> int | None:
        """The longest completion (a multiple of `granularity`) whose peak is within `budget`;
        None when even the prefill is not."""
        if self.prefill.peak_bytes > budget or self.peak_bytes(granularity) > budget:
            return None
        growing = [line for line in self.peak_lines() if line.per_token > 0]
        if not growing:
            return limit // granularity * granularity
        last = min(int((budget - line.base) // line.per_token) for line in growing)
        completion = min(last + 1, limit) // granularity * granularity
        while completion > granularity and self.peak_bytes(completion) > budget:
            completion -= granularity
        return completion

    def decode_sums(self, completion: int) -> dict:
        """Totals over the decode steps of completions of `completion` tokens: operand and
        traffic bytes, compute by kind, and ops."""
        last = completion - 1
        return {
            "operand_bytes": self.operand.total(1, last),
            "traffic_bytes": self.traffic.total(1, last),
            "compute": {key: line.total(1, last) for key, line in self.compute.items()},
            "ops": self.ops * max(last, 0),
            "steps": max(last, 0),
        }


def _line(values: list[float], what: str, exact: bool) -> Line:
    """The line through decode steps 2..n (values[1:]); the steps must lie on it."""
    points = list(enumerate(values, start=1))[1:]
    (k0, v0), (k1, v1) = points[0], points[1]
    per_token = (v1 - v0) / (k1 - k0)
    base = v0 - per_token * k0
    for k, v in points[2:]:
        expected = base + per_token * k
        off = abs(v - expected)
        if (exact and off != 0) or (not exact and off > 1e-9 * max(abs(v), 1.0)):
            raise RuntimeError(
                f"generate's decode steps do not grow linearly in {what}: step {k} {v} against {expected} on the "
                f"line through steps {k0} and {k1} (the extrapolation to long completions assumes they do)"
            )
    return Line(base, per_token)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """One row's KV cache per token: layers x KV heads x head dimension x 2 (keys, values) x the
    dtype's bytes (every layer full attention)."""
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * heads * head_dim * 2 * torch.empty((), dtype=dtype).element_size()


@contextlib.contextmanager
def _per_forward(model: torch.nn.Module, tracker, on_forward) -> Iterator[None]:
    """Calls `on_forward(index)` as each top-level forward of `model` starts (0: the prefill)."""
    calls = [0]

    def pre(module, args, kwargs):
        on_forward(calls[0])
        calls[0] += 1

    handle = model.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def generation_config_as_trl(model, max_new_tokens: int, extra: dict | None = None):
    """The GenerationConfig GRPOTrainer builds (TRL 1.16, grpo_trainer.py: sampling with its
    defaults, the model's special tokens, no compile), updated by `extra` as
    GRPOConfig.generation_kwargs would be."""
    from transformers import GenerationConfig

    config = model.config.get_text_config()
    eos = config.eos_token_id
    kwargs = dict(
        max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id, eos_token_id=eos, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0, cache_implementation=None,
    )  # fmt: skip
    kwargs.update(extra or {})
    return GenerationConfig(**kwargs, disable_compile=True)


def run_generate(model, base, tracker, *, rows: int, prompt_length: int, padded: bool, max_new_tokens: int,
                 device="meta", generation_kwargs: dict | None = None) -> tuple[list[StepCounts], dict]:  # fmt: skip
    """`model.generate` as TRL calls it, on `rows` prompts of `prompt_length` tokens (the first
    row's first token padding when `padded`), counting each forward's allocations with `tracker`
    (entered by the caller). Returns the counts of each forward (0: the prefill) and the host
    reads answered."""
    from transformers import masking_utils

    from .stand_ins import real_device_masking

    ids = torch.zeros((rows, prompt_length), dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    if padded and device != "meta":
        mask[0, 0] = 0
    config = generation_config_as_trl(model, max_new_tokens, generation_kwargs)
    account = tracker.main
    before = account.live
    counts: list[StepCounts] = []
    ops = _OpCounter()
    marks: list[tuple] = []

    def snapshot() -> tuple:
        return (account.matmul_flops, account.attention_flops, dict(account.compute), account.traffic_bytes,
                account.operand_bytes, ops.ops)  # fmt: skip

    def on_forward(index: int) -> None:
        marks.append(snapshot())
        tracker.tag = (GENERATION, f"step {index}")

    reads = HostReads(max_length=prompt_length + max_new_tokens, padded=padded)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(_per_forward(base, tracker, on_forward))
        if device == "meta":
            stack.enter_context(real_device_masking(padded=padded))
        stack.enter_context(ops)
        if device == "meta":
            stack.enter_context(reads)
        tracker.tag = (GENERATION, "setup")
        output = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        marks.append(snapshot())
        del output
    del masking_utils
    for index in range(len(marks) - 1):
        start, end = marks[index], marks[index + 1]
        compute = {key: end[2].get(key, 0) - start[2].get(key, 0) for key in end[2]}
        counts.append(StepCounts(
            peak_bytes=account.tag_peaks.get((GENERATION, f"step {index}"), 0) - before,
            matmul_flops=end[0] - start[0], attention_flops=end[1] - start[1],
            compute={key: value for key, value in compute.items() if value},
            traffic_bytes=end[3] - start[3], operand_bytes=end[4] - start[4], ops=end[5] - start[5],
        ))  # fmt: skip
    return counts, dict(reads.answered)


def result_from_steps(counts: list[StepCounts], *, rows: int, prompt_length: int, padded: bool, config,
                      kv_dtype: torch.dtype, answered: dict | None = None) -> GenerationResult:  # fmt: skip
    """The prefill and decode steps of one simulated `generate`, with their lines (checked). The
    last step's counts end with generate (no next step's inputs to prepare): its peak is held to
    the line, its counts are not used."""
    prefill, steps, last = counts[0], counts[1:-1], counts[-1]
    if len(steps) < 3:
        raise ValueError(f"four decode steps or more are needed for the lines, got {len(counts) - 1}")
    keys = {key for step in steps for key in step.compute}
    ops = {step.ops for step in steps[1:]}
    if len(ops) != 1:
        raise RuntimeError(f"generate's decode steps ran different numbers of ops: {sorted(ops)}")
    return GenerationResult(
        rows=rows,
        prompt_length=prompt_length,
        padded=padded,
        prefill=prefill,
        steps=steps,
        peak=_line([step.peak_bytes for step in (*steps, last)], "peak bytes", exact=True),
        operand=_line([step.operand_bytes for step in steps], "matmul and attention bytes", exact=True),
        traffic=_line([step.traffic_bytes for step in steps], "memory traffic", exact=True),
        ops=ops.pop(),
        kv_bytes_per_token=kv_bytes_per_token(config, kv_dtype),
        compute={key: _line([step.compute.get(key, 0) for step in steps], f"{key} FLOPs", exact=False)
                 for key in keys},  # fmt: skip
        answered=answered or {},
    )


def probed(simulator, mode, result: GenerationResult, completion: int, *,
           generation_kwargs: dict | None = None) -> GenerationResult:  # fmt: skip
    """`result` with `generate` simulated again where its decode steps hold the cache of a
    completion of `completion` tokens: a prompt longer by what comes before the last step, so the
    probe's simulated steps are this run's steps up to completion - 1 (`peak_lines`)."""
    from dataclasses import replace

    longer = result.prompt_length + max(completion - 1 - DECODE_STEPS, 0)
    if longer == result.prompt_length or any(probe.prompt_length == longer for probe in result.probes):
        return result
    probe = simulator.generate(mode, rows=result.rows, prompt_length=longer, padded=result.padded,
                               generation_kwargs=generation_kwargs)  # fmt: skip
    return replace(result, probes=[*result.probes, probe], seconds=result.seconds + probe.seconds)


def held_at_the_answer(simulator, mode, result: GenerationResult, budget: int, *, granularity: int,
                       cap: int | None = None, tries: int = 3,
                       generation_kwargs: dict | None = None) -> GenerationResult:  # fmt: skip
    """`result` probed at the longest completion it allows within `budget` (no longer than `cap`),
    again where that answer moves, until the answer's own step is simulated (at most `tries`
    probes): the peak there is then as simulated, not extrapolated from a short run."""
    for _ in range(tries):
        found = result.longest(budget, granularity=granularity)
        if found is None:
            return result
        if cap is not None:
            found = min(found, cap)
        if found - 1 <= len(result.steps):
            return result
        again = probed(simulator, mode, result, found, generation_kwargs=generation_kwargs)
        if again is result:
            return result
        result = again
    return result
