"""Counting what a training step allocates on the simulated device, op by op.

`MemoryTracker` is a TorchDispatchMode under which every op's outputs are looked at once: a
storage not seen before is an allocation (views share their base's storage and cost nothing),
and it is freed when its storage dies (`weakref.finalize`). Live bytes over time are what
`torch.cuda.memory_allocated` would read, so their maximum is what `max_memory_allocated`
reports. Each allocation carries a tag saying where it was made (which phase, which module), so
the peak can be shown by origin; gradients are re-tagged when autograd accumulates them. The
simulated device is the meta device; what hf_offload allocates there as host memory is marked
(`host_allocations`) and not counted.

The same pass counts FLOPs with `torch.utils.flop_counter`'s per-op formulas (what
`FlopCounterMode` counts; its own module tracker is left out, because it keeps checkpoints'
recomputed graphs alive until the mode exits and so changes the memory it runs beside), and
records, per op, the bytes live during it: two runs of the same step at two lengths then give
each op's bytes as a line in the number of tokens.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_FLOP_FORMULAS = flop_counter.flop_registry
ATTENTION_OPS = frozenset(packet for packet in _FLOP_FORMULAS if "attention" in str(packet))
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_backward.default
# Ops that move no data: allocating, aliasing, reinterpreting.
# Ops whose outputs share an input's storage without being marked as views.
_NEVER_CACHED = frozenset({aten._unsafe_view.default, aten.lift_fresh.default, aten.alias.default})
_NO_TRAFFIC = frozenset(
    {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
     aten.new_empty_strided.default, aten.set_.source_Storage, aten.set_.source_Storage_storage_offset,
     aten._unsafe_view.default, aten.lift_fresh.default}
)  # fmt: skip  (allocations without writes, and metadata)


def flash_backward_workspace_bytes(query: torch.Tensor, key: torch.Tensor) -> int:
    """What CUDA's FlashAttention-2 backward (PyTorch's `mha_bwd`) allocates for itself through
    the caching allocator beyond its outputs: the float32 softmax row sums (batch, heads, seq
    rounded up to 128) and the float32 dq accumulator (batch, seq rounded, heads, head_dim
    rounded up to 32), and for grouped-query attention dk and dv at the query's head count before
    they are summed down. Read from PyTorch's source, not measured: no H200 figure peaks there."""
    batch, heads, seq, head_dim = query.shape
    rows = -(-seq // 128) * 128
    width = -(-head_dim // 32) * 32
    workspace = batch * heads * rows * 4 + batch * rows * heads * width * 4
    if key.shape[1] != heads:
        workspace += 2 * batch * seq * heads * head_dim * query.element_size()
    return workspace


@dataclass
class Peak:
    """The most bytes live at once, and what held them."""

    bytes: int = 0
    op: str = ""
    tag: tuple = ()
    node: str = ""  # the autograd node running, in backward
    live_by_tag: dict[tuple, int] = field(default_factory=dict)
    workspace: tuple[str, int] | None = None  # a kernel's own allocation counted at the peak


class OutputCache:
    """Meta tensors' outputs by the op and its inputs' metadata. Many meta kernels are Python
    (torch._refs), so an op on meta costs tens of microseconds, and a step runs the same few
    hundred ops again and again (every layer, every tile). An op whose outputs are new storages
    (not views, not in place) gets them from the cache as fresh empty tensors of the same sizes,
    strides and dtypes, which is all a meta kernel computes; the op runs for real once per key."""

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple | None] = {}  # key -> output metadata, None: never cached
        self.hits = 0

    def run(self, func, args, kwargs):
        key = _cache_key(func, args, kwargs)
        entry = self.entries.get(key, _MISSING) if key is not None else None
        if entry is _MISSING:
            out = func(*args, **kwargs)
            self.entries[key] = _metadata(out, args, kwargs)
            return out
        if entry is None:
            return func(*args, **kwargs)
        self.hits += 1
        tensors = [torch.empty_strided(size, stride, dtype=dtype, device="meta") for size, stride, dtype in entry[1]]
        return tensors[0] if entry[0] else tuple(tensors)


_MISSING = object()


class _Uncacheable(Exception):
    """An argument the cache cannot key on (a real tensor, an object)."""


def _describe(value):
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _Uncacheable
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(item) for item in value)
    if value is None or isinstance(value, _PLAIN):
        return (type(value), value)
    raise _Uncacheable


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


def _cache_key(func, args, kwargs):
    if func.is_view or func._schema.is_mutable or func in _NEVER_CACHED:
        return None
    try:
        return (func, _describe(args), tuple((name, _describe(value)) for name, value in sorted(kwargs.items())))
    except _Uncacheable:
        return None


def _metadata(out, args, kwargs):
    """(single, [(sizes, strides, dtype)]) when every output is a new meta storage; else None."""
    single = isinstance(out, torch.Tensor)
    outputs = (out,) if single else out
    if not isinstance(outputs, tuple) or not outputs:
        return None
    if not all(isinstance(o, torch.Tensor) and o.is_meta for o in outputs):
        return None
    inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
    storages = [id(o.untyped_storage()) for o in outputs]
    if inputs.intersection(storages) or len(set(storages)) != len(storages):
        return None
    return single, [(tuple(o.shape), o.stride(), o.dtype) for o in outputs]


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _mm_flops(args) -> int:
    (rows, inner), columns = args[0].shape, args[1].shape[1]
    return 2 * rows * inner * columns


def _tensor_bytes(values) -> int:
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (tuple, list)):
            total += sum(v.numel() * v.element_size() for v in value if isinstance(v, torch.Tensor))
    return total


class MemoryTracker(TorchDispatchMode):
    """Live bytes on the simulated device, by tag, with the peak and a per-op trace (see the
    module docstring). `tag` is set from outside (the step's phase and module hooks) and stamped on
    every allocation made while it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[int, list] = {}  # id(storage) -> [nbytes, tag]
        self.host: set[int] = set()  # storages hf_offload allocated as host memory
        self.allocating_host = False
        self.live = 0
        self.live_by_tag: dict[tuple, int] = defaultdict(int)
        self.tag: tuple = ("weights",)
        self.peak = Peak()
        self.trace: list[int] | None = None
        self.matmul_flops = 0
        self.attention_flops = 0
        self.flops_by_tag: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])  # tag -> [matmul, attention]
        self.traffic_bytes = 0
        self._op = ""
        self._pending_snapshot = False
        self.outputs = OutputCache()

    # -- what the runner calls ------------------------------------------------------------------

    def start(self, *, trace: bool) -> None:
        """A new measurement from what is live now (weights, optimizer state)."""
        self._settle()
        self.peak = Peak(bytes=self.live, op="(start)", tag=self.tag, live_by_tag=dict(self.live_by_tag))
        self.trace = [] if trace else None
        self.matmul_flops = self.attention_flops = self.traffic_bytes = 0
        self.flops_by_tag = defaultdict(lambda: [0, 0])

    def finish(self) -> Peak:
        self._settle()
        return self.peak

    def retag(self, tensor: torch.Tensor, tag: tuple) -> None:
        """Count `tensor`'s storage under `tag` from now on (a gradient autograd accumulated)."""
        block = self.blocks.get(id(tensor.untyped_storage()))
        if block is not None and block[1] != tag:
            self.live_by_tag[block[1]] -= block[0]
            self.live_by_tag[tag] += block[0]
            block[1] = tag

    def adopt(self, tensor: torch.Tensor) -> None:
        """Count a tensor made outside this mode (the model's weights) under the current tag."""
        self._add(tensor.untyped_storage())

    # -- the mode -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        """What is allocated within this block is host memory: never counted, nor its views."""
        self.allocating_host = True
        try:
            yield
        finally:
            self.allocating_host = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self.outputs.run(func, args, kwargs)
        self._op = func
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                self._add(tensor.untyped_storage())
        packet = func.overloadpacket
        formula = _FLOP_FORMULAS.get(packet)
        if formula is not None:
            # mm, the commonest by far, directly: flop_counter's formulas go through pytree per call.
            flops = _mm_flops(args) if packet is aten.mm else formula(*args, **kwargs, out_val=out)
            counts = self.flops_by_tag[self.tag]
            if packet in ATTENTION_OPS:
                self.attention_flops += flops
                counts[1] += flops
            else:
                self.matmul_flops += flops
                counts[0] += flops
        elif not func.is_view and func not in _NO_TRAFFIC:
            # Memory-bound work (casts, norms, activations, adds, copies): the bytes it reads and writes.
            self.traffic_bytes += _tensor_bytes(args) + _tensor_bytes(outputs)
        live = self.live
        if func is _FLASH_BACKWARD:
            workspace = flash_backward_workspace_bytes(args[1], args[2])
            if live + workspace > self.peak.bytes:
                self._new_peak(live + workspace, workspace=("attention backward workspace", workspace))
            live += workspace
        if self.trace is not None:
            self.trace.append(live)
        return out

    def _add(self, storage) -> None:
        key = id(storage)
        if key in self.blocks or key in self.host:
            return
        if self.allocating_host:
            self.host.add(key)
            weakref.finalize(storage, self.host.discard, key)
            return
        nbytes = storage.nbytes()
        tag = self.tag
        self.blocks[key] = [nbytes, tag]
        weakref.finalize(storage, self._free, key)
        self.live += nbytes
        self.live_by_tag[tag] += nbytes
        if self.live > self.peak.bytes:
            self._new_peak(self.live)

    def _new_peak(self, nbytes: int, workspace: tuple[str, int] | None = None) -> None:
        peak = self.peak
        peak.bytes = nbytes
        peak.op = str(getattr(self._op, "__name__", self._op))
        peak.tag = self.tag
        node = torch._C._current_autograd_node()
        peak.node = node.name() if node is not None else ""
        peak.workspace = workspace
        # The composition is copied when the live bytes first fall from the peak (or at the end):
        # in forward nearly every op sets a new peak, and copying each time would cost more than the op.
        self._pending_snapshot = True

    def _settle(self) -> None:
        if self._pending_snapshot:
            self._pending_snapshot = False
            self.peak.live_by_tag = {tag: n for tag, n in self.live_by_tag.items() if n}

    def _free(self, key: int) -> None:
        if self._pending_snapshot:
            self._settle()
        nbytes, tag = self.blocks.pop(key)
        self.live -= nbytes
        self.live_by_tag[tag] -= nbytes
