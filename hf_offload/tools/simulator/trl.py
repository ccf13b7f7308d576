"""TRL's training step (TRL 1.16), as its trainers run it, for the simulator and on real tensors.

TRL's SFT, DPO and GRPO trainers call `add_fused_lm_head(model)` and then `model(...,
labels=..., fused_lm_head=True)`: the backbone's `last_hidden_state`, then
`ChunkedLogProbFunction`, which scores tokens in tiles of 4,096 tokens x 32,768 vocabulary
entries (`trl/kernels/chunked_logprob.py`). `trl_step` runs that real forward as each trainer
calls it and returns the loss to backpropagate:

- SFT: one forward over the batch; the loss is the mean negative log-probability.
- DPO: the chosen and the rejected rows in one batch (2 x batch rows), then the reference
  forward over the same rows under `no_grad` with checkpointing off (unless
  `precompute_ref_log_probs`): of the separate reference model TRL loads for full fine-tuning
  (or is given), else of the PEFT policy with its adapters disabled (TRL's own `use_adapter` and
  `disable_gradient_checkpointing`); then the sigmoid loss of the log-ratios.
- GRPO: the generation batch's prompt + completion rows (`generation_batch_size` on this GPU)
  held through the step; its old log-probabilities (TRL computes them with vLLM, for its
  importance sampling, or when generation and optimizer steps are misaligned) and reference ones
  (`beta` above 0: a separate reference model without PEFT) under `no_grad` a micro-batch at a
  time; then the policy step on one micro-batch of `batch_size` rows, clipped ratios and the KL
  term. Generation is simulated apart (`generation.py`): it runs before the step, and what it
  holds is gone when the step starts.

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
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from hf_offload.internal import present, replaced, resolve

from .stand_ins import autocast_regions_on_meta

TRAINERS = ("sft", "dpo", "grpo")
KERNELS = ("triton", "torch")
VLLM_MODES = ("colocate", "server")
# What each trainer asks its fused head for (`add_fused_lm_head(..., outputs=...)` in TRL 1.16); a
# separate reference model's head is added with the default, log-probabilities only.
OUTPUTS = {
    "sft": ("log_probs", "entropy", "is_top1"),
    "dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
    "grpo": ("log_probs", "entropy"),
}
REFERENCE_OUTPUTS = ("log_probs",)
DPO_BETA = 0.1  # DPOConfig's
GRPO_EPSILON = 0.2  # GRPOConfig's


# GRPOConfig's own words (TRL 1.16, grpo_config.py's __post_init__), for the checks here and the CLI's.
def too_few_generations(num_generations: int) -> str:
    return ("GRPO requires at least 2 generations per prompt to calculate the advantages. You provided "
            f"{num_generations}, which is less than the minimum required.")  # fmt: skip


def not_divisible_by_generations(generation_batch_size: int, num_generations: int) -> str:
    return f"generation_batch_size ({generation_batch_size}) must be divisible by num_generations ({num_generations})."


def not_divisible_by_batch(generation_batch_size: int, batch_size: int) -> str:
    return f"generation_batch_size ({generation_batch_size}) must be divisible by the global batch size ({batch_size})."


BOTH_GENERATION_SIZES = "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time"


def default_steps_per_generation(batch_size: int, num_generations: int) -> int:
    """GRPOConfig's steps_per_generation defaults to gradient_accumulation_steps; here, to the
    fewest that TRL accepts with `num_generations` (the generation batch, batch_size x steps,
    must hold whole groups of generations): num_generations / gcd(batch_size, num_generations)."""
    return num_generations // math.gcd(batch_size, num_generations)


@dataclass(frozen=True)
class TrlGeneration:
    """How GRPOTrainer generates, as GRPOConfig names it (TRL 1.16's defaults): transformers'
    `generate` on the training model (`use_vllm=False`), or vLLM colocated on the training GPU
    (`vllm_mode="colocate"`, taking `vllm_gpu_memory_utilization` of its memory, freed during the
    step with `vllm_enable_sleep_mode`) or in a server on other GPUs (`vllm_mode="server"`)."""

    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_gpu_memory_utilization: float = 0.3
    vllm_enable_sleep_mode: bool = False
    # LLM(max_model_len=...) as TRL 1.16 passes it (None: vLLM derives it from the model's config).
    vllm_max_model_length: int | None = None
    # The vLLM release assumed (not a GRPOConfig field: what is installed beside TRL); None: the
    # newest TRL 1.16 accepts (`generation_limits`).
    vllm_version: str | None = None

    def __post_init__(self) -> None:
        from hf_offload.tools.generation_limits import DEFAULT_VLLM_VERSION, check_vllm_version

        object.__setattr__(self, "vllm_version", check_vllm_version(self.vllm_version or DEFAULT_VLLM_VERSION))
        if self.vllm_max_model_length is not None and self.vllm_max_model_length < 1:
            raise ValueError(f"vllm_max_model_length must be a positive number of tokens, got "
                             f"{self.vllm_max_model_length}")  # fmt: skip
        if self.vllm_mode not in VLLM_MODES:
            raise ValueError(f"vllm_mode must be one of {', '.join(VLLM_MODES)}, got {self.vllm_mode!r}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(
                f"vllm_gpu_memory_utilization must be a fraction in (0, 1], got {self.vllm_gpu_memory_utilization}"
            )

    @property
    def colocated(self) -> bool:
        return self.use_vllm and self.vllm_mode == "colocate"

    @property
    def on_this_gpu(self) -> bool:
        """Whether generation runs on the training GPU (transformers' generate, or vLLM colocated)."""
        return not self.use_vllm or self.vllm_mode == "colocate"

    def describe(self) -> str:
        if not self.use_vllm:
            return "transformers' generate on the training model (use_vllm=False, TRL's default)"
        if self.vllm_mode == "server":
            return "vLLM in a server on other GPUs (vllm_mode=\"server\")"
        sleep = "sleep mode on" if self.vllm_enable_sleep_mode else "sleep mode off"
        return (f"vLLM colocated (vllm_mode=\"colocate\", vllm_gpu_memory_utilization="
                f"{self.vllm_gpu_memory_utilization:g}, {sleep})")  # fmt: skip


@dataclass(frozen=True)
class TrlStep:
    """Which TRL trainer's step, and its shape beside the sequence length simulated: for SFT that
    length is each row's; for DPO and GRPO it is the completion's, after `prompt_length` tokens
    of prompt (DPO: chosen and rejected each; GRPO: `max_completion_length`). The other fields are
    the trainer configs' of the same names, with their defaults; what TRL would refuse is refused
    here in TRL's words (GRPOConfig's and the trainers' own checks)."""

    trainer: str
    prompt_length: int = 512
    num_generations: int = 8  # GRPO: completions per prompt
    # GRPO: the rows one generation batch holds on this GPU (per_device_train_batch_size x
    # steps_per_generation, generated together and scored before the policy steps through them a
    # batch at a time); None: num_generations.
    generation_batch_size: int | None = None
    grpo_beta: float = 0.0  # GRPOConfig.beta: the KL term's weight; 0 (TRL's default) needs no reference
    # GRPO: the old policy's log-probabilities; None: as TRL decides with the defaults: computed with
    # vLLM (vllm_importance_sampling_correction, on by default), not without (generation aligned to
    # the optimizer's steps, num_iterations 1: TRL reuses the policy's own).
    old_log_probs: bool | None = None
    precompute_ref_log_probs: bool = False  # DPO: reference log-probs computed before training
    ref_model: bool = False  # DPO: a reference model given (DPOTrainer(ref_model=...)): TRL keeps it
    sync_ref_model: bool = False  # DPO, GRPO: the reference synced to the policy (needs one loaded)
    generation: TrlGeneration = TrlGeneration()  # GRPO: how it generates
    kernel: str = "triton"  # "torch": TRL's fallback for devices without Triton (the CPU's)

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {', '.join(TRAINERS)}, got {self.trainer!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")
        if self.prompt_length < 1:
            raise ValueError(f"prompt_length must be >= 1, got {self.prompt_length}")
        if self.grpo_beta < 0:
            raise ValueError(f"grpo_beta must be >= 0, got {self.grpo_beta}")
        if self.trainer == "grpo":
            if self.num_generations < 2:
                raise ValueError(too_few_generations(self.num_generations))
            if self.generation_rows % self.num_generations:
                raise ValueError(not_divisible_by_generations(self.generation_rows, self.num_generations))
        if self.sync_ref_model:
            if self.trainer == "sft":
                raise ValueError("sync_ref_model is DPOConfig's and GRPOConfig's: SFT has no reference model")
            if self.trainer == "dpo" and self.precompute_ref_log_probs:  # DPOTrainer's words
                raise ValueError(
                    "You cannot use `sync_ref_model=True` together with `precompute_ref_log_probs=True`. "
                    "`precompute_ref_log_probs=True` assumes a fixed reference model, but with `sync_ref_model=True` "
                    "the reference model is periodically updated during training, making any precomputed reference "
                    "log-probs stale. Set `precompute_ref_log_probs=False` or disable `sync_ref_model`."
                )
            if self.trainer == "grpo" and not self.grpo_beta:  # GRPOTrainer's words
                raise ValueError(
                    "You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model is not used "
                    "during training. Consequently, GRPOTrainer does not create a `ref_model` instance, and there is "
                    "nothing to synchronize. Please set `sync_ref_model=False`, or set `beta` to a non-zero value."
                )
        if self.trainer != "dpo" and (self.precompute_ref_log_probs or self.ref_model):
            raise ValueError("precompute_ref_log_probs and ref_model are DPO's: give them with trainer='dpo'")

    def check_tuning(self, peft: bool) -> None:
        """What the trainers refuse for a PEFT model: syncing a reference (they keep none to sync)."""
        if peft and self.sync_ref_model:
            name = "DPOTrainer" if self.trainer == "dpo" else "GRPOTrainer"
            raise ValueError(  # the trainer's own words
                "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported. "
                f"With PEFT, {name} does not keep a separate reference model in memory; instead, it recovers "
                "reference behavior by temporarily disabling the adapter. As a result, there is no standalone "
                "`ref_model` instance to synchronize. Use `sync_ref_model=False`, or opt for full fine-tuning if "
                "you need a synced reference model."
            )

    @property
    def generation_rows(self) -> int:
        """GRPO: the rows one generation batch holds on this GPU."""
        return self.num_generations if self.generation_batch_size is None else self.generation_batch_size

    @property
    def computes_old_log_probs(self) -> bool:
        return self.generation.use_vllm if self.old_log_probs is None else self.old_log_probs

    def reference_pass(self) -> bool:
        """Whether the step runs a reference forward (DPO unless precomputed; GRPO with beta above 0)."""
        if self.trainer == "dpo":
            return not self.precompute_ref_log_probs
        return self.trainer == "grpo" and bool(self.grpo_beta)

    def loads_reference(self, peft: bool) -> bool:
        """Whether the trainer keeps a second model on the device: DPO with a `ref_model` given, or
        without PEFT unless the reference log-probs are precomputed; GRPO with beta above 0 without
        PEFT (DPOTrainer and GRPOTrainer load it with `from_pretrained`, in the policy's dtype). With
        PEFT the reference is the policy with its adapters disabled."""
        if self.trainer == "dpo":
            return self.ref_model or (not peft and not self.precompute_ref_log_probs)
        return self.trainer == "grpo" and bool(self.grpo_beta) and not peft

    def row_length(self, seq_len: int) -> int:
        return seq_len if self.trainer == "sft" else self.prompt_length + seq_len

    def describe(self, peft: bool | None = None) -> str:
        reference = ""
        if peft is not None and self.loads_reference(peft):
            reference = ", a reference model beside the policy"
        elif peft is not None and self.reference_pass():
            reference = ", the reference being the policy with its adapters disabled"
        if self.trainer == "sft":
            return "TRL's SFTTrainer step"
        if self.trainer == "dpo":
            precomputed = ", reference log-probs precomputed" if self.precompute_ref_log_probs else ""
            return (f"TRL's DPOTrainer step (chosen and rejected rows after a {self.prompt_length}-token prompt"
                    f"{precomputed}{reference})")  # fmt: skip
        old = "old log-probs" if self.computes_old_log_probs else "no old log-probs"
        return (
            f"TRL's GRPOTrainer step ({self.num_generations} generations per prompt, a generation batch of "
            f"{self.generation_rows} rows after a {self.prompt_length}-token prompt, beta {self.grpo_beta:g}, {old}"
            f"{reference})"
        )


# -- the step -------------------------------------------------------------------------------------


def trl_step(model, step: TrlStep, *, batch_size: int, seq_len: int, device, scoring=None, reference=None,
             phase=None) -> torch.Tensor:  # fmt: skip
    """Run the forward part of `step`'s trainer on `model` (with TRL's fused head added) and return
    its loss. `scoring`, on the meta device, is told how many tokens each fused call scores.
    `reference` is the separate reference model the trainer loaded (`TrlStep.loads_reference`;
    its fused head added too), None where the policy with its adapters disabled is the reference.
    `phase(name)`, where given, is told when the passes under no_grad start ("scoring") and end
    ("forward")."""
    if step.trainer == "sft":
        return _sft(model, batch_size, seq_len, device, scoring)
    if step.trainer == "dpo":
        return _dpo(model, step, batch_size, seq_len, device, scoring, reference, phase or _no_phase)
    return _grpo(model, step, batch_size, seq_len, device, scoring, reference, phase or _no_phase)


def _no_phase(name: str) -> None:
    pass


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


def _reference(model, reference=None):
    """TRL's reference pass: no grad, checkpointing off; then the separate reference model, or the
    PEFT policy with its adapters disabled. Yields the model to score with."""
    disable_gradient_checkpointing = resolve("trl.disable_gradient_checkpointing")
    use_adapter = resolve("trl.use_adapter")

    @contextlib.contextmanager
    def passing():
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(disable_gradient_checkpointing(model, {"use_reentrant": False}))
            if reference is None and hasattr(model, "peft_config"):
                stack.enter_context(use_adapter(model, adapter_name=None))
            yield model if reference is None else reference

    return passing()


def _dpo(model, step, batch_size, seq_len, device, scoring, reference, phase):
    rows, length = 2 * batch_size, step.row_length(seq_len)
    ids = torch.zeros((rows, length), dtype=torch.long, device=device)
    attention_mask = torch.ones_like(ids)
    labels = _completion_labels(ids, step.prompt_length)
    outputs = _score(model, scoring, rows * seq_len, input_ids=ids, attention_mask=attention_mask, labels=labels)
    logps = outputs.log_probs[:, -(length - 1) :].sum(dim=1)
    if step.reference_pass():
        phase("scoring")
        with _reference(model, reference) as scorer:
            scored = _score(scorer, scoring, rows * seq_len, input_ids=ids, attention_mask=attention_mask,
                            labels=labels)  # fmt: skip
            ref_logps = scored.log_probs[:, -(length - 1) :].sum(dim=1)
            del scored
        phase("forward")
    else:  # precomputed before training: two numbers per row, read from the batch
        ref_logps = torch.zeros((rows,), dtype=logps.dtype, device=device)
    chosen, rejected = (logps - ref_logps).chunk(2, dim=0)
    return -torch.nn.functional.logsigmoid(DPO_BETA * (chosen - rejected)).mean()


def _grpo(model, step, batch_size, seq_len, device, scoring, reference, phase):
    length, generations = step.row_length(seq_len), step.generation_rows
    # The generation batch, as GRPOTrainer keeps it between generating and the step: ids, the
    # attention and completion masks, and the per-token log-probabilities computed from it.
    ids = torch.zeros((generations, length), dtype=torch.long, device=device)
    attention_mask = torch.ones_like(ids)
    completion_mask = torch.ones((generations, seq_len), dtype=torch.long, device=device)
    rows = min(batch_size, generations)
    micro_ids, micro_mask = ids[:rows], attention_mask[:rows]
    labels = micro_ids.masked_fill(micro_mask == 0, -100)
    labels[:, :-seq_len] = -100

    def scored_without_grad(scorer) -> torch.Tensor:
        # Every micro-batch of the generation batch runs the same pass; one is run, the rest of the
        # result (what each would add) is allocated beside it.
        out = _score(scorer, scoring, rows * seq_len, input_ids=micro_ids, attention_mask=micro_mask, labels=labels)
        first = out.log_probs[:, -seq_len:]
        del out
        rest = first.new_empty((generations - rows, seq_len))
        return torch.cat([first, rest], dim=0)

    disable_gradient_checkpointing = resolve("trl.disable_gradient_checkpointing")

    old = reference_logps = None
    if step.computes_old_log_probs or step.reference_pass():
        phase("scoring")
        if step.computes_old_log_probs:
            with torch.no_grad(), disable_gradient_checkpointing(model, {"use_reentrant": False}):
                old = scored_without_grad(model)
        if step.reference_pass():
            with _reference(model, reference) as scorer:
                reference_logps = scored_without_grad(scorer)
        phase("forward")
    advantages = torch.zeros((generations,), dtype=torch.float32, device=device)

    outputs = _score(model, scoring, rows * seq_len, input_ids=micro_ids, attention_mask=micro_mask, labels=labels)
    logps = outputs.log_probs[:, -seq_len:]
    del outputs
    mask = completion_mask[:rows]
    ratio = torch.exp(logps - (logps.detach() if old is None else old[:rows]))
    clipped = torch.clamp(ratio, 1 - GRPO_EPSILON, 1 + GRPO_EPSILON)
    advantage = advantages[:rows].unsqueeze(1)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    if reference_logps is not None:
        delta = reference_logps[:rows] - logps
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


@contextlib.contextmanager
def fused_head_as_on_cuda(kernel: str = "triton") -> Iterator[_Scoring]:
    """TRL's fused head on meta tensors as it runs on a CUDA device (module docstring); with
    `kernel="torch"`, its fallback for devices without Triton. Yields the scoring mode, whose
    `valid_tokens` the step sets. Each of TRL's names is checked before any is replaced
    (`hf_offload.integrations.upstream`): a renamed kernel would otherwise run for real on meta."""
    with contextlib.ExitStack() as stack:
        # TRL asks `torch.is_autocast_enabled(device.type)`, which PyTorch refuses for "meta".
        stack.enter_context(autocast_regions_on_meta())
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
def fused_head_added(model: torch.nn.Module, trainer: str, *, reference: bool = False) -> Iterator[None]:
    """`add_fused_lm_head` on `model` (a transformers model: TRL adds it below PEFT) with the
    trainer's outputs (a separate reference model's: the default, log-probabilities only); undone
    after (TRL never removes it: it sets the instance's `forward`)."""
    add_fused_lm_head = resolve("trl.add_fused_lm_head")

    had = "forward" in model.__dict__
    before = model.__dict__.get("forward")
    add_fused_lm_head(model, outputs=REFERENCE_OUTPUTS if reference else OUTPUTS[trainer])
    try:
        yield
    finally:
        if had:
            model.forward = before
        else:
            del model.forward
