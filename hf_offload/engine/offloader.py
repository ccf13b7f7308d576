"""The offloader: a saved-tensor hooks scope around each decoder layer's forward.

Knows nothing about transformers. The caller (hf_offload.api) tells it, for each layer call,
whether the module is training, which device the layer runs on, whether this call starts a
forward pass, whether the layer keeps its activations, and which tensors are parameters.

Forward: each offloaded layer call is a `LayerGroup`. Its pack hook decides per saved tensor
and returns a handle; when the layer returns, one batch of copies to the host is queued on the
copy stream (after the compute stream, by an event) and the sources stay referenced until the
next layer has run, when the compute stream is made to wait for the batch and they are
released. So at most two layers' offloaded activations are on the device at once.

Backward: the first unpack of a group (the start of that layer's backward) brings back its own
copies if they are not back yet and queues the copies of the next `prefetch_layers` groups that
backward will need; groups backward has passed let go of what was brought back for them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import torch

from . import ordering
from .handles import HostCopy, HostLedger, OffloadedTensor
from .pool import HostPool, rounded_size
from .stats import LifetimeCounters, OffloadStats, StepCounters
from .streams import flat_bytes, streams_for

logger = logging.getLogger("hf_offload")

_NO_ACCELERATOR = (
    "hf_offload: the model is on the CPU, where activations already live in host memory; offloading "
    "does nothing until the model is moved to an accelerator (simulate_on_cpu=True runs the engine anyway)"
)


def current_backward_id() -> int:
    """An id of the backward pass running on this thread, -1 outside backward.

    There is no public API for this; torch's own FSDP2 and ModuleTracker use the same private
    call. It tells a layer re-run during backward (a reentrant checkpoint's recompute), which
    must not offload, and tells one backward from the next (retain_graph) for prefetching.
    """
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    return current_backward_id() != -1


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    ptrs = set()
    for tensor in tensors:
        try:
            ptrs.add(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            continue  # a tensor subclass without a plain storage (e.g. a sharded DTensor): never packed as one
    return ptrs


class _DedupEntry:
    """One storage offloaded in the current forward pass. Weak on both sides: the entry must
    neither keep the device storage nor its host copy alive."""

    __slots__ = ("source", "version", "copy")

    def __init__(self, source: torch.UntypedStorage, version: int, copy: HostCopy) -> None:
        self.source = weakref.ref(source)
        self.version = version
        self.copy = weakref.ref(copy)

    def matches(self, storage: torch.UntypedStorage, version: int) -> bool:
        # Identity, not address: a storage freed in this pass and a new one at the same address
        # are different data. Version: a storage modified in place since is different data too.
        return self.source() is storage and self.version == version


class _InFlight:
    """A batch of copies to the host whose sources must stay alive until it has finished."""

    __slots__ = ("sources", "copies", "event", "nbytes")

    def __init__(self, copies: list[HostCopy], event) -> None:
        self.sources = [copy.source for copy in copies]
        self.copies = [weakref.ref(copy) for copy in copies]
        self.event = event
        self.nbytes = sum(copy.nbytes for copy in copies)


class DeviceContext:
    """Streams, pinned pool and ledger for one device (a model split over several GPUs gets one
    copy stream and one pool per GPU)."""

    def __init__(self, device: torch.device, ledger: HostLedger) -> None:
        self.streams = streams_for(device)
        self.pool = HostPool(self.streams)
        self.ledger = ledger

    def offload_async(self, copies: list[HostCopy], engine: ActivationOffloader) -> _InFlight | None:
        streams = self.streams
        hosts, placed = [], []
        for copy in copies:
            try:
                hosts.append(self.pool.acquire(copy.nbytes, engine.max_host_bytes))
            except (RuntimeError, MemoryError) as error:
                # The tensor simply stays on the device: its handle keeps the source.
                engine.host_allocation_failed(copy, error)
                continue
            placed.append(copy)
        if not placed:
            return None
        copies = placed
        ordering.before_offload_copies(streams, streams.compute_stream())
        for copy in copies:
            copy.check_unmodified()
        pairs = [(host[: copy.nbytes], flat_bytes(copy.source)) for host, copy in zip(hosts, copies, strict=True)]
        streams.copy_async(pairs)
        batch = _InFlight(copies, streams.record(streams.copy_stream))
        for host, copy in zip(hosts, copies, strict=True):
            copy.host_block = host
            copy.host = host[: copy.nbytes]
            self.ledger.host_bytes += host.numel()
        self.ledger.hold_device(batch.nbytes)
        return batch

    def release(self, batch: _InFlight) -> None:
        streams = self.streams
        ordering.before_releasing_sources(streams, streams.compute_stream(), batch.event)
        for ref in batch.copies:
            copy = ref()
            if copy is not None:
                copy.check_unmodified()
                copy.source = copy.version_probe = None
        batch.sources.clear()
        self.ledger.device_bytes -= batch.nbytes

    def restore_async(self, copies: Iterable[HostCopy]) -> int:
        """Queue the copies back to the device of those not on it; returns how many."""
        todo = [copy for copy in copies if copy.needs_restore()]
        if not todo:
            return 0
        streams = self.streams
        targets = [streams.device_buffer(copy.nbytes) for copy in todo]
        ordering.before_restore_copies(streams, streams.compute_stream())
        streams.copy_async([(target, copy.host) for target, copy in zip(targets, todo, strict=True)])
        event = streams.record(streams.copy_stream)
        for target, copy in zip(targets, todo, strict=True):
            copy.set_ahead(target.untyped_storage(), event)
        return len(todo)


class LayerGroup:
    """One offloaded layer call: its pack and unpack hooks and the host copies it made."""

    __slots__ = (
        "engine",
        "device",
        "device_id",
        "sequence",
        "keep",
        "protected",
        "copies",
        "shared",
        "prev",
        "reached_in",
        "calls",
        "pending_bytes",
        "__weakref__",
    )

    def __init__(self, engine, device, device_id, sequence, keep, protected, prev) -> None:
        self.engine = engine
        self.device = device
        self.device_id = device_id  # the torch.device this layer runs on
        self.sequence = sequence
        self.keep = keep
        self.protected = protected
        self.copies: list[HostCopy] = []
        self.shared: list[HostCopy] = []  # offloaded by an earlier group, saved here again
        self.prev = prev  # weakref to the group created before this one: backward needs it next
        self.reached_in = -1
        self.calls = 0
        self.pending_bytes = 0  # copies decided in this layer call, not yet given host memory

    def pack(self, tensor: torch.Tensor) -> object:
        engine = self.engine
        step = engine.step
        self.calls += 1
        engine.lifetime.pack_calls += 1
        nbytes = tensor.nbytes
        # Kept tensors are returned detached: returning a saved *output* itself would make a
        # reference cycle through its grad_fn that keeps the whole graph alive.
        # A Parameter is kept as itself, as autograd keeps a saved leaf without hooks (a leaf has
        # no grad_fn, so no reference cycle): DeepSpeed ZeRO-3 frees a gathered weight by
        # replacing param.data, and a detached alias would keep it alive until backward.
        if self.keep:
            step.keep("kept_layer", nbytes)
            return tensor if isinstance(tensor, torch.nn.Parameter) else tensor.detach()
        if isinstance(tensor, torch.nn.Parameter):
            step.keep("parameter", nbytes)
            return tensor
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout is not torch.strided
            or tensor.device != self.device_id
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            step.keep("unsupported", nbytes)
            return tensor.detach()
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.protected or ptr in engine._pass_protected:
            step.keep("parameter", nbytes)
            return tensor.detach()
        if nbytes < engine.min_offload_bytes or nbytes == 0:
            step.keep("too_small", nbytes)
            return tensor.detach()
        version = tensor._version
        entry = engine._offloaded_this_pass.get(ptr)
        if entry is not None and entry.matches(storage, version):
            copy = entry.copy()
            if copy is not None:
                step.keep("duplicate", nbytes)
                if copy not in self.copies and copy not in self.shared:
                    self.shared.append(copy)
                return OffloadedTensor(copy, self, tensor)
        needed = rounded_size(storage.nbytes())
        if engine.ledger.host_bytes + self.pending_bytes + needed > engine.max_host_bytes:
            engine.over_budget(needed, self.pending_bytes)
            step.keep("over_budget", nbytes)
            return tensor.detach()
        copy = HostCopy(tensor, storage, self.device)
        self.copies.append(copy)
        self.pending_bytes += needed
        engine._offloaded_this_pass[ptr] = _DedupEntry(storage, version, copy)
        step.offloaded_tensors += 1
        step.offloaded_bytes += copy.nbytes
        return OffloadedTensor(copy, self, tensor)

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


class ActivationOffloader:
    def __init__(self, **options) -> None:
        self.configure(**options)
        self.ledger = HostLedger()
        self.step = StepCounters()
        self.lifetime = LifetimeCounters()
        self.mode = "idle"
        self._devices: dict[torch.device, DeviceContext] = {}
        # Several threads may run layers at once (nn.DataParallel replicas, autograd's device
        # threads): the state shared between layer calls changes under this lock.
        self._lock = threading.RLock()
        self._offloaded_this_pass: dict[int, _DedupEntry] = {}
        self._pass_protected: set[int] = set()
        self._in_flight: deque[tuple[DeviceContext, _InFlight]] = deque()
        self._holding_ahead: list[weakref.ref[LayerGroup]] = []
        self._last_group: weakref.ref[LayerGroup] | None = None
        self._sequence = 0
        self._backward_id = -1
        self._backward_since_step_start = False
        self._warned: set[str] = set()

    def configure(
        self,
        *,
        min_offload_bytes: int,
        simulate_on_cpu: bool,
        prefetch_layers: int = 1,
        max_host_bytes: int = sys.maxsize,
    ) -> None:
        self.min_offload_bytes = min_offload_bytes
        self.simulate_on_cpu = simulate_on_cpu
        self.prefetch_layers = prefetch_layers
        self.max_host_bytes = max_host_bytes

    def options(self) -> dict[str, object]:
        return {
            "min_offload_bytes": self.min_offload_bytes,
            "simulate_on_cpu": self.simulate_on_cpu,
            "prefetch_layers": self.prefetch_layers,
            "max_host_bytes": self.max_host_bytes,
        }

    def __deepcopy__(self, memo: dict) -> ActivationOffloader:
        # A deep-copied model (a DPO reference model, say) gets an offloader of its own with the
        # same options, never a share of this one's handles and counters.
        return ActivationOffloader(**self.options())

    def device_context(self, device: str | torch.device) -> DeviceContext | None:
        return self._devices.get(torch.device(device))

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
            host_bytes_held=self.ledger.host_bytes,
            live_host_copies=self.ledger.copies_alive,
            pool_bytes=sum(pool.owned_bytes for pool in pools),
            pool_free_bytes=sum(pool.free_bytes for pool in pools),
            pool_allocations=sum(pool.allocations for pool in pools),
            max_host_bytes=self.max_host_bytes,
            total_layer_scopes=life.layer_scopes,
            total_pack_calls=life.pack_calls,
            total_unpack_calls=life.unpack_calls,
        )

    def over_budget(self, nbytes: int, pending: int) -> None:
        self._warn_once(
            "budget",
            f"hf_offload: host memory budget reached: {self.ledger.host_bytes + pending} bytes offloaded and "
            f"{nbytes} more would exceed max_host_bytes={self.max_host_bytes}; tensors over the budget stay on "
            "the device (counted as kept 'over_budget'). Raise max_host_bytes or free host memory to offload more.",
        )

    def host_allocation_failed(self, copy: HostCopy, error: BaseException) -> None:
        self.step.offloaded_tensors -= 1
        self.step.offloaded_bytes -= copy.nbytes
        self.step.keep("no_host_memory", copy.nbytes)
        self._warn_once(
            "allocation",
            f"hf_offload: could not allocate {copy.nbytes} bytes of host memory ({error}); tensors that cannot "
            "get host memory stay on the device (counted as kept 'no_host_memory')",
        )

    def note_no_accelerator(self) -> None:
        self._warn_once("cpu", _NO_ACCELERATOR)

    @contextlib.contextmanager
    def layer_scope(
        self,
        *,
        training: bool,
        device: torch.device | None,
        starts_pass: bool,
        keep: bool,
        protected: Callable[[], Iterable[torch.Tensor]],
        pass_protected: Callable[[], Iterable[torch.Tensor]],
        name: str,
    ) -> Iterator[None]:
        """Run one decoder layer's forward with its saved tensors routed through the offloader.

        `protected` yields the layer's parameters and buffers, `pass_protected` every parameter
        of the model; both are read now, so they are right after PEFT, dtype changes or sharding.
        """
        # Decided here, not in the pack hook: autograd calls pack hooks with grad mode off.
        if not (training and torch.is_grad_enabled()) or device is None or in_backward():
            yield
            return
        if device.type == "cpu" and not self.simulate_on_cpu:
            self.note_no_accelerator()
            yield
            return
        with self._lock:
            if starts_pass:
                self._start_pass(pass_protected)
            self.mode = "cpu-simulation" if device.type == "cpu" else device.type
            self.lifetime.layer_scopes += 1
            context = self._devices.get(device)
            if context is None:
                context = self._devices[device] = DeviceContext(device, self.ledger)
            self._sequence += 1
            group = LayerGroup(self, context, device, self._sequence, keep, storage_ptrs(protected()), self._last_group)
            self._last_group = weakref.ref(group)
        try:
            with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
                yield
        finally:
            with self._lock:
                self._finish_layer(group, context, name)

    def _finish_layer(self, group: LayerGroup, context: DeviceContext, name: str) -> None:
        # Queued even when the layer raised: handles made before the error must stay valid.
        batch = context.offload_async(group.copies, self) if group.copies else None
        if batch is not None:
            self._in_flight.append((context, batch))
        # Earlier batches have had this whole layer's compute to finish; release their sources.
        while len(self._in_flight) > (1 if batch is not None else 0):
            owner, batch = self._in_flight.popleft()
            owner.release(batch)
        step = self.step
        step.peak_forward_held_bytes = max(step.peak_forward_held_bytes, self.ledger.peak_device_bytes)
        if group.keep:
            return
        step.layers_offloaded += 1
        step.max_layer_offloaded_bytes = max(step.max_layer_offloaded_bytes, sum(copy.nbytes for copy in group.copies))
        if group.calls == 0:
            self._warn_once(
                "shadowed",
                f"hf_offload: decoder layer {name} saved no tensors through hf_offload's hooks, so nothing "
                "was offloaded from it. Another saved_tensors_hooks context inside the layer takes them, "
                "typically transformers' activation_checkpointing_enable(offload=True): call "
                "activation_checkpointing_enable() without offload=True to let hf_offload move the "
                "checkpoint inputs instead.",
            )

    def _start_pass(self, pass_protected: Callable[[], Iterable[torch.Tensor]]) -> None:
        self._release_in_flight()
        # A new step begins after a backward, or when no graph of an earlier forward is alive
        # any more (it was dropped, or its backward failed before reaching a decoder layer).
        if self._backward_since_step_start or self.ledger.copies_alive == 0:
            self.step = StepCounters()
            self._backward_since_step_start = False
        self.ledger.peak_device_bytes = self.ledger.device_bytes
        self._offloaded_this_pass.clear()
        self._pass_protected = storage_ptrs(pass_protected())

    def _release_in_flight(self) -> None:
        while self._in_flight:
            owner, batch = self._in_flight.popleft()
            owner.release(batch)

    def _backward_reached(self, group: LayerGroup, backward: int) -> None:
        """The backward pass has reached `group`: its layer's backward is starting."""
        if backward != self._backward_id:
            self._backward_id = backward
            self._backward_since_step_start = True
            self._release_in_flight()
            self.ledger.peak_device_bytes = self.ledger.device_bytes
        # Backward runs layers in reverse creation order: groups created after this one are done.
        still_ahead = []
        for ref in self._holding_ahead:
            held = ref()
            if held is None:
                continue
            if held.sequence > group.sequence:
                for copy in held.copies + held.shared:
                    copy.drop_ahead()
            else:
                still_ahead.append(ref)
        self._holding_ahead = still_ahead
        step = self.step
        current: LayerGroup | None = group
        for distance in range(self.prefetch_layers + 1):
            if current is None:
                break
            restored = current.device.restore_async(current.copies + current.shared)
            if restored:
                if distance == 0:
                    step.restored_on_demand += restored
                else:
                    step.restored_ahead += restored
                self._holding_ahead.append(weakref.ref(current))
            current = current.prev() if current.prev is not None else None
        step.peak_backward_held_bytes = max(step.peak_backward_held_bytes, self.ledger.peak_device_bytes)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
