"""The MoE load-balancing (router auxiliary) loss under DeepSpeed's Ulysses, made the whole sequence's.

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, Qwen3.5-MoE, Qwen3-Next, OLMoE, ...) add
`router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)` to
their loss when `output_router_logits` is on: Switch Transformer's loss, `num_experts * sum_e f_e * P_e`,
with `f_e` the share of the top-k assignments that go to expert e and `P_e` its mean router probability,
both over every token of every MoE layer. Under Ulysses each rank holds only its shard's router logits, so
it computes its shard's loss, and the group's sum of those (what `sequence_parallel_loss` reports) is not
the sequence's: a product of means is not the sum of the shards' products (about `sp_size` times too
large on balanced routing).

Made exact here: `f_e` has no gradient (it counts a top-k), so the sequence's loss is linear in the sums
of router probabilities. With the counts (assignments per expert, tokens) summed over the SP group first,
each rank's share `num_experts * sum_e (count_e / tokens) * (its probability sum_e / tokens)` adds up over
the group to the sequence's loss, and its gradient is the sequence's gradient. Only `num_experts + 1`
numbers cross the ranks per forward (no router logits are gathered).

How: while a model is prepared for Ulysses, its modeling module's `load_balancing_loss_func` is wrapped:
where the model's forward is a Ulysses shard (the decision softmax attention's exchange takes), the wrapper
returns this rank's share; anywhere else it calls transformers' own function. The wrapped function must
compute Switch Transformer's loss: that is checked once per module against `switch_loss` on random router
logits, with and without a mask; a module whose function computes something else (Doge's, over its
product-key router) is refused by name when router logits are asked for under Ulysses.

`output.aux_loss` of a shard's forward is the rank's share too; the group's sum is the sequence's.
Tokens the batch does not mask count: `Ulysses.adapt` pads a sequence to a multiple of `sp_size` at its
end, and those pad tokens count in the loss unless the batch carries an `attention_mask` (which it pads
with zeros), as they would on one process given the padded batch.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref

import torch
from torch import nn

FUNCTION = "load_balancing_loss_func"
PREPARED_ATTR = "_hf_offload_ulysses_router_loss"
# modeling module name -> transformers' own function, for the modules whose function is wrapped
_ORIGINAL: dict = {}
# modeling module name -> whether transformers' function there computes Switch Transformer's loss
_SWITCH: dict = {}
# modeling module name -> the models prepared with its function wrapped
_PREPARED: dict = {}
# The forwards of prepared models running now: [(model, position_ids)], innermost last.
_RUNNING: list = []


def switch_loss(gate_logits, num_experts: int, top_k: int, attention_mask=None, group=None):
    """Switch Transformer's load-balancing loss of the router logits of every MoE layer (a tuple
    of [tokens, experts] tensors); with `group`, this rank's share of the loss of the group's tokens
    (the counts summed over the group, the router probabilities the rank's own). Counts and sums are
    float32 whatever the logits' dtype, as in transformers."""
    if not isinstance(gate_logits, tuple) or not gate_logits:
        return 0
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    tokens = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in gate_logits:
        weights = torch.softmax(logits.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        rows = torch.ones(weights.shape[0], dtype=torch.float32, device=device) if mask is None else mask
        counts = counts.index_add(0, chosen.reshape(-1), rows.repeat_interleave(top_k))
        probabilities = probabilities + (weights.float() * rows.unsqueeze(-1)).sum(dim=0)
        tokens = tokens + rows.sum()
    if group is not None:
        totals = torch.cat([counts, tokens.reshape(1)]).detach()
        torch.distributed.all_reduce(totals, group=group)
        counts, tokens = totals[:-1], totals[-1]
    return torch.sum((counts / tokens) * (probabilities / tokens).unsqueeze(0)) * num_experts


def computes_switch_loss(function) -> bool:
    """Whether `function(gate_logits, num_experts, top_k, attention_mask)` gives `switch_loss`'s
    value on random router logits (3 layers of 10 tokens, 6 experts, top 2), with and without a
    mask hiding some tokens."""
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(10, 6, generator=generator, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[1, 3:] = 0
    try:
        for attention_mask in (None, mask):
            got = function(logits, 6, 2, attention_mask)
            expected = switch_loss(logits, 6, 2, attention_mask)
            if not torch.is_tensor(got) or got.shape != () or not torch.allclose(got.double(), expected.double()):
                return False
    except Exception:  # another signature or another shape of router logits
        return False
    return True


def _modeling_module(model: nn.Module):
    """The transformers modeling module of the outermost transformers model in `model`, and that model."""
    inner, seen = model, 0
    while isinstance(getattr(inner, "module", None), nn.Module) and seen < 8:  # DDP, a DeepSpeed engine
        inner, seen = inner.module, seen + 1
    if callable(getattr(type(inner), "get_base_model", None)):  # PEFT
        inner = inner.get_base_model()
    module = sys.modules.get(type(inner).__module__)
    if module is None or not type(inner).__module__.startswith("transformers.models."):
        return None, inner
    return module, inner


def _asks_router_logits(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "output_router_logits", False) or getattr(text, "output_router_logits", False))


def _refusal(model_name: str, module_name: str) -> ValueError:
    return ValueError(
        f"sequence parallelism (Ulysses) on {model_name} with output_router_logits: {module_name}.{FUNCTION} does "
        "not compute Switch Transformer's load-balancing loss, the one hf_offload makes the whole sequence's under "
        "Ulysses (each rank would add its own shard's loss: a silently different model). Turn it off "
        "(config.output_router_logits=False, or output_router_logits=False in the forward), or train without sp_size"
    )


def prepare_router_loss(model: nn.Module, exchange_of) -> bool:
    """Make `model`'s MoE load-balancing loss the whole sequence's under Ulysses (see the module's
    docstring), or refuse it by name where its modeling module computes another loss and the
    config asks for router logits. Idempotent. Returns whether the model has such a loss.
    `exchange_of(model, positions=...)` is the Ulysses exchange a forward of `model` fed those
    position_ids runs, or None (linear_attention's `active_exchange`: passed in, so that this module
    needs nothing of the one that prepares it)."""
    module, inner = _modeling_module(model)
    current = getattr(module, FUNCTION, None) if module is not None else None
    if current is None:
        return False
    name = module.__name__
    if getattr(current, "_hf_offload_original", None) is None:  # not wrapped yet, or replaced since
        _SWITCH[name] = computes_switch_loss(current)
        _ORIGINAL[name] = current
        setattr(module, FUNCTION, _wrapped(current, name))
    if not _SWITCH[name] and _asks_router_logits(inner.config):
        raise _refusal(type(inner).__name__, name)
    if getattr(inner, PREPARED_ATTR, None) is None:
        try:
            signature = inspect.signature(inner.forward)
        except (TypeError, ValueError):
            signature = inspect.Signature()
        handles = [
            inner.register_forward_pre_hook(functools.partial(_entered, signature, exchange_of), with_kwargs=True),
            inner.register_forward_hook(_left, always_call=True),
        ]
        setattr(inner, PREPARED_ATTR, handles)
        _PREPARED.setdefault(name, weakref.WeakSet()).add(inner)
    return True


def release_router_loss(model: nn.Module) -> None:
    """Undo `prepare_router_loss` on `model`; transformers' own function goes back into its module
    once no prepared model of that module is left."""
    module, inner = _modeling_module(model)
    handles = getattr(inner, PREPARED_ATTR, None)
    if handles is None:
        return
    for handle in handles:
        handle.remove()
    delattr(inner, PREPARED_ATTR)
    _RUNNING[:] = [entry for entry in _RUNNING if entry[0] is not inner]
    name = module.__name__ if module is not None else None
    prepared = _PREPARED.get(name)
    if prepared is not None:
        prepared.discard(inner)
    if name in _ORIGINAL and not prepared:  # other prepared models of the module keep the wrapper
        if getattr(getattr(module, FUNCTION, None), "_hf_offload_original", None) is _ORIGINAL[name]:
            setattr(module, FUNCTION, _ORIGINAL[name])
        del _ORIGINAL[name]
        _SWITCH.pop(name, None)


def _entered(signature, exchange_of, model, args, kwargs) -> None:
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = kwargs
    _RUNNING.append((model, bound.get("position_ids"), exchange_of))


def _left(model, args, output) -> None:
    for index in range(len(_RUNNING) - 1, -1, -1):
        if _RUNNING[index][0] is model:
            del _RUNNING[index]
            break


def _wrapped(original, module_name: str):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_balancing_loss_func(*args, **kwargs):
        exchange = _RUNNING[-1][2](_RUNNING[-1][0], positions=_RUNNING[-1][1]) if _RUNNING else None
        gate_logits = args[0] if args else next(iter(kwargs.values()), None)
        if exchange is None or not isinstance(gate_logits, tuple) or not gate_logits:  # no routers: no loss
            return original(*args, **kwargs)
        if not _SWITCH.get(module_name, False):
            raise _refusal(type(_RUNNING[-1][0]).__name__, module_name)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = list(bound.arguments.values())  # gate_logits, num_experts, top_k, attention_mask (checked)
        return switch_loss(values[0], values[1], values[2], values[3], group=exchange.group)

    load_balancing_loss_func._hf_offload_original = original
    return load_balancing_loss_func


__all__ = ["computes_switch_loss", "prepare_router_loss", "release_router_loss", "switch_loss"]
