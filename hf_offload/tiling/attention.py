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

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
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
_NO_HEADS = frozenset(
    {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "num_items_in_batch", "labels", "shift_labels"}
)  # (transformers passes the model's keyword arguments down to attention: the loss's among them)
_HEADS_FIRST = frozenset({"s_aux", "sinks"})
_LIKE_SCORES = frozenset({"attention_mask", "position_bias"})
_SCORES_HEADS = -3  # where a tensor laid out like the scores has its heads


@dataclass(eq=False)
class HeadTiling:
    """What tiling keeps on an attention block and the modules in it: the sequence length above
    which it splits, the query heads per piece (`tile_heads`; None: tiling chooses), how many
    calls it has split, what it has said."""

    min_tokens: int
    said: set = field(default_factory=set)
    heads_per_piece: int | None = None
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
    implementation = getattr(getattr(block, "config", None), "_attn_implementation", None)
    for outer in list(_outer.values()):
        outer.before_block(implementation)


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


@dataclass(frozen=True)
class OuterAttention:
    """What wraps transformers' attention functions from outside and takes part in head tiling
    (sequence parallelism's exchange, which runs a chunk of query heads at a time where attention
    is tiled over heads): `before_block(implementation)` runs before each call of a tiled attention
    block, with the block's attention implementation (None if it has no config); `released()` once
    no model of the process tiles heads any more."""

    before_block: Callable[[str | None], None]
    released: Callable[[], None]


# The seam through which tiling's door (`hf_offload.tiling`) plugs such wrappers in, by name; this
# module knows none of them.
_outer: dict[str, OuterAttention] = {}


def register_outer_attention(
    name: str, before_block: Callable[[str | None], None], released: Callable[[], None]
) -> None:
    """Call `before_block(implementation)` before each call of a head-tiled attention block, and
    `released()` when head tiling is off in every model of the process. Registering `name` again
    replaces what it registered (a module reloaded registers again)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_outer_attention: name must be a non-empty str, got {name!r}")
    for what, function in (("before_block", before_block), ("released", released)):
        if not callable(function):
            raise TypeError(f"register_outer_attention({name!r}): {what} must be callable, got {function!r}")
    _outer[name] = OuterAttention(before_block, released)


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


def install(attention: nn.Module, min_tokens: int, said: set, heads_per_piece: int | None = None) -> None:
    """Tile the attention block's calls over heads: the block, and the modules in it (BERT-style
    blocks call the attention function from a child). `said`: what has been said, shared by the
    model's blocks, so that each notice comes once per model. `heads_per_piece`: query heads per
    piece (`tile_heads`), None to let tiling choose."""
    tiling = HeadTiling(min_tokens, said, heads_per_piece)
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
        for outer in list(_outer.values()):
            outer.released()


def is_tiled(attention: nn.Module) -> bool:
    return HEADS_ATTR in attention.__dict__


def _head_tiled(function, name: str):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        tiling: HeadTiling | None = getattr(module, HEADS_ATTR, None)
        if tiling is None:
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        tiling.calls += 1
        if _running_whole or args or query.dim() != 4 or query.shape[2] <= tiling.min_tokens:
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        if not splits(module):
            if eval_mode_with_grad(module):
                say_eval_mode_runs_whole(module, tiling.said)
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        pieces, reason = _pieces(query, key, value, attention_mask, kwargs, tiling.heads_per_piece)
        if reason is not None:
            _say_once(tiling, module, reason)
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        heads, kv_heads = query.shape[1], key.shape[1]
        per_piece, ratio = heads // pieces, heads // kv_heads
        # A piece of query heads takes its key/value heads; pieces within one key/value head's query
        # heads share it (the same split output: autograd sums its gradient over them).
        kv_per_piece = max(per_piece // ratio, 1)
        keys, values = key.split(kv_per_piece, dim=1), value.split(kv_per_piece, dim=1)
        outputs, weights = [], []
        for index, (q, mask, extra) in enumerate(
            zip(
                query.split(per_piece, dim=1),
                _per_group(attention_mask, _SCORES_HEADS, heads, pieces),
                _kwargs_per_group(kwargs, heads, pieces),
                strict=True,
            )
        ):
            kv = index * per_piece // ratio // kv_per_piece
            with key_value_groups(module, per_piece // kv_per_piece):
                output, weight = function(module, q, keys[kv], values[kv], mask, **extra)
            outputs.append(output)
            weights.append(weight)
        # (batch, tokens, heads, head_dim), as every registered function returns it
        joined_weights = None if any(w is None for w in weights) else torch.cat(weights, dim=1)
        return torch.cat(outputs, dim=2), joined_weights

    attention._hf_offload_heads_of = function
    attention.__name__ = getattr(function, "__name__", name)
    attention.__doc__ = getattr(function, "__doc__", None)
    return attention


_running_whole = 0  # > 0: inside a call already split elsewhere (query heads through Ulysses's exchange)


@contextlib.contextmanager
def running_whole() -> Iterator[None]:
    """The tiled functions run each call whole inside: its caller has split the heads already
    (attention over query heads a chunk at a time through sequence parallelism's exchange)."""
    global _running_whole
    _running_whole += 1
    try:
        yield
    finally:
        _running_whole -= 1


@contextlib.contextmanager
def key_value_groups(module: nn.Module, ratio: int) -> Iterator[None]:
    """`module.num_key_value_groups` (query heads per key/value head, which transformers' SDPA
    function reads to repeat keys and values) as it is in a call of fewer heads, put back after."""
    previous = getattr(module, "num_key_value_groups", None)
    if previous is None or previous == ratio:
        yield
        return
    module.num_key_value_groups = ratio
    try:
        yield
    finally:
        module.num_key_value_groups = previous


def pieces_of_heads(heads: int, kv_heads: int) -> list[int]:
    """Query heads per piece that keep a piece with its key/value heads: divisors of `heads` that
    are a multiple of the grouped-query ratio (whole key/value heads with their query heads) or
    divide it (pieces of one key/value head's query heads, which share it)."""
    ratio = heads // kv_heads if kv_heads and heads % kv_heads == 0 else 0
    return [
        size for size in range(1, heads + 1) if heads % size == 0 and ratio and (size % ratio == 0 or ratio % size == 0)
    ]


def check_heads_per_piece(heads_per_piece: int, heads: int, kv_heads: int, where: str) -> None:
    """A ValueError naming `tile_heads` and the valid values, unless it cuts `heads` query heads
    (of `kv_heads` key/value heads) into pieces that keep each with its key/value heads."""
    valid = pieces_of_heads(heads, kv_heads)
    if heads_per_piece not in valid:
        raise ValueError(
            f"tile_heads={heads_per_piece} does not cut {where}'s {heads} query heads ({kv_heads} key/value heads) "
            f"into pieces that keep each query head with its key/value head: valid tile_heads: {valid}"
        )


def _pieces(query, key, value, attention_mask, kwargs, heads_per_piece: int | None) -> tuple[int, str | None]:
    """How many pieces of query heads the call splits into, or why it cannot be split. By default
    a group of key/value heads and their query heads per piece (at most MAX_GROUPS pieces); with
    `heads_per_piece`, that many query heads per piece."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return 1, f"query, key and value of {query.dim()}, {key.dim()} and {value.dim()} dimensions"
    heads, kv_heads = query.shape[1], key.shape[1]
    if value.shape[1] != kv_heads or heads % kv_heads:
        return 1, f"{heads} query heads against {kv_heads} key and {value.shape[1]} value heads"
    for name, tensor in (("attention_mask", attention_mask), *kwargs.items()):
        if _unknown_head_layout(name, tensor, heads, kv_heads):
            return 1, f"its argument {name} of shape {tuple(tensor.shape)} may lay out heads in a way not known here"
    if heads_per_piece is not None:
        check_heads_per_piece(heads_per_piece, heads, kv_heads, "the attention call")
        return heads // heads_per_piece, None
    if kv_heads == 1:
        why = "multi-query attention, or one per rank under sequence parallelism"
        return 1, (
            f"a single key/value head in the call ({why}): no group of heads to split off (tile_heads=1 splits its "
            "query heads)"
        )
    groups = max(g for g in range(1, MAX_GROUPS + 1) if kv_heads % g == 0)
    return groups, None


def _unknown_head_layout(name: str, tensor, heads: int, kv_heads: int) -> bool:
    """Whether an argument of an attention call may lay out heads in a way a split does not know:
    not a mask or bias laid out like the scores, a per-head vector, or a tensor of no head layout
    (labels passed along, say: the same for every piece)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or name in _NO_HEADS:
        return False
    if name in _HEADS_FIRST and tensor.shape[:1] == (heads,):
        return False
    if name in _LIKE_SCORES and (tensor.dim() < 3 or tensor.shape[_SCORES_HEADS] in (1, heads)):
        return False
    head_dim = 0 if tensor.dim() == 1 else 1  # where a tensor of heads would have them
    return name in _HEADS_FIRST | _LIKE_SCORES or tensor.shape[head_dim] in (heads, kv_heads)


def carries_heads(name: str, tensor, heads: int, kv_heads: int) -> bool:
    """Whether an argument of an attention call lays out heads, or may: a mask or bias, a per-head
    vector (attention sinks), or another tensor with as many entries as heads where a tensor of
    heads would have them. What does not is the same for every piece of heads."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or name in _NO_HEADS:
        return False
    if name in _HEADS_FIRST | _LIKE_SCORES:
        return True
    return _unknown_head_layout(name, tensor, heads, kv_heads)


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
