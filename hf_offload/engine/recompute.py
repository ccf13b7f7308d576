"""What a layer's checkpoint recompute saves for its attention's backward waits on the host.

In backward a checkpointed layer is recomputed, and everything it saves is on the device at once;
the MLP's backward runs first, while what the recompute saved for the attention (the norm's
output, q, k, v, the attention's output and log-sum-exp, o_proj's input) waits. A `RecomputeScope`
runs around the recompute (`ActivationOffloader.recompute_scope`). Its saved-tensor hooks sit inside
the checkpoint's own (non-reentrant: torch.utils.checkpoint's recomputation hooks, to which every
tensor is passed on unchanged; reentrant: none, the tensor is kept as itself) and only note which
storages are saved, and whether before the attention block has returned (`end_window`) or after.

When the recompute ends, the storages saved only before that point, that are neither the layer's
inputs nor its parameters, are copied to host memory on the copy stream and freed in place
(`UntypedStorage.resize_(0)`): every tensor autograd or the checkpoint holds keeps its storage
object, and nothing of torch's checkpoint changes. When the gradient of the attention block's
output arrives (the MLP's backward and the post-attention norm's are done), they are grown again and
copied back (`ActivationOffloader.restore_recomputed`), before any node of the attention's backward
runs: autograd runs those only once that gradient exists.

The copies are waited for where they are made: the copy out before the memory is freed, the copy
back before the attention's backward may read it (its unpack is the checkpoint's, not ours). So they
are not hidden: they cost bytes / link bandwidth of step time per layer, small beside the layer's
quadratic attention only at long context, hence `RECOMPUTE_OFFLOAD_BYTES`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from . import ordering
from .pool import rounded_size
from .streams import flat_bytes

# Below this many bytes a layer's recompute keeps what it saved on the device (today's behaviour).
# The copies out and back are waited for: 2 x bytes / 55 GB/s per layer (an H200's pinned link),
# beside the layer's time, which grows as tokens^2. Simulated 2026-12-07 (Llama-3-8B LoRA r=16,
# tiled, 262,144 tokens, the H200 time model): the host pool grows by 9 GiB (a layer parks 36 KB a
# token), 0.35 s of copies against 5.2 s of its forward and backward (6.7%), a ratio falling as
# 1/tokens: 2.5% at 24 GiB (~700k tokens), 1.75% at 1M. 32 GiB (~930k tokens) kept it under 2%
# everywhere, but on an 80 GB card the memory runs out at ~830k tokens without it (simulated
# 2026-12-08): a search then stops there, though 1M fits with it. 24 GiB: acting below that edge,
# at up to 2.5% of the step's time where it starts.
RECOMPUTE_OFFLOAD_BYTES = 24 * 2**30


@contextlib.contextmanager
def threshold(nbytes: int) -> Iterator[None]:
    """Within this block, `RECOMPUTE_OFFLOAD_BYTES` is `nbytes` (the memory simulator's steps of
    setups that keep the recompute's tensors on the device, as ALST does: 2**62)."""
    global RECOMPUTE_OFFLOAD_BYTES
    previous, RECOMPUTE_OFFLOAD_BYTES = RECOMPUTE_OFFLOAD_BYTES, nbytes
    try:
        yield
    finally:
        RECOMPUTE_OFFLOAD_BYTES = previous


def storage_key(storage: torch.UntypedStorage) -> int:
    """A storage's address; its identity for storages without one (tensors on the meta device, as
    the memory simulator runs whole steps on; a parked storage, freed in place, while a recompute
    runs): then only the storage object tells them apart. The engine's one key for a storage (the
    offloader's too: it imports this module, so the key lives here)."""
    return storage.data_ptr() or id(storage)


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    keys = set()
    for tensor in tensors:
        try:
            keys.add(storage_key(tensor.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            continue  # a tensor subclass without a plain storage (e.g. a sharded DTensor): never packed as one
    return keys


def tensors_in(value, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor in nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            tensors_in(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            tensors_in(item, found)
    return found


class Parked:
    """One storage the recompute saved, on the host while the MLP's backward runs."""

    __slots__ = ("storage", "nbytes", "host", "pool")

    def __init__(self, storage: torch.UntypedStorage, nbytes: int, host, pool) -> None:
        self.storage, self.nbytes, self.host, self.pool = storage, nbytes, host, pool

    def __del__(self) -> None:
        # A graph dropped before its attention's backward ran: the host buffer goes back.
        host = self.host
        if host is not None:
            self.host = None
            with contextlib.suppress(AttributeError, TypeError):  # at interpreter exit
                self.pool.release(host)


class RecomputeScope:
    """The saved-tensor hooks of one layer's checkpoint recompute (see the module docstring)."""

    __slots__ = (
        "engine", "group", "inputs", "protected", "window", "before", "after", "hooks", "outer", "kept", "decided"
    )  # fmt: skip

    def __init__(self, engine, group, inputs: Iterable[torch.Tensor], protected: Callable[[], Iterable]) -> None:
        self.engine = engine
        self.group = group
        self.inputs = inputs  # the recompute's arguments: the checkpoint's inputs, cos/sin, the mask
        self.protected = protected  # the layer's parameters and buffers, read when the recompute ends
        self.window = True  # the attention block has not returned yet
        self.before: dict[int, torch.UntypedStorage] = {}
        self.after: set[int] = set()
        self.hooks = None
        self.outer = None
        self.kept: set[int] = set()  # storages the layer reads on after the attention block (its output)
        self.decided = False  # parked already (or found below the threshold), before the MLP ran

    def __enter__(self) -> RecomputeScope:
        # The checkpoint's recomputation hooks (non-reentrant), which ours must pass every tensor to.
        # Without torch's (private) call telling them, the scope stays out: hooks of ours would
        # shadow the checkpoint's.
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is None:
            return self
        self.outer = top(False)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        self.engine.recompute_scopes().append(self)
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        hooks = self.hooks
        if hooks is None:
            return
        self.engine.recompute_scopes().remove(self)
        hooks.__exit__(exc_type, exc, traceback)
        try:
            # The non-reentrant checkpoint ends its recompute early, by an exception, once it has
            # what backward needs; any other exception ends the backward, and nothing is moved.
            if exc_type is None or exc_type.__name__ == "_StopRecomputationError":
                self.engine.park_recomputed(self)
        finally:
            # The recompute's graph keeps `unpack` (so this object) as long as it lives, and the
            # hooks object made a cycle through `pack`: let go of the layer's group (its host
            # copies), the storages and the inputs now.
            self.hooks = self.group = self.protected = None
            self.before, self.after, self.inputs, self.kept = {}, set(), (), set()

    def pack(self, tensor: torch.Tensor):
        if type(tensor) is torch.Tensor and tensor.layout is torch.strided:
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                storage = None
            if storage is not None:
                key = storage_key(storage)
                if self.window:
                    self.before.setdefault(key, storage)
                else:
                    self.after.add(key)
        outer = self.outer
        if outer is not None:
            return outer[0](tensor)
        return tensor.detach()  # an alias: a saved output itself would make a cycle through its grad_fn

    def unpack(self, packed):
        outer = self.outer
        return outer[1](packed) if outer is not None else packed

    def end_window(self, outputs: Iterable[torch.Tensor] = ()) -> None:
        """The attention block has returned `outputs`, which the layer reads on: they never move."""
        self.window = False
        self.kept.update(storage_ptrs(outputs))

    def candidates(self, keep: Iterable[torch.Tensor] = ()) -> list[torch.UntypedStorage]:
        """The storages saved before the attention block returned, and not after, that are neither the
        recompute's inputs nor parameters or buffers, nor the attention block's outputs nor `keep`
        (what the MLP is called with): made by the recompute, for the attention's backward."""
        excluded = set(self.after) | self.kept | storage_ptrs(keep)
        for tensor in self.inputs:
            try:
                excluded.add(storage_key(tensor.untyped_storage()))
            except (RuntimeError, NotImplementedError):
                continue
        for tensor in self.protected():
            try:
                excluded.add(storage_key(tensor.untyped_storage()))
            except (RuntimeError, NotImplementedError):
                continue
        minimum = max(self.engine.min_offload_bytes, 1)
        device = self.group.device.device
        return [
            storage
            for key, storage in self.before.items()
            if key not in excluded
            and storage.nbytes() >= minimum
            and storage.device == device
            and storage.resizable()
        ]


def _room_for(pool, nbytes: int) -> bool:
    return pool.budget.has_room(nbytes)


def park(group, storages: list[torch.UntypedStorage]) -> list[Parked]:
    """Copy each storage to the host on the copy stream, wait for it, free the device memory."""
    context = group.device
    streams = context.streams
    parked, pairs = [], []
    for storage in storages:
        nbytes = storage.nbytes()
        # Charged to max_host_bytes like the checkpoint inputs (the pool leaves that to its caller):
        # past it, a storage stays on the device rather than the host growing past the user's budget.
        if not _room_for(context.pool, rounded_size(nbytes)):
            continue
        try:
            host = context.pool.acquire(rounded_size(nbytes))
        except (RuntimeError, MemoryError):
            continue
        parked.append(Parked(storage, nbytes, host, context.pool))
        pairs.append((host.view(nbytes), flat_bytes(storage)))
    if not parked:
        return parked
    ordering.before_offload_copies(streams, streams.compute_stream())
    streams.copy_async(pairs)
    event = streams.record(streams.copy_stream)
    ordering.before_freeing_recomputed(streams, streams.compute_stream(), event)
    pairs.clear()
    for entry in parked:
        streams.shrink(entry.storage)
    return parked


def unpark(group, parked: list[Parked]) -> int:
    """Grow each storage back and copy its bytes in; backward may read them once this returns."""
    if not parked:
        return 0
    context = group.device
    streams = context.streams
    pairs = []
    for entry in parked:
        streams.regrow(entry.storage, entry.nbytes)
        pairs.append((flat_bytes(entry.storage), entry.host.view(entry.nbytes)))
    ordering.before_restore_copies(streams, streams.compute_stream())
    streams.copy_async(pairs)
    event = streams.record(streams.copy_stream)
    ordering.before_using_recomputed(streams, streams.compute_stream(), event)
    pairs.clear()
    for entry in parked:
        host, entry.host = entry.host, None
        context.pool.release(host)
    return len(parked)

