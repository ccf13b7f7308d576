"""Attention tiled over query heads through sequence parallelism's exchange (DeepSpeed's Ulysses).

Under Ulysses each rank holds `seq / P` tokens of every head, and attention needs every token of
some heads: an all-to-all trades tokens for heads, the rank's `heads / P` query heads (and their
key/value heads) over the whole sequence, then another trades them back. DeepSpeed exchanges all
of the rank's heads at once and calls the kernel once, so the whole-sequence buffers of every
head the rank computes exist together: the gathered query and output, their gradients, and the
kernel's backward workspace (FlashAttention's float32 dq accumulator, and dk, dv at the query's
head count under grouped-query attention). Tiling attention over heads inside that call cannot
split a rank's single key/value head.

Here the rank's query heads go through the exchange a chunk at a time (UPipe's idea, "untied
Ulysses", arXiv 2602.21196, applied to transformers' attention functions): for chunk `t` of `u`
query heads, every rank sends each destination `r` the heads `r * heads / P + t * u + [0, u)`
(DeepSpeed's layout, chunked: rank `r` still computes the heads `[r, r + 1) * heads / P`, so a
query head meets the key/value head transformers gives it), the kernel runs on those `u` heads
over the whole sequence, and the output goes back to the rank holding those tokens. A key/value
head is exchanged once, with the first chunk that needs it, and kept for the chunks of its query
heads (fewer key/value heads than ranks are repeated as DeepSpeed repeats them); its gradient
sums over those chunks and goes back once. So each tensor crosses the exchange as often, and with
as many bytes, as in DeepSpeed's call: only the number of collectives grows.

What is held at once:
- forward: one chunk's exchange buffers and output; the rank's output is written chunk by chunk
  into one buffer (`_Output`), never as a list of chunks joined at the end;
- backward: autograd runs one chunk's chain at a time (its nodes were created last): that chunk's
  output gradient, its gathered query gradient, the kernel's workspace for `u` heads; the
  gradients of the rank's query, key and value are written chunk by chunk into one buffer each
  (`_Sends`), not summed from a full-size gradient per chunk;
- saved for backward: what the kernel saves for each chunk (its gathered query, key, value,
  output and log-sum-exp), together as many bytes as DeepSpeed's single call saves. With
  checkpointing they exist from the layer's recompute to its backward; recomputing each chunk in
  backward instead (UPipe's choice) would exchange the query, key and value again, and save the
  rank's own query, key and value, of the same bytes as the gathered ones (docs/sequence_parallel.md).

The exchange itself is passed in (`exchange`): DeepSpeed's `_dim_zero_all_to_all` on the SP
group in training, the simulator's stand-in in `hf-offload estimate --sp N`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .attention import (
    HEADS_ATTR,
    MAX_GROUPS,
    HeadTiling,
    carries_heads,
    key_value_groups,
    pieces_of_heads,
    running_whole,
)
from .replay import splits


@dataclass(frozen=True)
class HeadChunks:
    """How one rank's attention call runs its query heads through the exchange, `heads_per_chunk`
    at a time. `heads`, `kv_heads`: the model's (every rank's call sees them all, for its tokens)."""

    sp_size: int
    heads: int
    kv_heads: int
    heads_per_chunk: int

    @property
    def rank_heads(self) -> int:
        """Query heads a rank computes over the whole sequence."""
        return self.heads // self.sp_size

    @property
    def replication(self) -> int:
        """How many ranks receive each key/value head (fewer key/value heads than ranks: DeepSpeed
        repeats each to `sp_size / kv_heads` ranks)."""
        return max(self.sp_size // self.kv_heads, 1)

    @property
    def rank_kv_heads(self) -> int:
        return self.kv_heads * self.replication // self.sp_size

    @property
    def ratio(self) -> int:
        """Query heads per key/value head on a rank."""
        return self.rank_heads // self.rank_kv_heads

    @property
    def chunks(self) -> int:
        return self.rank_heads // self.heads_per_chunk

    def kv_range(self, chunk: int) -> tuple[int, int]:
        """The rank's key/value heads that chunk `chunk`'s query heads attend with."""
        first = chunk * self.heads_per_chunk
        return first // self.ratio, (first + self.heads_per_chunk - 1) // self.ratio + 1


def plan_chunks(heads: int, kv_heads: int, sp_size: int, heads_per_chunk: int | None = None) -> HeadChunks:
    """The chunks for a model of `heads` query and `kv_heads` key/value heads under Ulysses over
    `sp_size` ranks. `heads_per_chunk` (tiling's `tile_heads`): query heads per chunk, a divisor of
    the rank's query heads that keeps each chunk with its key/value heads; None: as few as make at
    most MAX_GROUPS chunks, as tiling splits heads. Raises a ValueError naming the valid values."""
    if heads % sp_size or (kv_heads % sp_size and sp_size % kv_heads):
        raise ValueError(
            f"Ulysses over {sp_size} ranks needs the {heads} query heads divisible by it and {kv_heads} key/value "
            "heads dividing it or divisible by it (check_sequence_parallel says which sizes are valid)"
        )
    rank_heads = heads // sp_size
    rank_kv_heads = kv_heads * max(sp_size // kv_heads, 1) // sp_size
    valid = pieces_of_heads(rank_heads, rank_kv_heads)
    if heads_per_chunk is None:
        heads_per_chunk = min(size for size in valid if rank_heads // size <= MAX_GROUPS)
    elif heads_per_chunk not in valid:
        raise ValueError(
            f"tile_heads={heads_per_chunk} under Ulysses over {sp_size} ranks: each rank computes {rank_heads} query "
            f"heads with {rank_kv_heads} key/value head(s), and a chunk must divide them and keep each query head "
            f"with its key/value head: valid tile_heads here: {valid}"
        )
    return HeadChunks(sp_size, heads, kv_heads, heads_per_chunk)


def chunk_plan(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, sp_size: int, kwargs: dict
) -> HeadChunks | None:
    """The chunks for this call of a Ulysses rank's attention (query and key as the rank holds
    them: every head, `seq / sp_size` tokens), or None where it runs as DeepSpeed runs it: the
    module's attention is not tiled over heads, not in training, the sequence is no longer than
    tiling's slice, an argument lays out heads, or the rank's heads make one chunk."""
    tiling: HeadTiling | None = getattr(module, HEADS_ATTR, None)
    if tiling is None or not splits(module) or query.dim() != 4 or key.dim() != 4:
        return None
    if query.shape[2] * sp_size <= tiling.min_tokens:
        return None
    if any(carries_heads(name, value, query.shape[1], key.shape[1]) for name, value in kwargs.items()):
        return None  # attention sinks per head, a bias: not split by chunk here
    plan = plan_chunks(query.shape[1], key.shape[1], sp_size, tiling.heads_per_piece)
    if plan.chunks == 1:
        return None
    tiling.calls += 1  # reached: tiling's own check that attention came through it
    return plan


class _Sends:
    """The rank's query (or key, or value) tensor, `(batch, heads, tokens, head_dim)`, as its
    chunks leave for the exchange: which heads go to each destination, and in backward the
    gradient, written chunk by chunk into one buffer and returned with the last chunk's."""

    def __init__(self, local: torch.Tensor, sp_size: int, per_rank: int, replication: int, sends: int) -> None:
        self.shape = local.shape
        self.sp_size = sp_size
        self.per_rank = per_rank  # heads each destination receives from this tensor (1 when replicated)
        self.replication = replication
        self.sends = sends  # chunks that send part of it: its gradient is complete after as many
        self.grad: torch.Tensor | None = None
        self.pending = sends

    def source(self, local: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """(ranks, tokens, batch, count, head_dim): for each destination `r` its heads
        `r * per_rank + first + [0, count)` (each key/value head to its `replication` ranks), a view."""
        if self.replication > 1:  # one key/value head per destination, rank r taking head r // replication
            batch, kv_heads, tokens, head_dim = local.shape
            repeated = local.unsqueeze(2).expand(batch, kv_heads, self.replication, tokens, head_dim)
            return repeated.permute(1, 2, 3, 0, 4)  # (kv_heads, replication, tokens, batch, head_dim)
        by_rank = local.unflatten(1, (self.sp_size, self.per_rank))[:, :, first : first + count]
        return by_rank.permute(1, 3, 0, 2, 4)

    def add_grad(self, grad: torch.Tensor, first: int, count: int) -> torch.Tensor | None:
        """Write one chunk's gradient in; the whole gradient once every chunk's is in, else None."""
        if self.grad is None:
            self.grad = torch.zeros(self.shape, dtype=grad.dtype, device=grad.device)
        if self.replication > 1:  # each key/value head went to `replication` ranks: their gradients sum
            kv_heads = self.shape[1]
            summed = grad.view(kv_heads, self.replication, *grad.shape[1:3], grad.shape[4]).sum(1)
            self.grad.add_(summed.permute(2, 0, 1, 3))
        else:
            self.grad.unflatten(1, (self.sp_size, self.per_rank))[:, :, first : first + count].add_(
                grad.permute(2, 0, 3, 1, 4)
            )
        self.pending -= 1
        if self.pending:
            return None
        whole, self.grad, self.pending = self.grad, None, self.sends
        return whole


class _Outgoing(torch.autograd.Function):
    """A chunk's part of the rank's query, key or value, laid out for the exchange:
    (ranks, tokens, batch, heads, head_dim), contiguous. Backward writes the chunk's gradient into
    the tensor's one gradient buffer (`_Sends`)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sends: _Sends, first: int, count: int) -> torch.Tensor:
        ctx.sends, ctx.first, ctx.count = sends, first, count
        batch, _heads, tokens, head_dim = local.shape
        buffer = local.new_empty((sends.sp_size, tokens, batch, count, head_dim))
        source = sends.source(local, first, count)
        if sends.replication > 1:
            buffer.view(*source.shape[:4], head_dim).copy_(source)
        else:
            buffer.copy_(source)
        return buffer

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sends: _Sends = ctx.sends
        whole = sends.add_grad(grad, ctx.first, ctx.count) if ctx.needs_input_grad[0] else None
        return whole, None, None, None


class _Output:
    """The rank's attention output, (batch, tokens, heads, head_dim): written chunk by chunk as
    each comes back from the exchange; in backward its gradient, read chunk by chunk."""

    def __init__(self, sp_size: int, rank_heads: int, chunks: int) -> None:
        self.sp_size = sp_size
        self.rank_heads = rank_heads
        self.chunks = chunks
        self.buffer: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.pending = chunks

    def heads(self, whole: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """(batch, tokens, ranks, count, head_dim): the heads `r * rank_heads + first + [0, count)` of each rank r."""
        return whole.unflatten(2, (self.sp_size, self.rank_heads))[:, :, :, first : first + count]


class _Incoming(torch.autograd.Function):
    """A chunk's output back from the exchange, (ranks, tokens, batch, heads, head_dim), written
    into the rank's output; returns an empty tensor that carries the chunk into `_Joined`."""

    @staticmethod
    def forward(ctx, received: torch.Tensor, output: _Output, first: int) -> torch.Tensor:
        ranks, tokens, batch, count, head_dim = received.shape
        ctx.output, ctx.first, ctx.count = output, first, count
        if output.buffer is None:
            output.buffer = received.new_empty((batch, tokens, ranks * output.rank_heads, head_dim))
        output.heads(output.buffer, first, count).copy_(received.permute(2, 1, 0, 3, 4))
        return received.new_empty(0)

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        output: _Output = ctx.output
        chunk = output.heads(output.grad, ctx.first, ctx.count).permute(2, 1, 0, 3, 4).contiguous()
        output.pending -= 1
        if not output.pending:  # every chunk has read its part: the gradient is not held here any longer
            output.grad, output.pending = None, output.chunks
        return chunk, None, None


class _Joined(torch.autograd.Function):
    """The rank's output, once every chunk's part is written in; backward hands its gradient to
    the chunks."""

    @staticmethod
    def forward(ctx, output: _Output, *chunks: torch.Tensor) -> torch.Tensor:
        ctx.output = output
        whole, output.buffer = output.buffer, None
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.output.grad = grad
        return (None,) + (None,) * ctx.output.chunks


def attention_in_head_chunks(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    plan: HeadChunks,
    exchange: Callable[[torch.Tensor], torch.Tensor],
    core: Callable,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One Ulysses rank's attention, its query heads `plan.heads_per_chunk` at a time through
    `exchange` (an all-to-all over dimension 0 of a contiguous (ranks, ...) buffer, differentiable).
    `query` (batch, heads, tokens / P, head_dim), `key` and `value` (batch, kv_heads, tokens / P,
    head_dim), as transformers' attention modules pass them; `core` is transformers' attention
    function, called on each chunk over the whole sequence. Returns the output (batch, tokens / P,
    heads, head_dim) and the attention weights (None: no kernel in use returns them)."""
    per_chunk, chunks, sp_size = plan.heads_per_chunk, plan.chunks, plan.sp_size
    kv_groups = [plan.kv_range(chunk) for chunk in range(chunks)]
    kv_sends = len(dict.fromkeys(kv_groups))  # each key/value group once, with its first chunk
    queries = _Sends(query, sp_size, plan.rank_heads, 1, chunks)
    keys = _Sends(key, sp_size, plan.rank_kv_heads, plan.replication, kv_sends)
    values = _Sends(value, sp_size, plan.rank_kv_heads, plan.replication, kv_sends)
    output = _Output(sp_size, plan.rank_heads, chunks)
    carried, weights = [], []
    gathered_kv: tuple[int, int] | None = None
    with running_whole():
        for chunk in range(chunks):
            first = chunk * per_chunk
            chunk_query = _whole_sequence(exchange(_Outgoing.apply(query, queries, first, per_chunk)))
            if kv_groups[chunk] != gathered_kv:
                gathered_kv = kv_groups[chunk]
                start, stop = gathered_kv
                chunk_key = _whole_sequence(exchange(_Outgoing.apply(key, keys, start, stop - start)))
                chunk_value = _whole_sequence(exchange(_Outgoing.apply(value, values, start, stop - start)))
            with key_value_groups(module, per_chunk // chunk_key.shape[1]):
                result, weight = core(module, chunk_query, chunk_key, chunk_value, attention_mask, **kwargs)
            del chunk_query
            weights.append(weight)
            # (batch, seq, heads, head_dim) -> (ranks, tokens, batch, heads, head_dim): each rank's tokens back
            back = result.unflatten(1, (sp_size, -1)).permute(1, 2, 0, 3, 4).contiguous()
            del result
            carried.append(_Incoming.apply(exchange(back), output, first))
            del back
    joined = _Joined.apply(output, *carried)
    joined_weights = None if any(w is None for w in weights) else torch.cat(weights, dim=1)
    return joined, joined_weights


def _whole_sequence(received: torch.Tensor) -> torch.Tensor:
    """(ranks, tokens, batch, heads, head_dim) from the exchange -> (batch, heads, seq, head_dim),
    the ranks' tokens in rank order."""
    ranks, tokens, batch, heads, head_dim = received.shape
    return received.permute(2, 3, 0, 1, 4).reshape(batch, heads, ranks * tokens, head_dim)

