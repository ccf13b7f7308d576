"""Attention tiled over heads: a group of key/value heads and their query heads at a time.

Heads are independent, so attention computed a group at a time gives every head's output as the
whole call does, while the kernel's own memory (FlashAttention's float32 gradient accumulators,
keys and values expanded to every query head for grouped-query attention, an eager attention's
score matrix) exists for one group at a time, in forward and above all in backward. The groups are
views of the query, key and value tensors (`split`), and their outputs are joined (`cat`): autograd
runs each group's backward in turn, and nothing is recomputed.

It is installed in transformers' attention-function registry (`ALL_ATTENTION_FUNCTIONS`), around
the functions registered for SDPA and FlashAttention: a wrapper that does what the registered
function does unless the calling attention module belongs to a model whose attention tiling is
on. Where the split is not known to be exact it runs the call whole and says so once: eager
attention (each model has its own, not in the registry), flex attention (a score function may
read the head index), a tensor argument of unknown layout.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..integrations.upstream import resolve
from .replay import eval_mode_with_grad, say_eval_mode_runs_whole, splits

logger = logging.getLogger("hf_offload")

HEADS_ATTR = "_hf_offload_tiled_heads"
# Registered attention functions that compute each head on its own.
SPLITTABLE = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
# The most groups a call is split into: more adds kernel launches and saves little more memory.
MAX_GROUPS = 8
# Tensor keyword arguments, by how they lay out heads: none (the same for every head), per head
# on their first dimension (attention sinks), or as SDPA broadcasts a mask or bias against the
# (batch, heads, queries, keys) scores: heads third from last where they have three dimensions or
# more ((batch, heads, q, k), (heads, q, k); or 1 there, the same for every head), none where
# fewer ((q, k); a FlashAttention padding mask (batch, tokens)).
_NO_HEADS = frozenset({"position_ids", "cu_seq_lens_q", "cu_seq_lens_k"})
_HEADS_FIRST = frozenset({"s_aux", "sinks"})
_LIKE_SCORES = frozenset({"attention_mask", "position_bias"})
_SCORES_HEADS = -3  # where a tensor laid out like the scores has its heads


@dataclass(eq=False)
class HeadTiling:
    """What tiling keeps on an attention block and the modules in it: the sequence length above
    which it splits, how many calls it has split, what it has said."""

    min_tokens: int
    said: set = field(default_factory=set)
    calls: int = 0  # attention-function calls that came through the registry
    handles: list = field(default_factory=list)  # the block's hooks, which check that calls do

    def __setstate__(self, state: dict) -> None:
        # A deep copy (TRL's reference model) or an unpickled model tiles on its own: it keeps
        # the registry wrapped when the original disables tiling, and wraps it in a new process.
        self.__dict__.update(state)
        if self.handles:
            _live.add(self)
            _wrap_registry()


def _say_once(tiling: HeadTiling, module: nn.Module, reason: str) -> None:
    if reason not in tiling.said:
        tiling.said.add(reason)
        logger.warning("hf_offload: %s's attention runs with its heads whole: %s", type(module).__name__, reason)


def _before_block(tiling: HeadTiling, block: nn.Module, args, kwargs) -> None:
    block._hf_offload_calls_before = tiling.calls


def _after_block(tiling: HeadTiling, block: nn.Module, args, kwargs, output) -> None:
    """A training call of the block that never reached the registry computed attention itself."""
    before = block.__dict__.pop("_hf_offload_calls_before", tiling.calls)
    hidden = args[0] if args else kwargs.get("hidden_states")
    long = isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] > tiling.min_tokens
    if tiling.calls == before and long and splits(block):
        _say_once(tiling, block, _why_not_reached(block))


def _why_not_reached(block: nn.Module) -> str:
    """Why a block's call never reached the tiled functions: ALL_ATTENTION_FUNCTIONS's own mapping
    shadows the registry's entry for its implementation (DeepSpeed's Ulysses registers itself
    there, around the function it found), or the model computes attention itself."""
    implementation = getattr(getattr(block, "config", None), "_attn_implementation", None)
    if implementation in resolve("transformers.local_attention_functions"):
        return (
            f"transformers' attention function for {implementation!r} was replaced in ALL_ATTENTION_FUNCTIONS by "
            "one that does not call the tiled one (as DeepSpeed's Ulysses registration does, around the function "
            "it found): enable sequence tiling before registering it, or register with hf_offload's register_ulysses"
        )
    return "it computes attention itself, not through transformers' attention functions"


_originals: dict[str, object] = {}  # the registered functions our wrappers took the place of
# Every block's tiling still installed, in any model of the process (copies included): the
# registry stays wrapped while one is.
_live: weakref.WeakSet[HeadTiling] = weakref.WeakSet()


def _registry():
    return resolve("transformers.attention_registry")


def _wrap_registry() -> None:
    mapping = _registry()
    for name in SPLITTABLE:
        function = mapping.get(name)
        if function is None or getattr(function, "_hf_offload_heads_of", None) is not None:
            continue
        _originals[name] = function
        mapping[name] = _head_tiled(function, name)


def _unwrap_registry() -> None:
    mapping = _registry()
    for name, function in list(_originals.items()):
        if getattr(mapping.get(name), "_hf_offload_heads_of", None) is function:
            mapping[name] = function
        del _originals[name]


def install(attention: nn.Module, min_tokens: int, said: set) -> None:
    """Tile the attention block's calls over heads: the block, and the modules in it (BERT-style
    blocks call the attention function from a child). `said`: what has been said, shared by the
    model's blocks, so that each notice comes once per model."""
    tiling = HeadTiling(min_tokens, said)
    for module in attention.modules():
        setattr(module, HEADS_ATTR, tiling)
    _live.add(tiling)
    tiling.handles = [
        attention.register_forward_pre_hook(functools.partial(_before_block, tiling), with_kwargs=True),
        attention.register_forward_hook(functools.partial(_after_block, tiling), with_kwargs=True),
    ]
    _wrap_registry()


def uninstall(attention: nn.Module) -> None:
    tiling = attention.__dict__.pop(HEADS_ATTR, None)
    if tiling is not None:
        _live.discard(tiling)
        for handle in tiling.handles:
            handle.remove()
        tiling.handles.clear()
    if not _live:
        _unwrap_registry()


def is_tiled(attention: nn.Module) -> bool:
    return HEADS_ATTR in attention.__dict__


def _head_tiled(function, name: str):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        tiling: HeadTiling | None = getattr(module, HEADS_ATTR, None)
        if tiling is None:
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        tiling.calls += 1
        if args or query.dim() != 4 or query.shape[2] <= tiling.min_tokens:
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        if not splits(module):
            if eval_mode_with_grad(module):
                say_eval_mode_runs_whole(module, tiling.said)
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        groups, reason = _groups(query, key, value, attention_mask, kwargs)
        if reason is not None:
            _say_once(tiling, module, reason)
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        heads, kv_heads = query.shape[1], key.shape[1]
        outputs, weights = [], []
        for q, k, v, mask, extra in zip(
            query.split(heads // groups, dim=1),
            key.split(kv_heads // groups, dim=1),
            value.split(kv_heads // groups, dim=1),
            _per_group(attention_mask, _SCORES_HEADS, heads, groups),
            _kwargs_per_group(kwargs, heads, groups),
            strict=True,
        ):
            output, weight = function(module, q, k, v, mask, **extra)
            outputs.append(output)
            weights.append(weight)
        # (batch, tokens, heads, head_dim), as every registered function returns it
        joined_weights = None if any(w is None for w in weights) else torch.cat(weights, dim=1)
        return torch.cat(outputs, dim=2), joined_weights

    attention._hf_offload_heads_of = function
    attention.__name__ = getattr(function, "__name__", name)
    attention.__doc__ = getattr(function, "__doc__", None)
    return attention


def _groups(query, key, value, attention_mask, kwargs) -> tuple[int, str | None]:
    """How many groups of key/value heads the call splits into, or why it cannot be split."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return 1, f"query, key and value of {query.dim()}, {key.dim()} and {value.dim()} dimensions"
    heads, kv_heads = query.shape[1], key.shape[1]
    if value.shape[1] != kv_heads or heads % kv_heads:
        return 1, f"{heads} query heads against {kv_heads} key and {value.shape[1]} value heads"
    for name, tensor in (("attention_mask", attention_mask), *kwargs.items()):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or name in _NO_HEADS:
            continue
        if name in _HEADS_FIRST and tensor.shape[:1] == (heads,):
            continue
        if name in _LIKE_SCORES and (tensor.dim() < 3 or tensor.shape[_SCORES_HEADS] in (1, heads)):
            continue
        head_dim = 0 if tensor.dim() == 1 else 1  # where a tensor of heads would have them
        if name not in _HEADS_FIRST | _LIKE_SCORES and tensor.shape[head_dim] not in (heads, kv_heads):
            continue  # of no head layout (labels passed along, say): the same for every group
        return 1, f"its argument {name} of shape {tuple(tensor.shape)} may lay out heads in a way not known here"
    if kv_heads == 1:
        why = "multi-query attention, or one per rank under sequence parallelism"
        return 1, f"a single key/value head in the call ({why}): no group of heads to split off"
    groups = max(g for g in range(1, MAX_GROUPS + 1) if kv_heads % g == 0)
    return groups, None


def _per_group(tensor, dim: int, heads: int, groups: int) -> list:
    """The tensor's part for each group where it lays out heads along `dim` (0: a per-head
    vector's first; `_SCORES_HEADS`: a mask's or bias's, of three dimensions or more), else the
    whole for each: a padding mask (batch, tokens) whose length equals the head count is not
    split. (Given whole to every group, a (heads, q, k) bias would be broadcast against each
    group's scores: an error, or with one head per group every head's bias on each.)"""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < (1 if dim == 0 else -dim) or tensor.shape[dim] != heads:
        return [tensor] * groups
    return list(tensor.split(heads // groups, dim=dim))


def _kwargs_per_group(kwargs: dict, heads: int, groups: int) -> list[dict]:
    pieces = {}
    for name, value in kwargs.items():
        if name in _HEADS_FIRST:
            pieces[name] = _per_group(value, 0, heads, groups)
        elif name in _LIKE_SCORES:
            pieces[name] = _per_group(value, _SCORES_HEADS, heads, groups)
        else:
            pieces[name] = [value] * groups
    return [{name: parts[index] for name, parts in pieces.items()} for index in range(groups)]
