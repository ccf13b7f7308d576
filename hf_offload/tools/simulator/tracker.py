"""Counting what a training step allocates on the simulated device, op by op.

`MemoryTracker` is a TorchDispatchMode under which every op's outputs are looked at once: a
storage not seen before is an allocation (views share their base's storage and cost nothing),
and it is freed when its storage dies (a weak reference's callback). Live bytes over time are
what `torch.cuda.memory_allocated` would read, so their maximum is what `max_memory_allocated`
reports. Each allocation carries a tag saying where it was made (which phase, which module), so
the peak can be shown by origin; gradients are re-tagged when autograd accumulates them. The
simulated device is the meta device; what hf_offload allocates there as host memory is marked
(`host_allocations`) and not counted.

The same pass counts FLOPs with `torch.utils.flop_counter`'s per-op formulas (what
`FlopCounterMode` counts; its own module tracker is left out, because it keeps checkpoints'
recomputed graphs alive until the mode exits and so changes the memory it runs beside), split
by the dtype the kernel runs in and, for attention, by what the kernel computes (a causal kernel
skips the upper triangle, one given a mask computes every block); and the bytes the FLOP-less
ops read and write (the time model's memory traffic). On request it records, per op, the bytes
live during it: two runs of the same step at two lengths then give each op's bytes as a line in
the number of tokens.

Accounts: the step's own, and `sandbox()`es beside it, where `memo.SliceMemo` runs a module
call once to learn what it allocates without it counting in the step; `transient` and `count`
then replay such a call into the step (`memo.py`).
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
# Ops whose outputs share an input's storage without being marked as views.
_NEVER_CACHED = frozenset({aten._unsafe_view.default, aten.lift_fresh.default, aten.alias.default})
_NO_TRAFFIC = frozenset(
    {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
     aten.new_empty_strided.default, aten.set_.source_Storage, aten.set_.source_Storage_storage_offset,
     aten._unsafe_view.default, aten.lift_fresh.default}
)  # fmt: skip  (allocations without writes, and metadata)
MATMUL, ATTENTION = "matmul", "attention"
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
# addmm with an accumulation dtype (cuBLAS's fp32 sums of half inputs: TRL's fused head) takes the
# dtype as a fourth argument, which flop_counter's addmm formula reads as its output's shape.
_ADDMM_WITH_DTYPE = frozenset(
    op for op in (getattr(aten.addmm, name, None) for name in ("dtype", "dtype_out")) if op is not None
)


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


class Account:
    """Live bytes by tag, their peak, and the step's counts: the step's own, or a sandbox's."""

    def __init__(self, *, trace: bool = False) -> None:
        self.blocks: dict[int, list] = {}  # id(storage) -> [nbytes, tag, weak reference]
        self.live = 0
        self.live_by_tag: dict[tuple, int] = defaultdict(int)
        self.peak = Peak()
        self.pending_snapshot = False
        self.trace: list[int] | None = [] if trace else None
        self.tag_peaks: dict[tuple, int] = {}  # the most bytes live while each tag was current
        self.clear_counts()

    def clear_counts(self) -> None:
        self.matmul_flops = 0
        self.attention_flops = 0  # over the whole square, as flop_counter counts
        self.compute: dict[tuple[str, torch.dtype], float] = defaultdict(float)  # what the kernels run
        self.traffic_bytes = 0
        self.operand_bytes = 0  # what the ops with FLOPs (matmuls, attention) read and write
        self.flops_by_tag: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])  # tag -> [matmul, attention]

    def settle(self) -> None:
        if self.pending_snapshot:
            self.pending_snapshot = False
            self.peak.live_by_tag = {tag: n for tag, n in self.live_by_tag.items() if n}

    def freed(self, reference) -> None:
        if self.pending_snapshot:
            self.settle()
        nbytes, tag, _reference = self.blocks.pop(reference.key)
        self.live -= nbytes
        self.live_by_tag[tag] -= nbytes


class OutputCache:
    """Meta tensors' outputs by the op and its inputs' metadata. Many meta kernels are Python
    (torch._refs), so an op on meta costs tens of microseconds, and a step runs the same few
    hundred ops again and again (every layer, every tile). An op whose outputs are new storages
    (not views, not in place) gets them from the cache as fresh empty tensors of the same sizes,
    strides and dtypes, which is all a meta kernel computes; an op in place that returned its
    first argument unchanged in shape returns it again; the op runs for real once per key."""

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple | None] = {}  # key -> output metadata, None: never cached
        self.hits = 0

    def run(self, func, args, kwargs, cacheable: int = 1):
        key = _cache_key(func, args, kwargs) if cacheable else None
        if key is None:
            return func(*args, **kwargs)
        entry = self.entries.get(key, _MISSING)
        if entry is _MISSING:
            if cacheable is _IN_PLACE:
                before = (args[0].shape, args[0].stride()) if args and isinstance(args[0], torch.Tensor) else None
                out = func(*args, **kwargs)
                same = before is not None and out is args[0] and (out.shape, out.stride()) == before
                self.entries[key] = _SELF if same else None
                return out
            out = func(*args, **kwargs)
            self.entries[key] = _metadata(out, args, kwargs)
            return out
        if entry is None:
            return func(*args, **kwargs)
        self.hits += 1
        if entry is _SELF:
            return args[0]
        if entry[0]:
            size, stride, dtype = entry[1][0]
            return torch.empty_strided(size, stride, dtype=dtype, device="meta")
        return tuple(torch.empty_strided(size, stride, dtype=dtype, device="meta") for size, stride, dtype in entry[1])


_MISSING = object()
_SELF = ("self",)
_IN_PLACE = 2  # cacheable, as an op in place on its first argument


class _Uncacheable(Exception):
    """An argument the cache cannot key on (a real tensor, an object)."""


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


def _describe(value):
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _Uncacheable
        return (value.shape, value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple([_describe(item) for item in value])
    if value is None or isinstance(value, _PLAIN):
        return (type(value), value)
    raise _Uncacheable


def _cache_key(func, args, kwargs):
    try:
        if kwargs:
            return (func, _describe(args), tuple([(name, _describe(value)) for name, value in sorted(kwargs.items())]))
        return (func, _describe(args))
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


def _tensor_bytes(values) -> int:
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (tuple, list)):
            total += sum(v.numel() * v.element_size() for v in value if isinstance(v, torch.Tensor))
    return total


# Per op, worked out once: (cacheable (0, 1 or _IN_PLACE), flop formula, is mm, kind, is_causal's index,
# counts traffic).
_OP_INFO: dict = {}


def _op_info(func) -> tuple:
    info = _OP_INFO.get(func)
    if info is None:
        packet = func.overloadpacket
        formula = _FLOP_FORMULAS.get(packet)
        schema = func._schema
        cacheable = 0 if func.is_view or func in _NEVER_CACHED else 1
        if cacheable and schema.is_mutable:
            # Only ops writing into their first argument and returning it ("add_", "copy_").
            first = schema.arguments[0] if schema.arguments else None
            writes_first = first is not None and first.alias_info is not None and first.alias_info.is_write
            others = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments[1:])
            single = len(schema.returns) == 1 and schema.returns[0].alias_info is not None
            cacheable = _IN_PLACE if writes_first and single and not others else 0
        kind = causal = None
        if formula is not None:
            kind = ATTENTION if packet in ATTENTION_OPS else MATMUL
            names = [argument.name for argument in func._schema.arguments]
            causal = names.index("is_causal") if "is_causal" in names else None
        traffic = formula is None and not func.is_view and func not in _NO_TRAFFIC
        info = (cacheable, formula, packet is aten.mm, kind, causal, traffic)
        _OP_INFO[func] = info
    return info


def _first_dtype(outputs) -> torch.dtype:
    for tensor in outputs:
        if isinstance(tensor, torch.Tensor):
            return tensor.dtype
    return torch.float32


def _is_causal(args, kwargs, index: int | None) -> bool:
    if index is None:
        return False
    value = args[index] if index < len(args) else kwargs.get("is_causal", False)
    return bool(value)


class MemoryTracker(TorchDispatchMode):
    """Live bytes on the simulated device, by tag, with the peak and a per-op trace (see the
    module docstring). `tag` is set from outside (the step's phase and module hooks) and stamped on
    every allocation made while it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.main = Account()
        self.account = self.main  # where allocations and counts go now: the step's, or a sandbox's
        self.aside_bytes = 0  # what `in_the_step` counted in the step from within sandboxes
        self.host: set[int] = set()  # storages hf_offload allocated as host memory
        self.allocating_host = False
        self.tag: tuple = ("weights",)
        self._op = ""
        self.outputs = OutputCache()

    # -- the step's account, as the runner reads it ---------------------------------------------

    @property
    def live(self) -> int:
        return self.main.live

    @property
    def live_by_tag(self) -> dict[tuple, int]:
        return self.main.live_by_tag

    @property
    def peak(self) -> Peak:
        return self.main.peak

    @property
    def trace(self) -> list[int] | None:
        return self.main.trace

    @property
    def matmul_flops(self) -> int:
        return self.main.matmul_flops

    @property
    def attention_flops(self) -> int:
        return self.main.attention_flops

    @property
    def traffic_bytes(self) -> int:
        return self.main.traffic_bytes

    @property
    def flops_by_tag(self) -> dict[tuple, list[int]]:
        return self.main.flops_by_tag

    @property
    def compute(self) -> dict[tuple[str, torch.dtype], float]:
        return self.main.compute

    # -- what the runner calls ------------------------------------------------------------------

    def start(self, *, trace: bool) -> None:
        """A new measurement from what is live now (weights, optimizer state)."""
        main = self.main
        main.settle()
        main.peak = Peak(bytes=main.live, op="(start)", tag=self.tag, live_by_tag=dict(main.live_by_tag))
        main.trace = [] if trace else None
        main.tag_peaks = {}
        main.clear_counts()

    def finish(self) -> Peak:
        self.main.settle()
        return self.main.peak

    def retag(self, tensor: torch.Tensor, tag: tuple) -> None:
        """Count `tensor`'s storage under `tag` from now on (a gradient autograd accumulated)."""
        key = id(tensor.untyped_storage())
        for account in (self.account, self.main):
            block = account.blocks.get(key)
            if block is not None:
                if block[1] != tag:
                    account.live_by_tag[block[1]] -= block[0]
                    account.live_by_tag[tag] += block[0]
                    block[1] = tag
                return

    def adopt(self, tensor: torch.Tensor) -> None:
        """Count a tensor made outside this mode (the model's weights) under the current tag."""
        self._add(self.account, tensor.untyped_storage())

    @contextlib.contextmanager
    def sandbox(self) -> Iterator[Account]:
        """Within this block allocations, frees of what it allocates, and counts go to a fresh
        account (its peak from 0), not to the step's: a module call run once to be learnt."""
        previous, account = self.account, Account()
        self.account = account
        try:
            yield account
        finally:
            self.account = previous
            account.settle()

    @contextlib.contextmanager
    def in_the_step(self) -> Iterator[None]:
        """What is allocated within this block counts in the step's account even inside a sandbox
        (a cache a learnt call fills, which outlives it); `aside_bytes` sums it."""
        previous, self.account = self.account, self.main
        before = self.main.live
        try:
            yield
        finally:
            self.aside_bytes += self.main.live - before
            self.account = previous

    def transient(self, nbytes: int, *, op: str, tag: tuple, node: str, by_tag: dict[tuple, int]) -> None:
        """A replayed call's own peak: `nbytes` over what is live now, made of `by_tag` over the
        live bytes' own composition."""
        account = self.account
        total = account.live + nbytes
        if account.trace is not None:
            account.trace.append(total)
        if total > account.tag_peaks.get(self.tag, 0):
            account.tag_peaks[self.tag] = total
        if total > account.peak.bytes:
            account.settle()
            composition = {key: n for key, n in account.live_by_tag.items() if n}
            for key, n in by_tag.items():
                composition[key] = composition.get(key, 0) + n
            account.peak = Peak(total, op, tag, node, composition)

    def count(self, other: Account) -> None:
        """Add a replayed call's FLOPs and traffic (learnt in a sandbox) to the current account."""
        account = self.account
        account.matmul_flops += other.matmul_flops
        account.attention_flops += other.attention_flops
        account.traffic_bytes += other.traffic_bytes
        account.operand_bytes += other.operand_bytes
        for key, value in other.compute.items():
            account.compute[key] += value
        for tag, (matmul, attention) in other.flops_by_tag.items():
            counts = account.flops_by_tag[tag]
            counts[0] += matmul
            counts[1] += attention

    def allocate(self, size: tuple, stride: tuple, dtype: torch.dtype, tag: tuple) -> torch.Tensor:
        """A fresh meta tensor counted under `tag` in the current account, made without going
        through the mode (a replayed call's output: nothing to count but its bytes)."""
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            tensor = torch.empty_strided(size, stride, dtype=dtype, device="meta")
        previous, self.tag = self.tag, tag
        try:
            self._add(self.account, tensor.untyped_storage())
        finally:
            self.tag = previous
        return tensor

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
        cacheable, formula, is_mm, kind, causal, traffic = _OP_INFO.get(func) or _op_info(func)
        out = self.outputs.run(func, args, kwargs, cacheable)
        self._op = func
        account = self.account
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                self._add(account, tensor.untyped_storage())
        if formula is not None:
            # mm, the commonest by far, directly: flop_counter's formulas go through pytree per call.
            if is_mm:
                (rows, inner), columns = args[0].shape, args[1].shape[1]
                flops = 2 * rows * inner * columns
            elif func in _ADDMM_WITH_DTYPE:
                (rows, inner), columns = args[1].shape, args[2].shape[1]
                flops = 2 * rows * inner * columns
            else:
                flops = formula(*args, **kwargs, out_val=out)
            counts = account.flops_by_tag[self.tag]
            dtype = _first_dtype(outputs)
            account.operand_bytes += _tensor_bytes(args) + _tensor_bytes(outputs)
            if kind is ATTENTION:
                account.attention_flops += flops
                counts[1] += flops
                account.compute[(ATTENTION, dtype)] += flops / 2 if _is_causal(args, kwargs, causal) else flops
            else:
                account.matmul_flops += flops
                counts[0] += flops
                account.compute[(MATMUL, dtype)] += flops
        elif traffic:
            # Memory-bound work (casts, norms, activations, adds, copies): the bytes it reads and writes.
            account.traffic_bytes += _tensor_bytes(args) + _tensor_bytes(outputs)
        live = account.live
        if func is _FLASH_BACKWARD:
            workspace = flash_backward_workspace_bytes(args[1], args[2])
            if live + workspace > account.peak.bytes:
                self._new_peak(account, live + workspace, workspace=("attention backward workspace", workspace))
            live += workspace
            if live > account.tag_peaks.get(self.tag, 0):
                account.tag_peaks[self.tag] = live
        if account.trace is not None:
            account.trace.append(live)
        return out

    def resized(self, storage) -> None:
        """A storage counted before was resized in place (hf_offload frees what a checkpoint's
        recompute saved for the attention, and grows it back, `engine.recompute`): its bytes now."""
        key = id(storage)
        account = self.account if key in self.account.blocks else self.main
        block = account.blocks.get(key)
        if block is None:
            return
        nbytes = storage.nbytes()
        change = nbytes - block[0]
        if change < 0 and account.pending_snapshot:
            account.settle()
        block[0] = nbytes
        account.live += change
        account.live_by_tag[block[1]] += change
        if change > 0 and account.live > account.peak.bytes:
            self._new_peak(account, account.live)

    def _add(self, account: Account, storage) -> None:
        key = id(storage)
        if key in account.blocks or key in self.host or (account is not self.main and key in self.main.blocks):
            return
        if self.allocating_host:
            self.host.add(key)
            weakref.finalize(storage, self.host.discard, key)
            return
        nbytes = storage.nbytes()
        tag = self.tag
        account.blocks[key] = [nbytes, tag, weakref.KeyedRef(storage, account.freed, key)]
        live = account.live = account.live + nbytes
        account.live_by_tag[tag] += nbytes
        if live > account.tag_peaks.get(tag, 0):
            account.tag_peaks[tag] = live
        if live > account.peak.bytes:
            self._new_peak(account, live)

    def _new_peak(self, account: Account, nbytes: int, workspace: tuple[str, int] | None = None) -> None:
        peak = account.peak
        peak.bytes = nbytes
        peak.op = str(getattr(self._op, "__name__", self._op))
        peak.tag = self.tag
        node = torch._C._current_autograd_node()
        peak.node = node.name() if node is not None else ""
        peak.workspace = workspace
        # The composition is copied when the live bytes first fall from the peak (or at the end):
        # in forward nearly every op sets a new peak, and copying each time would cost more than the op.
        account.pending_snapshot = True
