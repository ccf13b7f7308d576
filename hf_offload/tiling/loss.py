"""The loss head (lm_head and the cross-entropy), one slice of the sequence at a time, never holding
the logits of the whole sequence.

A causal LM's forward computes `logits = lm_head(hidden)`, may transform them (Gemma 2's final
softcapping, Cohere's logit scale), and passes them to `self.loss_function`. In a training step
with labels, the tiled loss lets that forward run as written, but lm_head returns
`DeferredLogits`: a tensor of the logits' shape and dtype that holds no memory and records what
the model's code does to it. The loss function then receives the deferred logits and computes
transformers' `ForCausalLMLoss` (float32 upcast, label shift, ignore_index, `num_items_in_batch`)
slice by slice: each slice's logits are computed by calling lm_head (its hooks run: ZeRO-3
gathers its weight, FSDP unshards it), put through the recorded transforms, and dropped;
backward recomputes them slice by slice, under the forward's autocast and random state.

Only transforms known to act on each token alone are recorded (elementwise arithmetic, casts,
tanh, ...; their other operands scalars or per-vocabulary vectors; a learnable one gets its
gradient). Anything else on the deferred logits makes them real, and the step runs as without
tiling, said once; an in-place transform that is not per token is recorded and makes the logits
real when the loss needs them. The output's logits are None in training, as with Liger's fused
linear cross-entropy.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from dataclasses import dataclass

import torch
from torch import nn

from .. import auto_budget, instance_forward
from ..compiling import under_torch_compile
from ..integrations.trl import fused_head_notice, in_trl_fused_head
from . import per_token
from .gradients import Targets, backward_by_slices, refuse_double_backward
from .replay import Replay, eval_mode_with_grad, say_eval_mode_runs_whole, tiles_loss

logger = logging.getLogger("hf_offload")

LOSS_STATE_ATTR = "_hf_offload_tiled_loss"
# Tokens per loss slice, by default: as many as keep a slice's logits within this many elements
# (float32 logits, their log-softmax and gradient for 2**28 elements are about 3 GiB),
LOSS_TILE_ELEMENTS = 2**28
# and, like every default slice of tiling's, within this share of the device's memory (here at 12
# bytes an element): 0.33 GiB on a 16 GB GPU instead of 3 GiB, a fifth of it.
SLICE_DEVICE_SHARE = 1 / 48
LOSS_BYTES_PER_ELEMENT = 12
# Questions about the tensor that the deferred logits answer as the real ones would, and about
# their memory, which they answer for themselves, as any tensor would: the little storage they
# have (one token's logits at most), for a hook on lm_head that measures or deduplicates outputs by
# storage (making the logits real to answer would untile the loss, and inside the tiled loss's own
# calls of lm_head cannot).
_METADATA = frozenset(
    {
        torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.is_floating_point,
        torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.get_device, torch.Tensor.untyped_storage,
        torch.Tensor.data_ptr, torch.Tensor.storage_offset,
    }
)  # fmt: skip
_UNDER_COMPILE = "the tiled loss head runs eagerly: torch.compile breaks the graph there"

# Ops whose output for a token depends on that token's logits alone (given operands that broadcast
# per token), by name without underscores or the reflected/in-place prefix.
_PER_TOKEN_OPS = frozenset(
    {
        "mul", "div", "true_divide", "add", "sub", "neg", "pow", "tanh", "sigmoid", "exp", "log", "abs", "sqrt",
        "rsqrt", "clamp", "clamp_min", "clamp_max", "clip", "float", "half", "bfloat16", "double", "to", "type_as",
        "contiguous", "clone",
    }
)  # fmt: skip
_REFLECTED = frozenset({"mul", "div", "truediv", "add", "sub", "pow"})


# Off only to measure what tiling the final norm (chained with lm_head where it can be) buys
# (`hf_offload.internal`): off, it runs whole.
CHAIN_FINAL_NORM = True


def loss_tile_tokens(vocab: int, device: torch.device | None = None) -> int:
    """The default tokens per loss slice for this vocabulary on `device` (its memory read once per
    step; none on the CPU)."""
    elements = LOSS_TILE_ELEMENTS
    total = None if device is None else auto_budget.total_device_memory(device)
    if total is not None:
        elements = min(elements, int(total * SLICE_DEVICE_SHARE) // LOSS_BYTES_PER_ELEMENT)
    return max(1, elements // max(vocab, 1))


def _op_name(func) -> tuple[str, bool]:
    """(the op's plain name, whether it works in place): `__rmul__` -> mul, `__itruediv__` -> div,
    `mul_` -> mul in place."""
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name == "setitem":  # logits[..., k] = v
            return name, True
        for prefix in ("r", "i"):
            if name.startswith(prefix) and name[1:] in _REFLECTED:
                return ("div" if name[1:] == "truediv" else name[1:]), prefix == "i"
        return ("div" if name == "truediv" else name), False
    if name.endswith("_") and not name.startswith("_"):
        return name[:-1], True
    return name, False


def _per_token_operands(args, kwargs, deferred) -> bool:
    """The other tensor operands broadcast per token (scalars, per-vocabulary vectors), never
    across tokens."""
    return all(
        not isinstance(a, torch.Tensor) or a is deferred or a.dim() <= 1 or all(s == 1 for s in a.shape[:-1])
        for a in (*args, *kwargs.values())
    )


def _on_meta(value):
    return torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, torch.Tensor) else value


class DeferredLogits(torch.Tensor):
    """What lm_head returns in a tiled-loss step: the logits' shape, dtype and device over one
    element of memory, with the ops the model's code applies to them recorded for every slice."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, source: _Source, ops: tuple = (), whole: str | None = None):
        self = torch.Tensor._make_subclass(cls, like, False)
        self.source = source
        self.ops = ops
        self.whole = whole  # the op, not per token, applied in place: only real logits will do
        return self

    @classmethod
    def __torch_function__(cls, func, types=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        deferred = next((a for a in (*args, *kwargs.values()) if isinstance(a, DeferredLogits)), None)
        if deferred is None or func in _METADATA or getattr(func, "__name__", "") == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name, in_place = _op_name(func)
        if name == "detach" and args and args[0] is deferred:  # module hooks detach outputs (ZeRO-3's)
            return DeferredLogits(deferred, deferred.source, deferred.ops, deferred.whole)
        if name == "getitem" and len(args) == 2 and args[0] is deferred and _selects_everything(args[1]):
            return deferred  # hidden_states[:, slice(-0, None), :]: logits_to_keep=0 keeps every position
        per_token = name in _PER_TOKEN_OPS and not deferred.whole and _per_token_operands(args, kwargs, deferred)
        if per_token:
            with torch._C.DisableTorchFunctionSubclass():
                try:
                    probe = func(*[_on_meta(a) for a in args], **{k: _on_meta(v) for k, v in kwargs.items()})
                except Exception:
                    probe = None
            per_token = isinstance(probe, torch.Tensor) and probe.shape == deferred.shape
        if in_place and args and args[0] is deferred:
            # The model's code keeps using this very object: record the op on it.
            deferred.ops = deferred.ops + ((func, *_recorded(args, kwargs, deferred)),)
            if not per_token or probe.dtype != deferred.dtype:
                deferred.whole = deferred.whole or getattr(func, "__name__", str(func))
            return deferred
        if per_token:
            op = (func, *_recorded(args, kwargs, deferred))
            like = torch.empty((1,) * probe.dim(), dtype=probe.dtype, device=deferred.device).expand(probe.shape)
            return DeferredLogits(like, deferred.source, deferred.ops + (op,))
        # Not a per-token transform: the logits (every deferred operand) become real, and the step
        # goes on as without tiling.
        deferred.source.note_materialised(func)

        def real(value):
            return value.materialise() if isinstance(value, DeferredLogits) else value

        with torch._C.DisableTorchFunctionSubclass():
            return func(*[real(a) for a in args], **{name: real(value) for name, value in kwargs.items()})

    def materialise(self) -> torch.Tensor:
        """The real logits (kept: the model's output returns them, as without tiling)."""
        real = self.__dict__.get("materialised")
        if real is None:
            if self.source.hidden is None:  # handed to lm_head's hooks by the tiled loss's own calls
                raise RuntimeError(
                    f"hf_offload: a forward hook on {self.source.slot.model_name}'s lm_head asked for the whole "
                    "logits inside the tiled loss's own call of lm_head, which computes them one slice at a time; "
                    "keep the loss untiled (enable_sequence_tiling(loss=False)) for such a hook"
                )
            real = self.materialised = self.source.logits(self.ops)
        return real

    def learnable_operands(self) -> list[torch.Tensor]:
        """Tensors the recorded ops use that need a gradient (a learnable logit scale)."""
        return [a for _func, args, kwargs in self.ops for a in (*args, *kwargs.values()) if _needs_grad(a)]


def _selects_everything(index) -> bool:
    """An index that keeps every element: full slices and an Ellipsis."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(
        part is Ellipsis or (isinstance(part, slice) and part.step in (None, 1) and part.start in (None, 0)
                             and part.stop is None)
        for part in parts
    )  # fmt: skip


def _needs_grad(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _recorded(args, kwargs, deferred) -> tuple[tuple, dict]:
    """The op's arguments with the deferred logits, positional or by keyword, replaced by `_Slot`."""
    return tuple(_Slot if a is deferred else a for a in args), {
        k: _Slot if v is deferred else v for k, v in kwargs.items()
    }


class _Slot:
    """Where the deferred logits go in a recorded op."""


def _replay(logits: torch.Tensor, ops: tuple) -> torch.Tensor:
    for func, args, kwargs in ops:
        result = func(
            *[logits if a is _Slot else a for a in args], **{k: logits if v is _Slot else v for k, v in kwargs.items()}
        )
        logits = logits if result is None else result  # `__setitem__` changes them and returns nothing
    return logits


@dataclass
class _Stage:
    """A module the deferred computation runs, and the forward its call ran (inside that call,
    hooks around it)."""

    module: nn.Module
    forward: object


@dataclass
class _Source:
    """The hidden states the stages start from (the final norm's input where lm_head took the
    final norm's output, else lm_head's), the stages (the final norm, lm_head: whatever modules
    they are now, with LoRA on lm_head PEFT's), and the tensors they need gradients for, found
    inside their calls.

    The slices are computed by the stages' forwards, inside one call of lm_head (`inside_a_call`):
    its hooks run around them, once, as around any call (ZeRO-3 gathers the weight, FSDP unshards
    it, a user's hook sees a call on the whole sequence), and the ops recorded on lm_head's
    deferred output, those of its own output hooks included, are replayed on every slice. The
    final norm is a stage only where it has no hooks (`_DeferredStep`): what a hook does to its
    output is not recorded. Forwards that wrap a stage's (accelerate's device hooks) are part of
    that forward, and run for every slice."""

    hidden: torch.Tensor
    stages: tuple[_Stage, ...]
    targets: Targets
    like: torch.Tensor  # the last stage's output: shape and dtype, over one element
    slot: LossSlot
    in_call: bool = True  # until the last stage's call returns: its hooks may still be recording

    def through(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's output for `hidden` (the whole sequence's or a slice's)."""
        for stage in self.stages:
            hidden = stage.forward(hidden)
        return hidden

    def inside_a_call(self, work, hidden: torch.Tensor | None = None):
        """`work()`, run inside one call of lm_head (the last stage) on the whole hidden states
        (`hidden`, or the source's own). The final norm chained before it has no hooks of its own
        (else it is not chained) and is not called here: torch's global hooks see it once, in the
        model's own call, with its real output, not here with a stand-in shaped as the logits."""
        hidden = self.hidden if hidden is None else hidden
        return _call_running(self.stages[-1].module, work, hidden, DeferredLogits(self.like, self))

    def logits(self, ops: tuple) -> torch.Tensor:
        """The last stage's whole output, after `ops`."""
        if self.in_call and len(self.stages) == 1:  # a hook of the stage's call: its parameters are there
            return _replay(self.through(self.hidden), ops)
        return self.inside_a_call(lambda: _replay(self.through(self.hidden), ops))

    def note_materialised(self, func) -> None:
        name = func if isinstance(func, str) else getattr(func, "__name__", func)
        self.slot.warn_once(
            "materialised",
            f"hf_offload: {self.slot.model_name} applies {name} to its logits, which the tiled loss cannot do one "
            "slice of tokens at a time; its loss runs untiled",
        )


def _call_running(module: nn.Module, work, hidden: torch.Tensor, stand_in: DeferredLogits):
    """What `work()` returns, run as the forward of one call of `module` on `hidden`: the module's
    hooks run around it (ZeRO-3 gathers the weight, FSDP unshards it) and see `stand_in`, deferred
    logits that hold nothing, as its output (what they return is dropped). A module-level function,
    not a closure over itself: a reference cycle would keep what `work` returned alive until the
    garbage collector runs."""
    done: list = []

    def forward(*_args, **_kwargs):
        done.append(work())
        return stand_in

    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        module(hidden)
    finally:
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous
    return done.pop()


def _end_of_head_call(module: nn.Module, args, output) -> None:
    """lm_head's last forward hook while the model's forward defers its logits."""
    if isinstance(output, DeferredLogits):
        output.source.in_call = False


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
    targets: Targets
    replay: Replay | None = None

    def slice_loss(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        logits = _replay(self.source.through(hidden), self.ops)
        return _cross_entropy_sum(logits, self.labels[:, start:stop], self.ignore_index)


class _TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _LossRun, hidden: torch.Tensor, *target_tensors: torch.Tensor):
        ctx.run = run
        ctx.save_for_backward(hidden)
        run.replay = Replay(hidden.device)

        def slices():
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            last = len(run.bounds) - 1
            for index, (start, stop) in enumerate(run.bounds):
                total = total + run.slice_loss(hidden[:, start:stop], start, stop)
                run.replay.slice_done(last=index == last)
            return total

        return run.source.inside_a_call(slices, hidden) / run.divisor

    @staticmethod
    def backward(ctx, grad_loss):
        run: _LossRun = ctx.run
        refuse_double_backward(f"{run.source.slot.model_name}'s tiled loss head")
        (hidden,) = ctx.saved_tensors

        def recompute(index: int, leaf: torch.Tensor):
            start, stop = run.bounds[index]
            return [(run.slice_loss(leaf, start, stop) / run.divisor, grad_loss)]

        grad_hidden, sums = run.source.inside_a_call(
            lambda: backward_by_slices(
                hidden, run.bounds, ctx.needs_input_grad[1], run.targets, run.replay.replaying, recompute
            ),
            hidden,
        )
        return (None, grad_hidden, *sums)


class LossSlot:
    """What tiling keeps on the causal LM: the forward it wraps and the tile size."""

    def __init__(self, tile_tokens: int | None, previous_forward, model_name: str, final_norm=None,
                 said: set | None = None) -> None:  # fmt: skip
        self.tile_tokens = tile_tokens
        self.previous_forward = previous_forward
        self.model_name = model_name
        self.final_norm = final_norm  # run slice by slice with lm_head (None: not found, or not asked for)
        self.active = True  # False: disabled while another wrapper still holds ours (a pass-through)
        self._warned: set[str] = set()
        self.said = set() if said is None else said  # the model's notices said, shared with its tiled modules
        self.backbone_hook = None  # the backbone's pre-hook that notices TRL's fused head

    def __getstate__(self) -> dict:
        # A pickled or deep-copied model says its notices again (and its copied backbone carries
        # the copy's own hook).
        return {**self.__dict__, "_warned": set()}

    def tile_for(self, model: nn.Module) -> int:
        if self.tile_tokens is not None:
            return self.tile_tokens
        head = model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        vocab = weight.shape[0] if weight is not None else getattr(model.config, "vocab_size", 1)
        return loss_tile_tokens(vocab, None if weight is None else weight.device)

    def forward_of(self, model: nn.Module):
        if self.previous_forward is not None:
            return self.previous_forward
        return types.MethodType(type(model).forward, model)

    def warn_once(self, key: str, message: str, level: int = logging.WARNING) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.log(level, message)


_MISSING = object()


@dataclass
class _NormCall:
    """The final norm's last call in a deferred step: what lm_head may have been given."""

    input: torch.Tensor | None  # None: called with more than the hidden states
    output: object
    forward: object  # the forward that call ran, less tiling's per-token wrapper
    targets: Targets


class _DeferredStep:
    """One forward of the causal LM in a tiled-loss step, entered around it: lm_head's calls
    return deferred logits (`_deferred_head`), computed from the final norm's input where lm_head
    is given the final norm's output (the norm then runs slice by slice with it), and the model's
    loss function computes the tiled loss (`_loss`). Leaving puts back lm_head's forward and the
    loss function and removes the hooks it put on, whatever happened.

    The final norm itself runs as written (some models call it elsewhere too, before or between
    their layers; tiled, a slice at a time): its last output, if lm_head takes it, is used no
    further, so its graph is freed with the forward's locals. A norm with hooks of its own is not
    chained: its hooks see, and may change, its output on the whole sequence, which the slices
    computed from its input would not replay (it runs tiled on its own)."""

    def __init__(self, slot: LossSlot, model: nn.Module) -> None:
        self.slot, self.model = slot, model
        self.head = model.get_output_embeddings()
        self.head_forward = _own_forward(self.head)
        norm = slot.final_norm
        self.norm = norm if norm is not None and not _has_hooks(norm) else None  # chained where it is called
        self.norm_call: _NormCall | None = None
        self._previous: tuple = ()
        self._handles: list = []

    def __enter__(self) -> _DeferredStep:
        head, model, norm = self.head, self.model, self.norm
        self._previous = (head.__dict__.get("forward", _MISSING), model.__dict__.get("_loss_function", _MISSING))
        self._handles = [head.register_forward_hook(_end_of_head_call, always_call=True)]  # its last hook
        if norm is not None:
            self._handles.append(norm.register_forward_pre_hook(self._norm_called, with_kwargs=True))
            self._handles.append(norm.register_forward_hook(self._norm_returned, with_kwargs=True))
        head.forward = self._deferred_head
        model._loss_function = self._loss
        return self

    def __exit__(self, *exc_info) -> None:
        self.norm_call = None
        for handle in self._handles:
            handle.remove()
        for owner, name, previous in zip((self.head, self.model), ("forward", "_loss_function"), self._previous,
                                         strict=True):  # fmt: skip
            if previous is _MISSING:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, previous)

    def _norm_called(self, module: nn.Module, args, kwargs) -> None:
        hidden = args[0] if len(args) == 1 and not kwargs else None
        self.norm_call = _NormCall(hidden, None, _untiled_forward(module), Targets.of(module))

    def _norm_returned(self, module: nn.Module, args, kwargs, output) -> None:
        if self.norm_call is not None:
            self.norm_call.output = output

    @torch.compiler.disable(reason=_UNDER_COMPILE)
    def _deferred_head(self, hidden, *args, **kwargs):
        slot, head, head_forward = self.slot, self.head, self.head_forward
        if args or kwargs or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            slot.warn_once(
                "head_input",
                f"hf_offload: {slot.model_name} calls its lm_head with other than (batch, tokens, hidden) hidden "
                "states alone; its loss runs untiled",
            )
            return head_forward(hidden, *args, **kwargs)
        like = _like(head_forward, hidden)
        targets = Targets.of(head)
        norm_call = self.norm_call
        if norm_call is not None and norm_call.input is not None and _same_data(hidden, norm_call.output):
            stages = (_Stage(self.norm, norm_call.forward), _Stage(head, head_forward))
            return DeferredLogits(like, _Source(norm_call.input, stages, norm_call.targets.merged(targets), like, slot))
        return DeferredLogits(like, _Source(hidden, (_Stage(head, head_forward),), targets, like, slot))

    @torch.compiler.disable(reason=_UNDER_COMPILE)
    def _loss(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
              **kwargs):  # fmt: skip
        from transformers.loss.loss_utils import ForCausalLMLoss

        if isinstance(logits, DeferredLogits) and logits.whole:
            logits.source.note_materialised(logits.whole)
            logits = logits.materialise()
        if not isinstance(logits, DeferredLogits):
            return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels)
        return _tiled_loss(self.slot, logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels)


def _same_data(tensor: torch.Tensor, other) -> bool:
    """`tensor` holds exactly `other`'s elements (it is `other`, or a view keeping all of them:
    hidden_states[:, slice(-0, None)] for logits_to_keep=0)."""
    return (
        isinstance(other, torch.Tensor)
        and tensor.shape == other.shape
        and tensor.stride() == other.stride()
        and tensor.dtype == other.dtype
        and tensor.data_ptr() == other.data_ptr()
    )


def _has_hooks(module: nn.Module) -> bool:
    """Whether `module` has hooks of its own around its forward. (torch's global hooks, on every
    module, are left out: they watch every call, as the memory simulator's attribution does, and
    counting them would make a simulated step unlike the real one.)"""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)  # fmt: skip


def _untiled_forward(module: nn.Module):
    """The forward a call of `module` runs now, less tiling's per-token wrapper where that is
    outermost: a slice of the loss head is already a slice."""
    if instance_forward.wraps(module, per_token.tiled_forward):
        return module.__dict__[per_token.STATE_ATTR].forward_of(module)
    return _own_forward(module)


def _own_forward(module: nn.Module):
    """The forward a call of `module` runs now: an instance-level one, or its class's."""
    previous = module.__dict__.get("forward")
    return previous if previous is not None else types.MethodType(type(module).forward, module)


def _like(forward, hidden: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
    """`forward`'s output for the whole sequence, as shape and dtype over one element: computed for
    the first token, without grad and drawing no random numbers (LoRA dropout)."""
    with torch.no_grad(), torch.random.fork_rng(devices=_devices_of(hidden), device_type=hidden.device.type):
        first = forward(hidden[:, :1])
    return first.expand(hidden.shape[0], tokens or hidden.shape[1], first.shape[-1])


def _devices_of(tensor: torch.Tensor) -> list:
    return [tensor.device] if tensor.device.type not in ("cpu", "meta") else []


def _tiled_loss(slot: LossSlot, logits: DeferredLogits, labels, vocab_size, num_items_in_batch, ignore_index,
                shift_labels):  # fmt: skip
    from transformers.loss.loss_utils import ForCausalLMLoss

    source = logits.source
    hidden = source.hidden
    given = (labels, shift_labels)
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    if shift_labels.shape != hidden.shape[:2]:
        # Labels that do not match the logits token for token (longer than the inputs, or full
        # length with logits_to_keep): transformers' loss raises, and says why.
        return ForCausalLMLoss(logits.materialise(), given[0], vocab_size, num_items_in_batch, ignore_index, given[1])
    shift_labels = shift_labels.to(hidden.device)
    if num_items_in_batch is None:
        divisor = (shift_labels != ignore_index).sum()
    else:
        divisor = num_items_in_batch.to(hidden.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
    length = hidden.shape[1]
    tile = slot.tile_tokens if slot.tile_tokens is not None else loss_tile_tokens(logits.shape[-1], hidden.device)
    bounds = [(start, min(start + tile, length)) for start in range(0, length, tile)]
    targets = source.targets.merged(Targets.of(None, logits.learnable_operands()))
    # The run holds no reference to the hidden states besides the Function's saved one, which
    # backward frees (the loss tensor keeps the run alive through the whole backward).
    run = _LossRun(dataclasses.replace(source, hidden=None), logits.ops, shift_labels, ignore_index, divisor, bounds,
                   targets)  # fmt: skip
    slot.warn_once(
        "no_logits",
        f"hf_offload: the tiled loss computes {slot.model_name}'s training loss without the full logits: in "
        "training with labels, outputs.logits is None (as with Liger's fused linear cross-entropy); evaluation "
        "and generate() are untouched",
    )
    return _TiledLoss.apply(run, hidden, *targets.tensors)


def _without_deferred(output):
    """The model's output with the deferred logits taken out: None, as Liger's forward returns,
    or the real logits where something made them real."""

    def real(item):
        return item.__dict__.get("materialised") if isinstance(item, DeferredLogits) else item

    if isinstance(output, DeferredLogits):
        return real(output)
    if isinstance(output, tuple):
        return type(output)(real(item) for item in output)
    keys = getattr(output, "keys", None)
    if callable(keys) and any(isinstance(output[key], DeferredLogits) for key in keys()):
        return type(output)(**{key: real(value) for key, value in output.items() if real(value) is not None})
    return output


@torch.compiler.disable(recursive=False, reason=_UNDER_COMPILE)
def tiled_loss_forward(self: nn.Module, *args, **kwargs):
    """The causal LM's forward, with the tiled loss in a training step with labels (bound to the
    model instance).

    Under torch.compile the deferred logits cannot flow through a compiled graph, so a step that
    tiles the loss runs the model's forward eagerly (decoder layers compiled one by one still
    compile), and says so once; evaluation and generate compile as usual."""
    slot: LossSlot = self.__dict__[LOSS_STATE_ATTR]
    forward = slot.forward_of(self)
    labels = kwargs.get("labels")
    if not slot.active or labels is None or kwargs.get("fused_lm_head"):  # TRL's fused head never calls lm_head
        return forward(*args, **kwargs)
    if not tiles_loss(self):
        if eval_mode_with_grad(self) and _longer_than_a_slice(slot, self, labels):
            say_eval_mode_runs_whole(self, slot.said)
        return forward(*args, **kwargs)
    if not _longer_than_a_slice(slot, self, labels):
        return forward(*args, **kwargs)  # one slice: tiling would recompute the head and save nothing
    from transformers.loss.loss_utils import ForCausalLMLoss

    if self.loss_function is not ForCausalLMLoss:
        slot.warn_once(
            "loss_function",
            f"hf_offload: {slot.model_name} computes its loss with {getattr(self.loss_function, '__name__', '?')}, "
            "not transformers' ForCausalLMLoss: the tiled loss leaves it as it is",
        )
        return forward(*args, **kwargs)
    if under_torch_compile():
        slot.warn_once(
            "compile",
            f"hf_offload: under torch.compile, {slot.model_name}'s forward runs eagerly in training steps whose "
            "loss sequence tiling computes (its logits never exist whole, which a compiled graph cannot hold); "
            "to compile the decoder, compile its layers one by one (layer.compile()), or keep the loss untiled "
            "(enable_sequence_tiling(loss=False))",
        )
        forward = torch.compiler.disable(forward, reason=_UNDER_COMPILE)
    with _DeferredStep(slot, self):
        output = forward(*args, **kwargs)
    return _without_deferred(output)


def _longer_than_a_slice(slot: LossSlot, model: nn.Module, labels) -> bool:
    return not torch.is_tensor(labels) or labels.shape[min(1, labels.dim() - 1)] > slot.tile_for(model)


def _notice_a_foreign_head(slot: LossSlot, backbone: nn.Module, args) -> None:
    """The backbone's forward pre-hook: TRL's trainers call the backbone from their fused LM head
    (`add_fused_lm_head`), past the model's forward and so past the tiled loss; say so, once."""
    if "trl_fused_head" in slot._warned or not (slot.active and tiles_loss(backbone)):
        return
    if torch.compiler.is_compiling():  # a compiled backbone: reading the call stack would break its graph
        return
    if in_trl_fused_head():
        slot.warn_once("trl_fused_head", fused_head_notice(slot.model_name))


def install(model: nn.Module, tile_tokens: int | None, final_norm: nn.Module | None = None,
            said: set | None = None) -> None:  # fmt: skip
    name = type(model).__name__
    instance_forward.install(
        model,
        tiled_loss_forward,
        LOSS_STATE_ATTR,
        lambda previous: LossSlot(tile_tokens, previous, name, final_norm, said),
    )
    backbone = getattr(model, "base_model", None)
    if isinstance(backbone, nn.Module) and backbone is not model:
        slot = model.__dict__[LOSS_STATE_ATTR]
        slot.backbone_hook = backbone.register_forward_pre_hook(functools.partial(_notice_a_foreign_head, slot))


def uninstall(model: nn.Module) -> None:
    slot: LossSlot | None = model.__dict__.get(LOSS_STATE_ATTR)
    if slot is not None and slot.backbone_hook is not None:
        slot.backbone_hook.remove()
        slot.backbone_hook = None
    instance_forward.remove(model, tiled_loss_forward, LOSS_STATE_ATTR)


def is_tiled(model: nn.Module) -> bool:
    slot: LossSlot | None = model.__dict__.get(LOSS_STATE_ATTR)
    return slot is not None and slot.active
