"""The offloader: a saved-tensor hooks scope around each decoder layer's forward.

Knows nothing about transformers. The caller (hf_offload.api) tells it, for each layer call,
whether the module is training, which device the layer runs on, whether this call starts a
forward pass (and how many tokens it carries), whether the layer keeps its activations, and
which tensors are parameters.

Forward: each layer call is a `LayerGroup`. Its pack hook decides per saved tensor and returns
a handle; when the layer returns, one batch of copies to the host is queued on the copy stream
(after the compute stream, by an event) and the sources stay referenced until the next layer
has run, when the compute stream is made to wait for the batch and they are released. So at
most two layers' offloaded activations are on the device at once. A layer that keeps its
activations (one of the last `keep_last_layers`, or one the device-memory budget leaves on the
device) packs nothing to the host; what it saves is counted as resident.

Backward: the first unpack of a group (the start of that layer's backward) brings back its own
copies if they are not back yet and queues the copies of the next `prefetch_layers` groups that
backward will need; groups backward has passed let go of what was brought back for them.

Everything fixed for a whole forward pass (the step's budget and plan, the parameters outside
the layers) is settled at its first layer; the per-layer path does only per-layer work, because
on a GPU host the CPU time of each layer call is time the device may wait.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from copy import deepcopy

import torch

from . import forks, ordering, recompute
from .disk import DiskStore
from .handles import HostCopy, HostLedger, OffloadedTensor
from .planner import place_tiers, plan
from .pool import HostBudget, HostPool, rounded_size
from .stats import LifetimeCounters, OffloadStats, StepCounters
from .streams import flat_bytes, streams_for

logger = logging.getLogger("hf_offload")

_NO_ACCELERATOR = (
    "hf_offload: the model is on the CPU, where activations already live in host memory; offloading "
    "does nothing until the model is moved to an accelerator (simulate_on_cpu=True runs the engine anyway)"
)

_STRIDED = torch.strided

# A device-memory budget: bytes, or a function of (device, tokens this step) giving the bytes.
Budget = int | Callable[[torch.device, "int | None"], int] | None


def current_backward_id() -> int:
    """An id of the backward pass running on this thread, -1 outside backward.

    There is no public API for this; torch's own FSDP2 and ModuleTracker use the same private
    call. It tells a layer re-run during backward (a reentrant checkpoint's recompute), which
    must not offload, and tells one backward from the next (retain_graph) for prefetching.
    """
    return torch._C._current_graph_task_id()


# What a layer before a checkpointed one must hold for its copies back to wait for that layer's
# peak to pass (`ActivationOffloader._restore_ahead`): below it the memory held through the peak
# is too small to matter (8B's input at 32k tokens), and copying ahead as early as possible is safest.
LATE_PREFETCH_BYTES = 256 * 2**20

# From this many bytes a layer's copies to the host in forward let go of their sources at the next
# layer's attention (`ActivationOffloader.release_before_attention`), not at that layer's end: the
# next layer's attention holds the forward's peak, and the wait it may cost (the copy's remaining
# time, at most bytes / 55 GB/s on an H200's pinned link: 39 ms at 2 GiB, Llama-3-8B's layer input
# at 262,144 tokens) is small beside a layer's forward there, whose attention grows as tokens^2.
EARLY_RELEASE_BYTES = 2 * 2**30


@contextlib.contextmanager
def early_release_threshold(nbytes: int) -> Iterator[None]:
    """Within this block, `EARLY_RELEASE_BYTES` is `nbytes` (the memory simulator's steps of systems
    that let go of a layer's input only later, ALST's: 2**62)."""
    global EARLY_RELEASE_BYTES
    previous, EARLY_RELEASE_BYTES = EARLY_RELEASE_BYTES, nbytes
    try:
        yield
    finally:
        EARLY_RELEASE_BYTES = previous


def _offloader_with_options(options: dict) -> ActivationOffloader:
    return ActivationOffloader(**options)


def in_backward() -> bool:
    return current_backward_id() != -1


# What a view's base must be for the view to be kept as a parameter, without a storage lookup (a
# module global, so that a test can blind the engine to parameters).
PARAMETER_TYPES: tuple[type, ...] = (torch.nn.Parameter,)


class _InFlight:
    """A batch of copies to the host whose sources must stay alive until it has finished. The
    copies are held weakly: a graph dropped meanwhile (an exception in the next layer) must free
    its host memory at once, not when the batch is released."""

    __slots__ = ("sources", "copies", "event", "nbytes")

    def __init__(self, copies: list[HostCopy], event, nbytes: int) -> None:
        self.sources = [copy.source for copy in copies]
        self.copies = [weakref.ref(copy) for copy in copies]
        self.event = event
        self.nbytes = nbytes


class DeviceContext:
    """Streams, pinned pool and ledger for one device (a model split over several GPUs gets one
    copy stream and one pool per GPU, charged to the engine's one host budget)."""

    def __init__(self, device: torch.device, ledger: HostLedger, budget: HostBudget) -> None:
        self.device = device
        # What Tensor.get_device() answers for tensors on this device (-1 on the CPU and the meta
        # device): cheaper to compare than torch.device objects.
        self.device_index = torch.empty(0, device=device).get_device()
        self.streams = streams_for(device)
        self.pool = HostPool(self.streams, budget)
        self.ledger = ledger
        self.owner = forks.this_process()

    @property
    def inherited(self) -> bool:
        """This process is a fork of the one that made the context: its streams, pool and the
        copies made with it are the parent's."""
        return not forks.made_here(self.owner)

    def offload_async(self, copies: list[HostCopy], engine: ActivationOffloader) -> _InFlight | None:
        streams = self.streams
        acquire = self.pool.acquire
        pairs, placed = [], []
        nbytes = 0
        for copy in copies:
            try:
                host = acquire(copy.host_size)
            except (RuntimeError, MemoryError) as error:
                # The tensor simply stays on the device: its handle keeps the source.
                engine.host_allocation_failed(copy, error)
                continue
            copy.host_block = host
            nbytes += copy.nbytes
            if copy.whole:
                pairs.append((host.typed(copy.dtype, copy.shape, copy.stride), copy.version_probe))
            else:
                # The byte view of the source is made here, on the compute stream and before the
                # event: making it (set_) is an access to the source, which the copy stream must
                # be ordered after, and nothing may touch the source on the compute stream between
                # the event and the copy (the CUDA stream sanitizer checks both).
                pairs.append((host.view(copy.nbytes), flat_bytes(copy.source)))
            placed.append(copy)
        if not placed:
            return None
        ordering.before_offload_copies(streams, streams.compute_stream())
        for copy in placed:
            if copy.version_probe._version != copy.version:
                copy.modified = True
        streams.copy_async(pairs)
        event = streams.record(streams.copy_stream)
        batch = _InFlight(placed, event, nbytes)
        self.ledger.hold_device(nbytes)
        for copy in placed:
            if copy.store is not None:
                copy.store.write(copy, self, event)  # from the staging buffer, once the copy out is done
        return batch

    def release(self, batch: _InFlight) -> None:
        streams = self.streams
        ordering.before_releasing_sources(streams, streams.compute_stream(), batch.event)
        for ref in batch.copies:
            copy = ref()
            if copy is not None:
                if copy.version_probe._version != copy.version:
                    copy.modified = True
                copy.source = copy.version_probe = None
        batch.sources.clear()
        self.ledger.device_bytes -= batch.nbytes

    def restore_async(self, copies: Iterable[HostCopy]) -> int:
        """Queue the copies back to the device of those not on it; returns how many."""
        # A copy on disk is read back into host memory first (`ActivationOffloader._restore_ahead`).
        todo = [copy for copy in copies if copy.host_block is not None and copy.needs_restore()]
        if not todo:
            return 0
        streams = self.streams
        targets = [streams.device_buffer(copy.nbytes) for copy in todo]
        pairs = [(target, copy.host_block.view(copy.nbytes)) for target, copy in zip(targets, todo, strict=True)]
        ordering.before_restore_copies(streams, streams.compute_stream())
        streams.copy_async(pairs)
        event = streams.record(streams.copy_stream)
        for target, copy in zip(targets, todo, strict=True):
            copy.set_ahead(target.untyped_storage(), event)
        return len(todo)


class LayerGroup:
    """One layer call: its pack and unpack hooks, the host copies it made, and the bytes it kept."""

    __slots__ = (
        "engine",
        "device",
        "device_index",
        "sequence",
        "position",
        "keep",
        "kept_reason",
        "_protected",
        "_protected_source",
        "copies",
        "shared",
        "prev",
        "reached_in",
        "calls",
        "pending_bytes",
        "offloaded_bytes",
        "shared_bytes",
        "kept_bytes",
        "saved",
        "to_disk",
        "disk_pending",
        "disk_copies",
        "disk_bytes",
        "refused_bytes",
        "late_point",
        "late_pending",
        "attention_hooked",
        "parked",
        "__weakref__",
    )

    def __init__(self, engine, device, sequence, position, keep, kept_reason, protected, prev) -> None:
        self.engine = engine
        self.device = device
        self.device_index = device.device_index
        self.sequence = sequence
        self.position = position  # the layer call's index in its forward pass
        self.keep = keep  # the activations stay on the device
        self.kept_reason = kept_reason  # "kept_layer" (keep_last_layers) or "kept_for_budget"
        self._protected: set[int] | None = None  # the layer's and the model's parameters, read on first need
        self._protected_source = protected
        self.copies: list[HostCopy] = []
        self.shared: list[HostCopy] = []  # offloaded by an earlier group, saved here again
        self.prev = prev  # weakref to the group created before this one: backward needs it next
        self.reached_in = -1
        self.calls = 0
        self.pending_bytes = 0  # host bytes of copies decided in this layer call, not yet placed
        self.offloaded_bytes = 0
        self.shared_bytes = 0
        self.kept_bytes = 0  # storage bytes this kept layer holds on the device
        self.saved: dict[int, tuple[torch.Tensor, int, object]] = {}  # id -> (tensor, version, handle), this call
        self.to_disk = False  # the tier plan puts this layer's copies on disk
        self.disk_pending = 0  # file bytes of the copies decided for disk in this call
        self.disk_copies = 0
        self.disk_bytes = 0
        self.refused_bytes = 0  # host bytes of the copies no tier took (kept 'over_budget')
        self.late_point = False  # the layer signals the end of its peak in backward (`prefetch_point`)
        self.late_pending = False  # the layers before it come back at that point, not at its backward start
        # The gradient of the attention block's output in the graph backward runs is hooked
        # (`ActivationOffloader.restore_recomputed`): what the recompute saved for it may wait on the host.
        self.attention_hooked = False
        self.parked: list = []  # storages the layer's recompute saved, on the host now (`recompute`)

    def protected_storages(self) -> set[int]:
        """The storages of the layer's parameters and buffers and of the model's others, read on
        the first tensor that needs them (after PEFT, dtype changes or sharding have run)."""
        protected = self._protected
        if protected is None:
            source = recompute.storage_ptrs(self._protected_source())
            protected = self._protected = source | self.engine.pass_protected()
            self._protected_source = None
        return protected

    def pack(self, tensor: torch.Tensor) -> object:
        # Runs for every tensor every layer saves, on the CPU that issues the GPU's work: each
        # call into torch here is paid thousands of times a step, so the common cases come first.
        # Kept tensors are returned as `.data`, an alias without autograd history: returning a
        # saved *output* itself would make a reference cycle through its grad_fn that keeps the
        # whole graph alive, and `.data` is the cheapest alias (autograd checks no versions
        # through saved-tensor hooks either way).
        self.calls += 1
        keep = self.engine.step.keep
        # The same tensor saved again by this layer (a norm's output feeding q, k and v; the
        # rotary cos/sin used four times) gets the same handle. The tensor is held until the layer
        # returns, so its id cannot be reused by another one meanwhile.
        again = self.saved.get(id(tensor))
        if again is not None and again[0] is tensor and again[1] == tensor._version:
            keep("duplicate", tensor.nbytes)
            return again[2]
        if type(tensor) is not torch.Tensor:
            # A Parameter is kept as itself, as autograd keeps a saved leaf without hooks (a leaf
            # has no grad_fn, so no reference cycle): DeepSpeed ZeRO-3 frees a gathered weight by
            # replacing param.data, and an alias would keep it alive until backward.
            if isinstance(tensor, torch.nn.Parameter):
                keep("parameter", tensor.nbytes)
                return tensor
            keep("unsupported", tensor.nbytes)
            return tensor.detach()
        base = tensor._base
        if base is not None and type(base) is not torch.Tensor and isinstance(base, PARAMETER_TYPES):
            # A view of a parameter: what linear layers save (weight.t()), and FSDP1's layer
            # weights (views of its flat parameter). Other tensors sharing a parameter's storage
            # are found by `protected_storages`.
            keep("parameter", tensor.nbytes)
            return tensor.data
        engine = self.engine
        nbytes = tensor.nbytes
        if (
            tensor.get_device() != self.device_index
            or tensor.layout is not _STRIDED
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            keep("unsupported", nbytes)
            return tensor.detach()
        if nbytes < engine.min_offload_bytes or nbytes == 0:
            keep("too_small", nbytes)
            return tensor.data
        storage = tensor.untyped_storage()
        ptr = recompute.storage_key(storage)
        protected = self._protected
        if ptr in (protected if protected is not None else self.protected_storages()):
            keep("parameter", nbytes)
            return tensor.data
        version = tensor._version
        entry = engine._offloaded_this_pass.get(ptr)
        copy = entry() if entry is not None else None
        if copy is not None and not copy.matches(storage, version):
            copy = None  # another storage at the same address, or this one changed in place
        if self.keep:
            # Counted as this layer's resident bytes unless an earlier layer offloaded the storage:
            # a storage's bytes belong to the first layer that saved it, kept or offloaded alike,
            # so that a layer's measured bytes do not depend on what the plan did with it.
            resident = engine._kept_this_pass.get(ptr)
            if copy is None and (resident is None or resident[0]() is not storage or resident[1] != version):
                engine._kept_this_pass[ptr] = (weakref.ref(storage), version)
                self.kept_bytes += storage.nbytes()
            keep(self.kept_reason, nbytes)
            return tensor.data
        if copy is not None:
            keep("duplicate", nbytes)
            if copy not in self.copies and copy not in self.shared:
                self.shared.append(copy)
                self.shared_bytes += copy.nbytes
            handle = OffloadedTensor(copy, tensor)
            self.saved[id(tensor)] = (tensor, version, handle)
            return handle
        if tensor.requires_grad and tensor.grad_fn is None:
            # A leaf that requires grad, not a parameter: an input made to require grad, such as
            # the embeddings' output when transformers' checkpointing makes it so for frozen
            # embeddings. The graph's AccumulateGrad node holds it until backward, so a copy would
            # move bytes and free nothing. Kept as itself, like a parameter (a leaf makes no cycle).
            keep("leaf", nbytes)
            return tensor
        storage_bytes = storage.nbytes()
        needed = rounded_size(storage_bytes)
        store = None
        if self.to_disk or engine.budget.held + self.pending_bytes + needed > engine.host_room:
            store = engine.tier_for(self, needed)
            if store is False:
                engine.over_budget(needed, self.pending_bytes)
                keep("over_budget", nbytes)
                self.refused_bytes += needed
                return tensor.detach()
        copy = HostCopy(tensor, nbytes, storage, storage_bytes, needed, self.device, version, store)
        self.copies.append(copy)
        self.pending_bytes += needed  # a copy to disk needs its staging buffer in host memory
        self.offloaded_bytes += storage_bytes
        if store is not None:
            self.disk_pending += needed
            self.disk_copies += 1
            self.disk_bytes += storage_bytes
        # Weak: the entry must keep neither the copy nor, through it, host memory alive.
        engine._offloaded_this_pass[ptr] = weakref.ref(copy)
        self.saved[id(tensor)] = (tensor, version, copy)
        return copy

    def unpack(self, packed: object) -> torch.Tensor:
        engine = self.engine
        engine.lifetime.unpack_calls += 1
        backward = current_backward_id()
        if self.reached_in != backward:
            self.reached_in = backward
            with engine._lock:
                engine._backward_reached(self, backward)
        if isinstance(packed, torch.Tensor):
            return packed
        engine.step.restored_tensors += 1
        return packed.restore()  # type: ignore[attr-defined]


class LayerScope:
    """The hooks context of one decoder layer call (see `ActivationOffloader.layer_scope`)."""

    __slots__ = ("engine", "arguments", "group", "hooks")

    def __init__(self, engine: ActivationOffloader, arguments: dict) -> None:
        self.engine, self.arguments = engine, arguments
        self.group: LayerGroup | None = None
        self.hooks = None

    def __enter__(self) -> LayerGroup | None:
        group = self.group = self.engine.enter_layer(**self.arguments)
        if group is not None:
            self.hooks = torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack)
            self.hooks.__enter__()
        return group

    def __exit__(self, *exc_info) -> None:
        if self.group is not None:
            self.hooks.__exit__(*exc_info)
            self.engine.exit_layer(self.group, self.arguments.get("name", "?"))


# With the disk tier, host memory kept free for staging buffers: this many layers' copies at once
# (one layer's being written while the next is copied out; in backward, one read ahead of the one
# being copied back).
STAGING_LAYERS = 2
# The disk's reads start this many layers further ahead than the copies back at most (more each
# step in which backward had to wait for a read).
MAX_EXTRA_READAHEAD = 8


def place_layers(layer_bytes, offloaded_layers: int, *, host_bytes: int, disk_bytes: int):
    """`place_tiers` as the engine calls it (with its staging), for layers of the given host bytes:
    the planning the engine does and the simulator reports."""
    return place_tiers(
        layer_bytes,
        offloaded_layers=offloaded_layers,
        host_bytes=host_bytes,
        disk_bytes=disk_bytes,
        staging_layers=STAGING_LAYERS,
    )


class ActivationOffloader:
    # What a forked child keeps of its parent's engine: the options, what was measured and planned,
    # the counters, what was said. Everything else is the process's own and is made anew in a child
    # (`_make_process_state`); tests/test_fork.py holds every attribute to one of the two, so that a
    # field added later is decided on, not inherited from the parent by default.
    KEPT_IN_A_FORK = frozenset(
        {
            "min_offload_bytes", "simulate_on_cpu", "prefetch_layers", "max_device_bytes", "disk_dir",
            "max_disk_bytes", "step", "lifetime", "mode", "_warned", "_sequence", "_position", "_pass_tokens",
            "_pass_layers", "_pass_host_bytes", "_bytes_per_token", "_offloadable_layers", "_measured_tokens",
            "_offload_positions", "_disk_positions", "_staging_reserve", "_host_bytes_per_token", "_extra_readahead",
        }
    )  # fmt: skip

    def __init__(self, **options) -> None:
        self._make_process_state(HostBudget(), disk=None)
        self.configure(**options)
        self.step = StepCounters()
        self.lifetime = LifetimeCounters()
        self.mode = "idle"
        self._sequence = 0
        self._warned: set[str] = set()
        # The budget's plan: measured per layer position of the last complete pass.
        self._position = 0  # layer calls so far in this forward pass
        self._pass_tokens: int | None = None
        self._pass_layers: list[tuple[int, int, bool]] = []  # per layer call: bytes, restored bytes, offloadable
        self._pass_host_bytes: list[int] = []  # per layer call: host bytes its copies take (pooled sizes)
        self._bytes_per_token: list[tuple[float, float]] | None = None  # the same per token, per position
        self._offloadable_layers = 0
        self._measured_tokens: int | None = None
        self._offload_positions: int | None = None  # this pass offloads positions below it; None: all
        # The disk tier's plan for this pass: its leading positions whose copies go to disk (None:
        # nothing measured yet, so layers go to disk only once the host budget is reached), and the
        # host memory kept free for staging buffers.
        self._disk_positions: int | None = None
        self._staging_reserve = 0
        self._host_bytes_per_token: list[float] | None = None
        self._extra_readahead = 0

    def _make_process_state(self, budget: HostBudget, disk: DiskStore | None) -> None:
        """What belongs to the process that makes it: the lock, the host accounting, the disk store,
        the devices' streams and pools, the copies in flight and what this pass and step hold of the
        graphs alive. A forked child makes its own (`_after_fork`)."""
        self._owner = forks.this_process()
        # Several threads may run layers at once (nn.DataParallel replicas, autograd's device
        # threads): the state shared between layer calls changes under this lock.
        self._lock = threading.RLock()
        self.ledger = HostLedger()
        self.budget = budget  # max_host_bytes and what the pools hold of it
        self.disk: DiskStore | None = disk
        self._devices: dict[torch.device, DeviceContext] = {}
        self._in_flight: deque[tuple[DeviceContext, _InFlight]] = deque()
        self._offloaded_this_pass: dict[int, weakref.ref[HostCopy]] = {}
        # Storages kept layers counted as resident in this pass: (storage, version) by address.
        self._kept_this_pass: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self._pass_protected: set[int] | None = None
        self._pass_protected_source: Callable[[], Iterable[torch.Tensor]] | None = None
        self._holding_ahead: list[weakref.ref[LayerGroup]] = []
        self._last_group: weakref.ref[LayerGroup] | None = None
        self._backward_id = -1
        self._backward_group: weakref.ref[LayerGroup] | None = None
        self._backward_since_step_start = False
        # Kept layers' resident bytes, by group sequence, until backward has passed them.
        self._kept_resident: dict[int, int] = {}
        self._kept_resident_bytes = 0
        # This step's layer calls: autograd's graph holds each group through its unpack hook, so
        # a group alive means a graph of this step is alive (several forwards before a backward).
        self._step_groups: weakref.WeakSet[LayerGroup] = weakref.WeakSet()
        self._disk_at_step_start = (0, 0, 0.0, 0.0, 0.0)
        self._reads_waited_at_step_start = 0
        # The checkpoint recomputes running, per thread (DataParallel's replicas run backward on
        # threads of their own), innermost last (`recompute`).
        self._recompute_threads = threading.local()

    def configure(
        self,
        *,
        min_offload_bytes: int,
        simulate_on_cpu: bool,
        prefetch_layers: int = 1,
        max_host_bytes: int = sys.maxsize,
        max_device_bytes: Budget = None,
        disk_dir: str | None = None,
        max_disk_bytes: int | None = None,
    ) -> None:
        if not forks.made_here(self._owner):
            self._after_fork()
        disk_bytes = sys.maxsize if max_disk_bytes is None else max_disk_bytes
        store = self.disk
        if disk_dir is not None and store is not None and store.directory == disk_dir:
            # The same directory: the same file and threads, and the tensors in it stay where they are.
            store.max_bytes = disk_bytes
        elif disk_dir is not None:
            # Opened first: if the directory fails us now, the engine stays as it was.
            store = DiskStore(disk_dir, disk_bytes)
        else:
            store = None
        self.min_offload_bytes = min_offload_bytes
        self.simulate_on_cpu = simulate_on_cpu
        self.prefetch_layers = prefetch_layers
        self.budget.limit = max_host_bytes
        self.max_device_bytes = max_device_bytes
        self.disk_dir = disk_dir
        self.max_disk_bytes = max_disk_bytes
        if self.disk is not None and self.disk is not store:
            self.disk.close()  # the copies still in it keep it until they die
        self.disk = store

    @property
    def max_host_bytes(self) -> int:
        return self.budget.limit

    def _after_fork(self) -> None:
        """This process is a fork of the one that made the engine's streams, pools and disk store,
        which stay the parent's (`forks`): the copies of the graphs inherited keep them, inert.
        From here on the engine works with state of its own (`_make_process_state`), its resources
        made as it first needs them; the disk tier gets a file and threads of its own in the same
        directory. The child's passes neither chain to the inherited graphs' layers (backward would
        read ahead into them) nor count as their step."""
        disk = self.disk.reopened() if self.disk is not None else None
        self._make_process_state(HostBudget(self.budget.limit), disk)

    def options(self) -> dict[str, object]:
        return {
            "min_offload_bytes": self.min_offload_bytes,
            "simulate_on_cpu": self.simulate_on_cpu,
            "prefetch_layers": self.prefetch_layers,
            "max_host_bytes": self.max_host_bytes,
            "max_device_bytes": self.max_device_bytes,
            "disk_dir": self.disk_dir,
            "max_disk_bytes": self.max_disk_bytes,
        }

    def close(self) -> None:
        """Offloading is disabled: the disk tier's file and threads go (once no live graph holds a
        tensor in it), and the host pools give back their free buffers. In a forked child, only
        what the child made itself."""
        if not forks.made_here(self._owner):
            self._devices = {}  # the parent's; the disk store below is too, and closes nothing
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        for context in self._devices.values():
            context.pool.trim()

    @property
    def host_room(self) -> int:
        """Host bytes the host tier may fill: the budget, less what the disk tier's staging
        buffers need kept free while layers go to disk in the order they come (before the first
        step has measured anything to plan with; a plan puts the disk layers first)."""
        return self.max_host_bytes - self._staging_reserve

    def tier_for(self, group: LayerGroup, nbytes: int) -> DiskStore | None | bool:
        """Where a copy of `nbytes` goes when the plan puts its layer on disk or the host tier
        has no room for it: the disk store, None for host memory, False for neither (it stays on
        the device)."""
        budget = self.budget

        def host_fits() -> bool:
            return budget.has_room(group.pending_bytes + nbytes)

        if group.to_disk:
            store = self.disk_for(group, nbytes)
            return store if store is not None else (None if host_fits() else False)
        if self._disk_positions is not None and not host_fits():  # planned: a disk tier exists
            # A layer the plan keeps in host memory: what fills it is the staging buffers of the
            # disk layers' writes still in flight, which the plan counted; wait for them.
            self.disk.wait_for_room(budget, group.pending_bytes + nbytes)
        if budget.held + group.pending_bytes + nbytes <= self.host_room:  # within the budget: host_room <= it
            return None
        store = self.disk_for(group, nbytes)
        return store if store is not None else (None if host_fits() else False)

    def disk_for(self, group: LayerGroup, nbytes: int) -> DiskStore | None:
        """The disk store, if it takes a copy of `nbytes` from `group` now: room in the file, and
        in host memory for the staging buffer (waiting for writes in flight to free some)."""
        store = self.disk
        if store is None or not store.accepts(group.disk_pending + nbytes):
            return None
        budget = self.budget
        if not budget.has_room(group.pending_bytes + nbytes):
            store.wait_for_room(budget, group.pending_bytes + nbytes)
            if not budget.has_room(group.pending_bytes + nbytes):
                return None
        return store

    def __deepcopy__(self, memo: dict) -> ActivationOffloader:
        # A deep-copied model (a DPO reference model, say) gets an offloader of its own with the
        # same options, never a share of this one's handles and counters (an "auto" budget reads
        # the copy's model: the options are copied with the rest).
        return ActivationOffloader(**deepcopy(self.options(), memo))

    def __reduce__(self):
        # Pickled (torch.save(model)): the options, as a deep copy keeps them.
        return (_offloader_with_options, (self.options(),))

    def device_context(self, device: str | torch.device) -> DeviceContext | None:
        return self._devices.get(torch.device(device))

    def pass_host_bytes(self) -> tuple[list[int], int]:
        """The forward pass just run, as the next pass's tier plan reads it: the host bytes each
        layer call's copies took or asked for (pooled sizes, wherever they went), and how many
        leading layer calls were offloaded. The memory simulator places a step with them for a
        host and a disk it does not have (`place_tiers`, `STAGING_LAYERS`)."""
        with self._lock:
            offloaded = sum(1 for _own, restored, _offloadable in self._pass_layers if restored is not None)
            return list(self._pass_host_bytes), offloaded

    def stats(self) -> OffloadStats:
        step, life = self.step, self.lifetime
        pools = [context.pool for context in self._devices.values()]
        return OffloadStats(
            mode=self.mode,
            offloaded_tensors=step.offloaded_tensors,
            offloaded_bytes=step.offloaded_bytes,
            kept_tensors=dict(step.kept_tensors),
            kept_bytes=dict(step.kept_bytes),
            restored_tensors=step.restored_tensors,
            restored_on_demand=step.restored_on_demand,
            restored_ahead=step.restored_ahead,
            layers_offloaded=step.layers_offloaded,
            max_layer_offloaded_bytes=step.max_layer_offloaded_bytes,
            peak_forward_held_bytes=step.peak_forward_held_bytes,
            peak_backward_held_bytes=step.peak_backward_held_bytes,
            max_device_bytes=step.max_device_bytes,
            layer_activation_bytes=step.layer_activation_bytes,
            peak_resident_bytes=step.peak_resident_bytes,
            layers_kept_for_budget=step.layers_kept_for_budget,
            planned_peak_bytes=step.planned_peak_bytes,
            plan_tokens=step.plan_tokens,
            host_bytes_held=self.budget.held,
            live_host_copies=self.ledger.copies_alive,
            pool_bytes=sum(pool.owned_bytes for pool in pools),
            pool_free_bytes=sum(pool.free_bytes for pool in pools),
            pool_allocations=sum(pool.allocations for pool in pools),
            max_host_bytes=self.max_host_bytes,
            total_layer_scopes=life.layer_scopes,
            total_pack_calls=life.pack_calls,
            total_unpack_calls=life.unpack_calls,
            recompute_offloaded_tensors=step.recompute_offloaded_tensors,
            recompute_offloaded_bytes=step.recompute_offloaded_bytes,
            recompute_restored_tensors=step.recompute_restored_tensors,
            recompute_kept_bytes=step.recompute_kept_bytes,
            early_releases=step.early_releases,
            **self._disk_stats(),
        )

    def _disk_stats(self) -> dict[str, object]:
        store, step = self.disk, self.step
        if store is None:
            return {}
        store.reap()
        written, read, write_seconds, read_seconds, waited = (
            now - then
            for now, then in zip(
                (store.bytes_written, store.bytes_read, store.write_seconds, store.read_seconds, store.wait_seconds),
                self._disk_at_step_start,
                strict=True,
            )
        )
        return {
            "disk_dir": store.directory,
            "disk_io": store.mode,
            "max_disk_bytes": store.max_bytes,
            "disk_offloaded_tensors": step.disk_offloaded_tensors,
            "disk_offloaded_bytes": step.disk_offloaded_bytes,
            "layers_on_disk": step.layers_on_disk,
            "planned_disk_layers": step.planned_disk_layers,
            "disk_bytes_written": written,
            "disk_bytes_read": read,
            "disk_write_gbps": written / write_seconds / 1e9 if write_seconds > 0 else None,
            "disk_read_gbps": read / read_seconds / 1e9 if read_seconds > 0 else None,
            "disk_wait_seconds": waited,
            "disk_bytes_held": store.held_bytes,
        }

    def over_budget(self, nbytes: int, pending: int) -> None:
        self._warn_once(
            "budget",
            f"hf_offload: host memory budget reached: {self.budget.held + pending} bytes offloaded and "
            f"{nbytes} more would exceed max_host_bytes={self.max_host_bytes}; tensors over the budget stay on "
            "the device (counted as kept 'over_budget'). Raise max_host_bytes or free host memory to offload more.",
        )

    def host_allocation_failed(self, copy: HostCopy, error: BaseException) -> None:
        self.step.offloaded_tensors -= 1
        self.step.offloaded_bytes -= copy.nbytes
        if copy.store is not None:
            self.step.disk_offloaded_tensors -= 1
            self.step.disk_offloaded_bytes -= copy.nbytes
        self.step.keep("no_host_memory", copy.nbytes)
        self._warn_once(
            "allocation",
            f"hf_offload: could not allocate {copy.nbytes} bytes of host memory ({error}); tensors that cannot "
            "get host memory stay on the device (counted as kept 'no_host_memory')",
        )

    def note_no_accelerator(self) -> None:
        self._warn_once("cpu", _NO_ACCELERATOR)

    def pass_protected(self) -> set[int]:
        """Storages of the parameters outside the layers, read once per forward pass, on first need."""
        protected = self._pass_protected
        if protected is None:
            source = self._pass_protected_source
            protected = self._pass_protected = recompute.storage_ptrs(source()) if source is not None else set()
        return protected

    def layer_scope(self, **arguments) -> LayerScope:
        """Run one decoder layer's forward with its saved tensors routed through the offloader:
        `with engine.layer_scope(...): output = layer(...)`, with `enter_layer`'s arguments."""
        return LayerScope(self, arguments)

    def enter_layer(
        self,
        *,
        training: bool,
        device: torch.device | None,
        starts_pass: bool,
        keep: bool,
        protected: Callable[[], Iterable[torch.Tensor]],
        pass_protected: Callable[[], Iterable[torch.Tensor]],
        name: str = "?",
        tokens: int | None = None,
        late_point: bool = False,
    ) -> LayerGroup | None:
        """The group whose hooks route this layer call's saved tensors; None when the engine
        stays out of it (not training, grad off, inside backward, or on the CPU).

        `protected` yields the layer's parameters and buffers, `pass_protected` every parameter
        of the model outside the layers; both are read during the call (on first need), so they
        are right after PEFT, dtype changes or sharding. `tokens`, given with `starts_pass`, is
        the number of tokens the pass carries (for the device-memory budget's plan). `name`
        names the layer in warnings (`exit_layer` takes it). `late_point`: the layer is checkpointed
        and will call `prefetch_point` in its backward once its peak (attention's backward) is
        past, so that the layers before it may come back then rather than at its start."""
        # Decided here, not in the pack hook: autograd calls pack hooks with grad mode off.
        if not (training and torch.is_grad_enabled()) or device is None or in_backward():
            return None
        if device.type == "cpu" and not self.simulate_on_cpu:
            self.note_no_accelerator()
            return None
        if starts_pass and not forks.made_here(self._owner):  # before taking the lock
            self._after_fork()
        with self._lock:
            if starts_pass:
                self._start_pass(device, pass_protected, tokens)
            self.lifetime.layer_scopes += 1
            context = self._devices.get(device)
            if context is None:
                context = self._devices[device] = DeviceContext(device, self.ledger, self.budget)
                self.mode = "cpu-simulation" if device.type == "cpu" else device.type
            self._sequence += 1
            position = self._position
            self._position += 1
            kept_reason = "kept_layer"
            if not keep and self._offload_positions is not None and position >= self._offload_positions:
                keep, kept_reason = True, "kept_for_budget"
            group = LayerGroup(self, context, self._sequence, position, keep, kept_reason, protected, self._last_group)
            if self._disk_positions is not None and position < self._disk_positions:
                group.to_disk = True
            group.late_point = late_point
            self._last_group = weakref.ref(group)
            self._step_groups.add(group)
        return group

    def exit_layer(self, group: LayerGroup, name: str) -> None:
        with self._lock:
            self._finish_layer(group, group.device, name)

    def _finish_layer(self, group: LayerGroup, context: DeviceContext, name: str) -> None:
        group.saved = {}  # let go of the tensors saved (the layer's own references are what count)
        self.lifetime.pack_calls += group.calls
        step = self.step
        # Counted here rather than per tensor in the pack hook (a failed host allocation below
        # takes its copy back out of the counts).
        step.offloaded_tensors += len(group.copies)
        step.offloaded_bytes += group.offloaded_bytes
        self.ledger.copies_alive += len(group.copies)
        if self.disk is not None:
            self.disk.reap()  # writes finished meanwhile give their staging buffers back
            if group.disk_copies:
                step.disk_offloaded_tensors += group.disk_copies
                step.disk_offloaded_bytes += group.disk_bytes
                step.layers_on_disk += 1
            if self._disk_positions is None:
                # Not planned (nothing measured yet): keep room for staging the layers to come,
                # as large as the largest so far, once the host fills up.
                self._staging_reserve = max(self._staging_reserve, STAGING_LAYERS * group.pending_bytes)
        # Queued even when the layer raised: handles made before the error must stay valid.
        batch = context.offload_async(group.copies, self) if group.copies else None
        if batch is not None:
            self._in_flight.append((context, batch))
        if group.kept_bytes:
            self._kept_resident[group.sequence] = group.kept_bytes
            self._kept_resident_bytes += group.kept_bytes
        self._note_resident()
        offloadable = not (group.keep and group.kept_reason == "kept_layer")
        step.layer_activation_bytes += group.offloaded_bytes + group.kept_bytes
        # (bytes it saved, bytes it brought back or None when it kept them, offloadable)
        restored = None if group.keep else group.offloaded_bytes + group.shared_bytes
        self._pass_layers.append((group.offloaded_bytes + group.kept_bytes, restored, offloadable))
        # What the layer's copies need, wherever they went: a plan made from what got host memory
        # alone would see no need for the disk after a step that had no room.
        self._pass_host_bytes.append(group.pending_bytes + group.refused_bytes if not group.keep else group.kept_bytes)
        # Earlier batches have had this whole layer's compute to finish; release their sources.
        while len(self._in_flight) > (1 if batch is not None else 0):
            owner, batch = self._in_flight.popleft()
            owner.release(batch)
        step.peak_forward_held_bytes = max(step.peak_forward_held_bytes, self.ledger.peak_device_bytes)
        if group.keep:
            if group.kept_reason == "kept_for_budget":
                step.layers_kept_for_budget += 1
            return
        step.layers_offloaded += 1
        step.max_layer_offloaded_bytes = max(step.max_layer_offloaded_bytes, group.offloaded_bytes)
        if group.calls == 0:
            self._warn_once(
                "shadowed",
                f"hf_offload: decoder layer {name} saved no tensors through hf_offload's hooks, so nothing "
                "was offloaded from it. Another saved_tensors_hooks context inside the layer takes them, "
                "typically transformers' activation_checkpointing_enable(offload=True): call "
                "activation_checkpointing_enable() without offload=True to let hf_offload move the "
                "checkpoint inputs instead.",
            )

    def _note_resident(self) -> None:
        step = self.step
        resident = self._kept_resident_bytes + self.ledger.device_bytes
        if resident > step.peak_resident_bytes:
            step.peak_resident_bytes = resident

    def _start_pass(self, device: torch.device, pass_protected: Callable, tokens: int | None) -> None:
        self.release_in_flight()
        self._learn_from_last_pass()
        # A new step begins after a backward, or when no graph of an earlier forward is alive
        # any more (it was dropped, or its backward failed before reaching a decoder layer).
        if self._backward_since_step_start or not self._step_groups:
            self._new_disk_step()
            self.step = StepCounters()
            self._backward_since_step_start = False
            self._kept_resident.clear()
            self._kept_resident_bytes = 0
            self._step_groups = weakref.WeakSet()
        self.ledger.peak_device_bytes = self.ledger.device_bytes
        self._offloaded_this_pass.clear()
        self._kept_this_pass.clear()
        self._pass_protected = None
        self._pass_protected_source = pass_protected
        self._position = 0
        self._pass_tokens = tokens
        self._offload_positions = self._plan(device, tokens) if self.max_device_bytes is not None else None
        self._staging_reserve = 0
        self._disk_positions = self._plan_tiers(tokens) if self.disk is not None else None

    def _new_disk_step(self) -> None:
        store = self.disk
        if store is None:
            return
        store.reap()
        store.new_step()
        # Backward waited for a read last step: start reads one layer further ahead.
        if store.reads_waited > self._reads_waited_at_step_start and self._extra_readahead < MAX_EXTRA_READAHEAD:
            self._extra_readahead += 1
        self._reads_waited_at_step_start = store.reads_waited
        self._disk_at_step_start = (
            store.bytes_written,
            store.bytes_read,
            store.write_seconds,
            store.read_seconds,
            store.wait_seconds,
        )

    def _token_scale(self, tokens: int | None):
        """What a measured rate is multiplied by for a pass of `tokens`: rates measured without a
        token count are bytes per pass, and a pass of unknown length is taken to be as long as the
        measured one."""
        return 1 if self._measured_tokens is None else (tokens if tokens is not None else self._measured_tokens)

    def _plan_tiers(self, tokens: int | None) -> int | None:
        """How many leading layer calls of this pass put their copies on disk (planner.place_tiers);
        None before anything was measured."""
        rates = self._host_bytes_per_token
        if rates is None:
            return None
        scale = self._token_scale(tokens)
        layer_bytes = [round(rate * scale) for rate in rates]
        offloaded = self._offload_positions if self._offload_positions is not None else self._offloadable_layers
        store = self.disk
        chosen = place_layers(
            layer_bytes,
            offloaded,
            host_bytes=self.max_host_bytes - self.budget.held,
            disk_bytes=store.max_bytes - store.held_bytes,
        )
        self.step.planned_disk_layers = chosen.disk_layers
        if chosen.host_short:
            self._warn_once(
                "staging_budget",
                f"hf_offload: max_host_bytes={self.max_host_bytes} leaves no room for the disk tier's staging "
                f"buffers ({chosen.staging_bytes} bytes: {STAGING_LAYERS} layers' copies at once, each copied to "
                "host memory on its way to and from the disk); every offloaded layer goes to disk and what does not "
                "get a buffer stays on the device (counted as kept 'over_budget'). Raise max_host_bytes.",
            )
        elif not chosen.fits:
            self._warn_once(
                "disk_budget",
                f"hf_offload: a step of {tokens} tokens offloads about {chosen.disk_bytes} bytes to disk_dir="
                f"{store.directory!r} with {chosen.host_bytes} in host memory, more than max_disk_bytes="
                f"{store.max_bytes} leaves ({store.max_bytes - store.held_bytes} free); what fits neither stays on "
                "the device (counted as kept 'over_budget'). Raise max_disk_bytes or max_host_bytes.",
            )
        return chosen.disk_layers

    def _learn_from_last_pass(self) -> None:
        """Bytes per token of each layer position in the pass that just ended, if it was whole."""
        layers, self._pass_layers = self._pass_layers, []
        host_bytes, self._pass_host_bytes = self._pass_host_bytes, []
        if not layers or (self._bytes_per_token is not None and len(layers) < len(self._bytes_per_token)):
            return  # the pass stopped early (an exception in a layer): keep what a whole pass showed
        tokens = self._pass_tokens or 1
        previous = self._bytes_per_token or []
        rates = []
        for position, (own, restored, _) in enumerate(layers):
            if restored is None:
                # A kept layer brought nothing back; were it offloaded, it would bring back at least
                # its own bytes, and the shared copies seen when it last was.
                earlier = previous[position][1] if position < len(previous) else 0.0
                rates.append((own / tokens, max(own / tokens, earlier)))
            else:
                rates.append((own / tokens, restored / tokens))
        self._bytes_per_token = rates
        self._host_bytes_per_token = [nbytes / tokens for nbytes in host_bytes]
        self._offloadable_layers = sum(1 for *_, offloadable in layers if offloadable)
        self._measured_tokens = self._pass_tokens

    def _plan(self, device: torch.device, tokens: int | None) -> int | None:
        """How many leading layer calls this pass offloads under the budget; None for all of them."""
        budget = self.max_device_bytes
        if callable(budget):
            budget = budget(device, tokens)
        budget = max(int(budget), 0)
        step = self.step
        step.max_device_bytes = budget
        if self._bytes_per_token is None:
            return None  # nothing measured yet: the first step offloads every layer and measures them
        scale = self._token_scale(tokens)
        own = [round(rate * scale) for rate, _ in self._bytes_per_token]
        restored = [round(rate * scale) for _, rate in self._bytes_per_token]
        # Bytes already resident from an earlier forward of this step count against the budget.
        available = budget - self._kept_resident_bytes - self.ledger.device_bytes
        chosen = plan(
            own,
            available,
            offloadable_layers=self._offloadable_layers,
            prefetch_layers=self.prefetch_layers,
            restore_bytes=restored,
        )
        step.planned_peak_bytes = chosen.predicted_peak_bytes + budget - available
        step.plan_tokens = tokens
        if not chosen.fits:
            self._warn_once(
                "device_budget",
                f"hf_offload: a step of {tokens} tokens needs about {chosen.predicted_peak_bytes} bytes of decoder-"
                f"layer activations on the device even with every offloadable layer offloaded, more than the "
                f"{available} bytes max_device_bytes leaves (budget {budget}); it offloads every layer, as "
                "without a budget. Shorter sequences, checkpointing or a larger max_device_bytes fit it.",
            )
        return chosen.offloaded_layers

    def release_in_flight(self) -> None:
        """Wait for every batch of copies to the host still in flight and let go of its sources
        (what the next layer's end, or the start of backward, does)."""
        while self._in_flight:
            owner, batch = self._in_flight.popleft()
            owner.release(batch)

    def release_before_attention(self) -> None:
        """In forward, the current layer's attention is about to run: the copies of earlier layers
        still in flight that are at least `EARLY_RELEASE_BYTES` are waited for and their sources let
        go now, so that they are off the device through the attention's peak."""
        with self._lock:
            while self._in_flight and self._in_flight[0][1].nbytes >= EARLY_RELEASE_BYTES:
                owner, batch = self._in_flight.popleft()
                owner.release(batch)
                self.step.early_releases += 1

    def forward_group(self) -> LayerGroup | None:
        """The group of the layer call running in forward (the last one entered)."""
        return self._last_group() if self._last_group is not None else None

    def backward_group(self) -> LayerGroup | None:
        """The group whose layer's backward (or checkpoint recompute) is running."""
        return self._backward_group() if self._backward_group is not None else None

    def _backward_reached(self, group: LayerGroup, backward: int) -> None:
        """The backward pass has reached `group`: its layer's backward is starting."""
        self._backward_group = weakref.ref(group)
        if backward != self._backward_id:
            self._backward_id = backward
            self._backward_since_step_start = True
            self.release_in_flight()
            self.ledger.peak_device_bytes = self.ledger.device_bytes
        # Backward runs layers in reverse creation order: groups created after this one are done.
        if self._kept_resident:
            for sequence in [s for s in self._kept_resident if s > group.sequence]:
                self._kept_resident_bytes -= self._kept_resident.pop(sequence)
        still_ahead = []
        for ref in self._holding_ahead:
            held = ref()
            if held is None:
                continue
            if held.sequence > group.sequence:
                for copy in held.copies + held.shared:
                    copy.drop_ahead()
                    if copy.store is not None:
                        copy.drop_staging()
            else:
                still_ahead.append(ref)
        self._holding_ahead = still_ahead
        self._restore_ahead(group)
        step = self.step
        step.peak_backward_held_bytes = max(step.peak_backward_held_bytes, self.ledger.peak_device_bytes)
        self._note_resident()

    def _restore_ahead(self, group: LayerGroup, late: bool = False) -> None:
        """Every decision of what comes back when, in one place: at the start of `group`'s
        backward, copies back to the device for it and the `prefetch_layers` layers before it, and
        with the disk tier, reads into host memory for the `disk_readahead_layers` before it (a
        read started far enough ahead has finished by the time its copy back is due).

        The layers before a checkpointed layer that signals the end of its peak come back at that
        signal instead (`late`, from `prefetch_point`), when what they hold is at least
        `LATE_PREFETCH_BYTES`: a layer's input then takes less time to copy back than the rest of
        that layer's backward after its attention (the projections' backward), and holding it
        through the peak would cost device memory the copy does not need to hide."""
        step = self.step
        store = self.disk
        reach = self.prefetch_layers
        read_reach = -1
        if store is not None and not late:
            store.reap()
            read_reach = self.disk_readahead_layers()
        previous = group.prev() if group.prev is not None else None
        if (
            not late
            and group.late_point
            and reach > 0
            and previous is not None
            and previous.offloaded_bytes + previous.shared_bytes >= LATE_PREFETCH_BYTES
        ):
            group.late_pending = True
            reach = 0  # the rest at `prefetch_point`
        current: LayerGroup | None = group
        for distance in range(max(reach, read_reach) + 1):
            if current is None:
                break
            copies = current.copies + current.shared
            if distance <= read_reach:
                for copy in copies:
                    # The layer needed now waits for its read in `device_storage`, counted there.
                    if (
                        copy.job is None
                        and copy.on_disk()
                        and copy.needs_restore()
                        and not copy.store.read(copy, current.device, needed_now=distance == 0)
                    ):
                        # No host room for more reads ahead now, for this layer or a farther one
                        # (which would take the room this one waits for): again at the next layer.
                        read_reach = distance - 1
                        break
            if distance <= reach and not (late and distance == 0):
                restored = current.device.restore_async(copies)
                if restored:
                    if distance == 0:
                        step.restored_on_demand += restored
                    else:
                        step.restored_ahead += restored
                    self._holding_ahead.append(weakref.ref(current))
            current = current.prev() if current.prev is not None else None

    def recompute_scope(
        self, group: LayerGroup, inputs: Iterable[torch.Tensor], protected: Callable[[], Iterable[torch.Tensor]]
    ) -> recompute.RecomputeScope:
        """`with engine.recompute_scope(group, inputs, protected): layer_forward(*inputs)` around a
        checkpointed layer's recompute in backward: what it saves for its attention's backward waits
        on the host while the MLP's backward runs (`recompute`). `inputs`: every tensor the recompute
        takes; `protected`: the layer's parameters and buffers."""
        return recompute.RecomputeScope(self, group, inputs, protected)

    def active_recompute(self, group: LayerGroup) -> recompute.RecomputeScope | None:
        """The recompute scope running for `group`'s layer, if its recompute is running now."""
        scopes = self.recompute_scopes()
        return scopes[-1] if scopes and scopes[-1].group is group else None

    def recompute_scopes(self) -> list[recompute.RecomputeScope]:
        """This thread's recompute scopes, innermost last."""
        local = self._recompute_threads
        scopes = getattr(local, "scopes", None)
        if scopes is None:
            scopes = local.scopes = []
        return scopes

    def park_recomputed(self, scope: recompute.RecomputeScope, keep: Iterable[torch.Tensor] | None = None) -> None:
        """What `scope`'s recompute saved for the attention's backward goes to the host: when the
        attention block returns in the recompute (`keep`: what else stays), or when the recompute ends
        (`keep` None) where nothing called it before."""
        group = scope.group
        step = self.step
        if keep is None and scope.decided:
            # Parked when the attention returned: anything of those the rest of the recompute saved
            # again (a layer of unusual shape) comes back at once, before backward reads it.
            again = [entry for entry in group.parked if recompute.storage_key(entry.storage) in scope.after]
            if again:
                with self._lock:
                    group.parked = [entry for entry in group.parked if entry not in again]
                    step.recompute_restored_tensors += recompute.unpark(group, again)
            return
        if scope.window or not group.attention_hooked or group.parked or scope.decided:
            # The attention block never returned in the recompute (what was saved after it cannot be
            # told apart); nothing would bring them back; or a second recompute of one graph
            # (retain_graph) while the first one's are still parked.
            return
        scope.decided = keep is not None
        with self._lock:
            storages = scope.candidates(() if keep is None else keep)
            nbytes = sum(storage.nbytes() for storage in storages)
            if not storages or nbytes < recompute.RECOMPUTE_OFFLOAD_BYTES:
                step.recompute_kept_bytes += nbytes
                return
            group.parked = parked = recompute.park(group, storages)
            step.recompute_offloaded_tensors += len(parked)
            step.recompute_offloaded_bytes += sum(entry.nbytes for entry in parked)
            step.recompute_kept_bytes += nbytes - sum(entry.nbytes for entry in parked)

    def restore_read(self, group: LayerGroup, tensors: Iterable[torch.Tensor]) -> None:
        """The recompute reads `tensors` on after parking: those of them parked come back now."""
        storages = []
        for tensor in tensors:
            try:
                storages.append(tensor.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
        read = [entry for entry in group.parked if any(entry.storage is storage for storage in storages)]
        if read:
            with self._lock:
                group.parked = [entry for entry in group.parked if entry not in read]
                self.step.recompute_restored_tensors += recompute.unpark(group, read)

    def restore_recomputed(self, group: LayerGroup) -> None:
        """The gradient of `group`'s attention output has arrived: what its recompute parked comes back."""
        if not group.parked:
            return
        with self._lock:
            parked, group.parked = group.parked, []
            self.step.recompute_restored_tensors += recompute.unpark(group, parked)

    def prefetch_point(self, group: LayerGroup) -> None:
        """`group`'s layer has passed its peak in backward (its attention's backward is done): the
        layers before it that wait for this come back now."""
        if not group.late_pending:
            return
        with self._lock:
            group.late_pending = False
            self._restore_ahead(group, late=True)

    def disk_readahead_layers(self) -> int:
        """How many layers ahead of the one in backward the disk's reads start: one more than the
        copies back, and one more again for each step in which backward had to wait for a read."""
        return self.prefetch_layers + 1 + self._extra_readahead

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
