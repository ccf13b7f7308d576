"""TRL's training step (TRL 1.16), as its trainers run it, for the simulator and on real tensors.

TRL's SFT, DPO and GRPO trainers call `add_fused_lm_head(model)` and then `model(...,
labels=..., fused_lm_head=True)`: the backbone's `last_hidden_state`, then
`ChunkedLogProbFunction`, which scores tokens in tiles of 4,096 tokens x 32,768 vocabulary
entries (`trl/kernels/chunked_logprob.py`). `trl_step` runs that real forward as each trainer
calls it and returns the loss to backpropagate:

- SFT: one forward over the batch; the loss is the mean negative log-probability.
- DPO: the chosen and the rejected rows in one batch (2 x batch rows), then the reference
  forward over the same rows under `no_grad` with checkpointing off and, for a PEFT model, the
  adapters disabled (TRL's own `use_adapter` and `disable_gradient_checkpointing`), then the
  sigmoid loss of the log-ratios.
- GRPO: the generation batch's prompt + completion rows (`num_generations`) held through the
  step; its old and reference log-probabilities under `no_grad` a micro-batch at a time (with
  vLLM TRL always computes the old ones, for its importance sampling; the reference ones when
  `beta` is not 0, as DeepSeek-R1's recipe has it); then the policy step on one micro-batch of
  `batch_size` rows, clipped ratios and the KL term. Generation itself (vLLM, in server mode on
  other GPUs or colocated) is outside the step: not simulated.

On the meta device `fused_head_as_on_cuda` answers what TRL asks of a CUDA device there
(`stand_ins`' job for the rest of the step): whether autocast is on, that Triton runs (so only
the rows with a label are scored, and the fp32 gradient products accumulate with cuBLAS's
`out_dtype`), and its two Triton kernels, which allocate nothing: the forward folds each tile
into seven float32 per-token statistics allocated before it, the backward overwrites the tile
in place. `kernel="torch"` keeps TRL's fallback for devices without Triton, which is what runs
on a CPU: the simulated step is then checked against real CPU allocations.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from hf_offload.internal import present, replaced, resolve

TRAINERS = ("sft", "dpo", "grpo")
KERNELS = ("triton", "torch")
# What each trainer asks its fused head for (`add_fused_lm_head(..., outputs=...)` in TRL 1.16).
OUTPUTS = {
    "sft": ("log_probs", "entropy", "is_top1"),
    "dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
    "grpo": ("log_probs", "entropy"),
}
DPO_BETA = 0.1  # DPOConfig's
GRPO_EPSILON = 0.2  # GRPOConfig's


@dataclass(frozen=True)
class TrlStep:
    """Which TRL trainer's step, and its shape beside the sequence length simulated: for SFT that
    length is each row's; for DPO and GRPO it is the completion's, after `prompt_length` tokens
    of prompt (DPO: chosen and rejected each; GRPO: `max_completion_length`)."""

    trainer: str
    prompt_length: int = 512
    num_generations: int = 8  # GRPO: the rows one generation batch holds on this GPU
    grpo_beta: float = 0.04  # GRPO: the KL term's weight; 0 computes no reference log-probs
    # GRPO: the old policy's log-probabilities, which TRL computes with vLLM (its importance
    # sampling) or when generation and optimizer steps are misaligned; without, it reuses the policy's.
    old_log_probs: bool = True
    kernel: str = "triton"  # "torch": TRL's fallback for devices without Triton (the CPU's)

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {', '.join(TRAINERS)}, got {self.trainer!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")
        if self.prompt_length < 1:
            raise ValueError(f"prompt_length must be >= 1, got {self.prompt_length}")
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {self.num_generations}")
        if self.grpo_beta < 0:
            raise ValueError(f"grpo_beta must be >= 0, got {self.grpo_beta}")

    def row_length(self, seq_len: int) -> int:
        return seq_len if self.trainer == "sft" else self.prompt_length + seq_len

    def describe(self) -> str:
        if self.trainer == "sft":
            return "TRL's SFTTrainer step"
        if self.trainer == "dpo":
            return f"TRL's DPOTrainer step (chosen and rejected rows after a {self.prompt_length}-token prompt)"
        old = "old log-probs" if self.old_log_probs else "no old log-probs"
        return (
            f"TRL's GRPOTrainer step ({self.num_generations} generations after a {self.prompt_length}-token prompt, "
            f"beta {self.grpo_beta:g}, {old}; generation itself not simulated)"
        )


# -- the step -------------------------------------------------------------------------------------


def trl_step(model, step: TrlStep, *, batch_size: int, seq_len: int, device, scoring=None) -> torch.Tensor:
    """Run the forward part of `step`'s trainer on `model` (with TRL's fused head added) and return
    its loss. `scoring`, on the meta device, is told how many tokens each fused call scores."""
    if step.trainer == "sft":
        return _sft(model, batch_size, seq_len, device, scoring)
    if step.trainer == "dpo":
        return _dpo(model, step, batch_size, seq_len, device, scoring)
    return _grpo(model, step, batch_size, seq_len, device, scoring)


def _score(model, scoring, valid: int, **inputs):
    if scoring is not None:
        scoring.valid_tokens = valid
    return model(**inputs, fused_lm_head=True)


def _sft(model, batch_size, seq_len, device, scoring):
    ids = torch.zeros((batch_size, seq_len), dtype=torch.long, device=device)
    outputs = _score(model, scoring, batch_size * (seq_len - 1), input_ids=ids, labels=ids)
    per_token_loss = -outputs.log_probs
    return per_token_loss.sum() / outputs.label_mask.sum().clamp(min=1)


def _completion_labels(ids: torch.Tensor, prompt_length: int) -> torch.Tensor:
    labels = ids.clone()
    labels[:, :prompt_length] = -100
    return labels


def _reference(model):
    """TRL's reference pass: no grad, checkpointing off, a PEFT model's adapters disabled."""
    disable_gradient_checkpointing = resolve("trl.disable_gradient_checkpointing")
    use_adapter = resolve("trl.use_adapter")

    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(disable_gradient_checkpointing(model, {"use_reentrant": False}))
    if hasattr(model, "peft_config"):
        stack.enter_context(use_adapter(model, adapter_name=None))
    return stack


def _dpo(model, step, batch_size, seq_len, device, scoring):
    rows, length = 2 * batch_size, step.row_length(seq_len)
    ids = torch.zeros((rows, length), dtype=torch.long, device=device)
    labels = _completion_labels(ids, step.prompt_length)
    outputs = _score(model, scoring, rows * seq_len, input_ids=ids, labels=labels)
    logps = outputs.log_probs[:, -(length - 1) :].sum(dim=1)
    with _reference(model):
        reference = _score(model, scoring, rows * seq_len, input_ids=ids, labels=labels)
        ref_logps = reference.log_probs[:, -(length - 1) :].sum(dim=1)
        del reference
    chosen, rejected = (logps - ref_logps).chunk(2, dim=0)
    return -torch.nn.functional.logsigmoid(DPO_BETA * (chosen - rejected)).mean()


def _grpo(model, step, batch_size, seq_len, device, scoring):
    length, generations = step.row_length(seq_len), step.num_generations
    # The generation batch, as GRPOTrainer keeps it between generating and the step: ids, the
    # attention and completion masks, and the per-token log-probabilities computed from it.
    ids = torch.zeros((generations, length), dtype=torch.long, device=device)
    attention_mask = torch.ones_like(ids)
    completion_mask = torch.ones((generations, seq_len), dtype=torch.long, device=device)
    rows = min(batch_size, generations)
    micro_ids, micro_mask = ids[:rows], attention_mask[:rows]
    labels = micro_ids.masked_fill(micro_mask == 0, -100)
    labels[:, :-seq_len] = -100

    def scored_without_grad() -> torch.Tensor:
        # Every micro-batch of the generation batch runs the same pass; one is run, the rest of the
        # result (what each would add) is allocated beside it.
        out = _score(model, scoring, rows * seq_len, input_ids=micro_ids, attention_mask=micro_mask, labels=labels)
        first = out.log_probs[:, -seq_len:]
        del out
        rest = first.new_empty((generations - rows, seq_len))
        return torch.cat([first, rest], dim=0)

    disable_gradient_checkpointing = resolve("trl.disable_gradient_checkpointing")

    old = None
    if step.old_log_probs:
        with torch.no_grad(), disable_gradient_checkpointing(model, {"use_reentrant": False}):
            old = scored_without_grad()
    reference = None
    if step.grpo_beta:
        with _reference(model):
            reference = scored_without_grad()
    advantages = torch.zeros((generations,), dtype=torch.float32, device=device)

    outputs = _score(model, scoring, rows * seq_len, input_ids=micro_ids, attention_mask=micro_mask, labels=labels)
    logps = outputs.log_probs[:, -seq_len:]
    del outputs
    mask = completion_mask[:rows]
    ratio = torch.exp(logps - (logps.detach() if old is None else old[:rows]))
    clipped = torch.clamp(ratio, 1 - GRPO_EPSILON, 1 + GRPO_EPSILON)
    advantage = advantages[:rows].unsqueeze(1)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    if reference is not None:
        delta = reference[:rows] - logps
        per_token = per_token + step.grpo_beta * (torch.exp(delta) - delta - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


# -- TRL's fused head on the meta device, as on CUDA -----------------------------------------------


class _NoAllocationKernel:
    """A Triton kernel launched as `kernel[grid](...)` that writes only into the tensors it is given
    (TRL's `_forward_kernel` and `_backward_kernel`): on meta tensors, nothing to do."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _MaskedRows(torch.autograd.Function):
    """`source[mask]` for a boolean meta mask of `count` true entries: a fresh tensor of the rows
    selected, and in backward a zero gradient of `source`'s shape with the rows put back."""

    @staticmethod
    def forward(ctx, source, mask_dims: int, count: int):
        ctx.shape = source.shape
        return source.new_empty((count, *source.shape[mask_dims:]))

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(ctx.shape), None, None


class _Scoring(TorchFunctionMode):
    """Selects the rows a boolean meta mask keeps: meta tensors hold no data, so the count of
    scored tokens comes from `trl_step` (`valid_tokens`, set before each fused call)."""

    valid_tokens: int | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            source, index = args
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.is_meta:
                if self.valid_tokens is None:
                    raise RuntimeError("a boolean mask on the meta device: the tokens it keeps were not given")
                return _MaskedRows.apply(source, index.dim(), self.valid_tokens)
        return func(*args, **kwargs)


_HALF = (torch.float16, torch.bfloat16)


def _autocast_answers() -> list[tuple[object, str, object]]:
    """TRL asks `torch.is_autocast_enabled(device.type)`, which PyTorch refuses for "meta"; the
    CPU's autocast stands for CUDA's in the simulated step (`stand_ins.autocast_as_on_cuda`)."""
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def is_autocast_enabled(device_type=None):
        if device_type is None:
            return enabled()
        return enabled("cpu" if device_type == "meta" else device_type)

    def get_autocast_dtype(device_type):
        return dtype("cpu" if device_type == "meta" else device_type)

    return [(torch, "is_autocast_enabled", is_autocast_enabled), (torch, "get_autocast_dtype", get_autocast_dtype)]


@contextlib.contextmanager
def fused_head_as_on_cuda(kernel: str = "triton") -> Iterator[_Scoring]:
    """TRL's fused head on meta tensors as it runs on a CUDA device (module docstring); with
    `kernel="torch"`, its fallback for devices without Triton. Yields the scoring mode, whose
    `valid_tokens` the step sets. Each of TRL's names is checked before any is replaced
    (`hf_offload.integrations.upstream`): a renamed kernel would otherwise run for real on meta."""
    with contextlib.ExitStack() as stack:
        for owner, name, value in _autocast_answers():
            stack.enter_context(_attribute(owner, name, value))
        if kernel == "triton":
            use_triton, addmm_fp32 = resolve("trl.use_triton"), resolve("trl.addmm_fp32")

            def as_on_cuda(device: torch.device) -> bool:
                return device.type == "meta" or use_triton(device)

            def accumulate(acc, a, b):
                if acc.is_meta and a.dtype in _HALF:  # cuBLAS accumulates the half inputs' product in fp32
                    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                else:
                    addmm_fp32(acc, a, b)

            stand_ins = {
                "trl.use_triton": as_on_cuda,
                "trl.trainer_use_triton": as_on_cuda,
                "trl.addmm_fp32": accumulate,
                "trl.forward_kernel": _NoAllocationKernel(),
                "trl.backward_kernel": _NoAllocationKernel(),
            }
            for entry in stand_ins:  # all checked before any is replaced
                resolve(entry)
            for entry, value in stand_ins.items():
                stack.enter_context(replaced(entry, value))
            if not present("trl.triton_cdiv"):  # TRL launches its backward grid with triton.cdiv
                chunked_logprob = importlib.import_module("trl.kernels.chunked_logprob")
                stack.enter_context(_attribute(chunked_logprob, "triton", _Cdiv()))
        scoring = _Scoring()
        with scoring:
            yield scoring


@contextlib.contextmanager
def _attribute(owner, name: str, value) -> Iterator[None]:
    """`owner.name` is `value` within the block (torch's own names, and what TRL lacks without Triton)."""
    saved = getattr(owner, name, _MISSING)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if saved is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)


_MISSING = object()


class _Cdiv:
    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)


@contextlib.contextmanager
def fused_head_added(model: torch.nn.Module, trainer: str) -> Iterator[None]:
    """`add_fused_lm_head` on `model` (a transformers model: TRL adds it below PEFT) with the
    trainer's outputs; undone after (TRL never removes it: it sets the instance's `forward`)."""
    add_fused_lm_head = resolve("trl.add_fused_lm_head")

    had = "forward" in model.__dict__
    before = model.__dict__.get("forward")
    add_fused_lm_head(model, outputs=OUTPUTS[trainer])
    try:
        yield
    finally:
        if had:
            model.forward = before
        else:
            del model.forward
