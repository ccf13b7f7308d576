"""The loss head (lm_head and the cross-entropy), one slice of the sequence at a time, never holding
the logits of the whole sequence.

A causal LM's forward computes `logits = lm_head(hidden)`, may transform them (Gemma 2's final
softcapping, Cohere's logit scale), and passes them to `self.loss_function`. In a training step
with labels, the tiled loss lets that forward run as written, but lm_head returns
`DeferredLogits`: a tensor of the logits' shape and dtype that holds no memory and records what
the model's code does to it. The loss function then receives the deferred logits and computes
transformers' `ForCausalLMLoss` (float32 upcast, label shift, ignore_index, `num_items_in_batch`)
slice by slice: each slice's logits are computed from the hidden states, put through the
recorded transforms, and dropped; backward recomputes them slice by slice. The output's logits
are None in training, as with Liger's fused linear cross-entropy. An op on the deferred logits
that is not per token (a slice of the vocabulary, a loss computed by the model's own code)
makes them real, and the step runs as without tiling.
"""

from __future__ import annotations

import contextlib
import logging
import types
from dataclasses import dataclass

import torch
from torch import nn

from .. import instance_forward
from .per_token import store_slice_gradients

logger = logging.getLogger("hf_offload")

LOSS_STATE_ATTR = "_hf_offload_tiled_loss"
# Tokens per loss slice, by default: as many as keep a slice's logits within this many elements
# (float32 logits, their log-softmax and gradient for 2**28 elements are about 3 GiB).
LOSS_TILE_ELEMENTS = 2**28
_METADATA = frozenset({torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride})


def loss_tile_tokens(vocab: int) -> int:
    return max(1, LOSS_TILE_ELEMENTS // max(vocab, 1))


class DeferredLogits(torch.Tensor):
    """What lm_head returns in a tiled-loss step: the logits' shape, dtype and device over one
    element of memory, with the ops the model's code applies to them recorded for every slice."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, source: _Source, ops: tuple = ()):
        self = torch.Tensor._make_subclass(cls, like, False)
        self.source = source
        self.ops = ops
        return self

    @classmethod
    def __torch_function__(cls, func, types=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        deferred = next((a for a in args if isinstance(a, DeferredLogits)), None)
        if deferred is None or func in _METADATA or getattr(func, "__name__", "") == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        meta = _meta_like(deferred)
        with torch._C.DisableTorchFunctionSubclass():
            try:
                probe = func(*[meta if a is deferred else a for a in args], **kwargs)
            except Exception:
                probe = None
        if isinstance(probe, torch.Tensor) and probe.shape == deferred.shape and _per_token(args, deferred):
            op = (func, tuple(_Slot if a is deferred else a for a in args), kwargs)
            like = torch.empty((1,) * probe.dim(), dtype=probe.dtype, device=deferred.device).expand(probe.shape)
            return DeferredLogits(like, deferred.source, deferred.ops + (op,))
        # Not a per-token transform: the logits become real, and the step goes on as without tiling.
        deferred.source.note_materialised(func)
        real = deferred.materialise()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*[real if a is deferred else a for a in args], **kwargs)

    def materialise(self) -> torch.Tensor:
        return self.source.logits(self.ops)


class _Slot:
    """Where the deferred logits go in a recorded op."""


def _per_token(args, deferred) -> bool:
    """The other tensor arguments of a recorded op broadcast per token (scalars, per-vocabulary
    vectors), never across tokens."""
    return all(
        not isinstance(a, torch.Tensor) or a is deferred or a.dim() <= 1 or all(s == 1 for s in a.shape[:-1])
        for a in args
    )


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _replay(logits: torch.Tensor, ops: tuple) -> torch.Tensor:
    for func, args, kwargs in ops:
        logits = func(*[logits if a is _Slot else a for a in args], **kwargs)
    return logits


@dataclass
class _Source:
    """The hidden states lm_head was given, and the head itself (whatever module it is now: with
    LoRA on lm_head, PEFT's)."""

    hidden: torch.Tensor
    head: object  # the head module's own forward
    parameters: list[nn.Parameter]
    slot: LossSlot

    def logits(self, ops: tuple) -> torch.Tensor:
        return _replay(self.head(self.hidden), ops)

    def note_materialised(self, func) -> None:
        self.slot.warn_once(
            "materialised",
            f"hf_offload: {self.slot.model_name} applies {getattr(func, '__name__', func)} to its logits, which the "
            "tiled loss cannot do one slice of tokens at a time; its loss runs untiled",
        )


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    # As transformers' ForCausalLMLoss: float32 logits, ignore_index, summed here and divided once.
    logits = logits.float()
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )


@dataclass
class _LossRun:
    source: _Source
    ops: tuple
    labels: torch.Tensor  # shifted, (batch, tokens)
    ignore_index: int
    divisor: torch.Tensor | float
    bounds: list[tuple[int, int]]


class _TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _LossRun, hidden: torch.Tensor, *parameters):
        ctx.run = run
        ctx.parameters = parameters
        ctx.save_for_backward(hidden)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, stop in run.bounds:
            logits = _replay(run.source.head(hidden[:, start:stop]), run.ops)
            total = total + _cross_entropy_sum(logits, run.labels[:, start:stop], run.ignore_index)
            del logits
        return total / run.divisor

    @staticmethod
    def backward(ctx, grad_loss):
        run: _LossRun = ctx.run
        (hidden,) = ctx.saved_tensors
        parameters = ctx.parameters
        wants_hidden = ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None  # every slice writes its part
        sums: list[torch.Tensor | None] = [None] * len(parameters)
        for start, stop in run.bounds:
            with torch.enable_grad():
                leaf = hidden[:, start:stop].detach().requires_grad_(wants_hidden)
                logits = _replay(run.source.head(leaf), run.ops)
                loss = _cross_entropy_sum(logits, run.labels[:, start:stop], run.ignore_index) / run.divisor
            inputs = ([leaf] if wants_hidden else []) + list(parameters)
            found = torch.autograd.grad(loss, inputs, grad_loss, allow_unused=True)
            del logits, loss
            store_slice_gradients(found, grad_hidden, start, stop, sums)
        return (None, grad_hidden, *sums)


class LossSlot:
    """What tiling keeps on the causal LM: the forward it wraps and the tile size."""

    def __init__(self, tile_tokens: int | None, previous_forward, model_name: str) -> None:
        self.tile_tokens = tile_tokens
        self.previous_forward = previous_forward
        self.model_name = model_name
        self.active = True  # False: disabled while another wrapper still holds ours (a pass-through)
        self._warned: set[str] = set()
        self.source: _Source | None = None

    def tile_for(self, model: nn.Module) -> int:
        if self.tile_tokens is not None:
            return self.tile_tokens
        head = model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        return loss_tile_tokens(weight.shape[0] if weight is not None else getattr(model.config, "vocab_size", 1))

    def forward_of(self, model: nn.Module):
        if self.previous_forward is not None:
            return self.previous_forward
        return types.MethodType(type(model).forward, model)

    def warn_once(self, key: str, message: str, level: int = logging.WARNING) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.log(level, message)

    @contextlib.contextmanager
    def deferring(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """For one forward: lm_head returns deferred logits and the loss function computes the
        tiled loss. Both are put back afterwards, whatever happens."""
        head = model.get_output_embeddings()
        previous_head = head.__dict__.get("forward")
        head_forward = previous_head if previous_head is not None else types.MethodType(type(head).forward, head)
        missing = object()
        previous_loss = model.__dict__.get("_loss_function", missing)
        slot = self

        def deferred_head(module, hidden, *args, **kwargs):
            if args or kwargs or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
                return head_forward(hidden, *args, **kwargs)
            parameters = [p for p in module.parameters() if p.requires_grad]
            first = head_forward(hidden[:, :1])  # the logits' dtype and width, for one token
            like = first.detach().expand(hidden.shape[0], hidden.shape[1], first.shape[-1])
            source = _Source(hidden, head_forward, parameters, slot)
            return DeferredLogits(like, source)

        def tiled_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                       shift_labels=None, **kwargs):  # fmt: skip
            if not isinstance(logits, DeferredLogits):
                from transformers.loss.loss_utils import ForCausalLMLoss

                return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels)
            return _tiled_loss(slot, logits, labels, num_items_in_batch, ignore_index, shift_labels)

        head.forward = types.MethodType(deferred_head, head)
        model._loss_function = tiled_loss
        try:
            yield
        finally:
            if previous_head is None:
                head.__dict__.pop("forward", None)
            else:
                head.forward = previous_head
            if previous_loss is missing:
                model.__dict__.pop("_loss_function", None)
            else:
                model._loss_function = previous_loss


def _tiled_loss(slot: LossSlot, logits: DeferredLogits, labels, num_items_in_batch, ignore_index, shift_labels):
    source = logits.source
    hidden = source.hidden
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if num_items_in_batch is None:
        divisor = (shift_labels != ignore_index).sum()
    else:
        divisor = num_items_in_batch.to(hidden.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
    length = hidden.shape[1]
    tile = slot.tile_tokens if slot.tile_tokens is not None else loss_tile_tokens(logits.shape[-1])
    bounds = [(start, min(start + tile, length)) for start in range(0, length, tile)]
    run = _LossRun(source, logits.ops, shift_labels, ignore_index, divisor, bounds)
    slot.warn_once(
        "no_logits",
        f"hf_offload: the tiled loss computes {slot.model_name}'s training loss without the full logits: in "
        "training with labels, outputs.logits is None (as with Liger's fused linear cross-entropy); evaluation "
        "and generate() are untouched",
    )
    return _TiledLoss.apply(run, hidden, *source.parameters)


def _without_deferred(output):
    """The model's output with the deferred logits taken out (None, as Liger's forward returns)."""
    if isinstance(output, DeferredLogits):
        return None
    if isinstance(output, tuple):
        return type(output)(None if isinstance(item, DeferredLogits) else item for item in output)
    keys = getattr(output, "keys", None)
    if callable(keys) and any(isinstance(output[key], DeferredLogits) for key in keys()):
        return type(output)(**{key: value for key, value in output.items() if not isinstance(value, DeferredLogits)})
    return output


def tiled_loss_forward(self: nn.Module, *args, **kwargs):
    """The causal LM's forward, with the tiled loss in a training step with labels (bound to the
    model instance)."""
    slot: LossSlot = self.__dict__[LOSS_STATE_ATTR]
    forward = slot.forward_of(self)
    labels = kwargs.get("labels")
    if not slot.active or labels is None or not (self.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    if torch.is_tensor(labels) and labels.shape[-1] <= slot.tile_for(self):
        return forward(*args, **kwargs)  # one slice: tiling would recompute the head and save nothing
    from transformers.loss.loss_utils import ForCausalLMLoss

    if self.loss_function is not ForCausalLMLoss:
        slot.warn_once(
            "loss_function",
            f"hf_offload: {slot.model_name} computes its loss with {getattr(self.loss_function, '__name__', '?')}, "
            "not transformers' ForCausalLMLoss: the tiled loss leaves it as it is",
        )
        return forward(*args, **kwargs)
    with slot.deferring(self):
        output = forward(*args, **kwargs)
    return _without_deferred(output)


def install(model: nn.Module, tile_tokens: int | None) -> None:
    name = type(model).__name__
    instance_forward.install(
        model, tiled_loss_forward, LOSS_STATE_ATTR, lambda previous: LossSlot(tile_tokens, previous, name)
    )


def uninstall(model: nn.Module) -> None:
    instance_forward.remove(model, tiled_loss_forward, LOSS_STATE_ATTR)


def is_tiled(model: nn.Module) -> bool:
    slot: LossSlot | None = model.__dict__.get(LOSS_STATE_ATTR)
    return slot is not None and slot.active
