"""The offloader: a saved-tensor hooks scope around each decoder layer's forward.

Knows nothing about transformers. The caller (hf_offload.api) tells it, for each layer call,
whether the module is training, which device the layer runs on, whether this call starts a
forward pass, whether the layer keeps its activations, and which tensors are parameters.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch

from .handles import HostCopy, HostLedger, OffloadedTensor
from .stats import LifetimeCounters, OffloadStats, StepCounters
from .transfer import HostTransfer

logger = logging.getLogger("hf_offload")

_NO_ACCELERATOR = (
    "hf_offload: the model is on the CPU, where activations already live in host memory; offloading "
    "does nothing until the model is moved to an accelerator (simulate_on_cpu=True runs the engine anyway)"
)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread.

    There is no public API for this; torch's own FSDP2 and ModuleTracker use the same private
    call. A layer re-run during backward (a reentrant checkpoint's recompute) must not offload:
    its tensors would be copied out and straight back.
    """
    return torch._C._current_graph_task_id() != -1


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


class ActivationOffloader:
    def __init__(self, *, min_offload_bytes: int, simulate_on_cpu: bool) -> None:
        self.min_offload_bytes = min_offload_bytes
        self.simulate_on_cpu = simulate_on_cpu
        self.ledger = HostLedger()
        self.step = StepCounters()
        self.lifetime = LifetimeCounters()
        self.mode = "idle"
        self._transfers: dict[str, HostTransfer] = {}
        self._offloaded_this_pass: dict[int, _DedupEntry] = {}
        self._pass_protected: set[int] = set()
        self._backward_since_step_start = False
        self._warned: set[str] = set()

    def configure(self, *, min_offload_bytes: int, simulate_on_cpu: bool) -> None:
        self.min_offload_bytes = min_offload_bytes
        self.simulate_on_cpu = simulate_on_cpu

    def __deepcopy__(self, memo: dict) -> ActivationOffloader:
        # A deep-copied model (a DPO reference model, say) gets an offloader of its own with the
        # same options, never a share of this one's handles and counters.
        return ActivationOffloader(min_offload_bytes=self.min_offload_bytes, simulate_on_cpu=self.simulate_on_cpu)

    def stats(self) -> OffloadStats:
        step, life = self.step, self.lifetime
        return OffloadStats(
            mode=self.mode,
            offloaded_tensors=step.offloaded_tensors,
            offloaded_bytes=step.offloaded_bytes,
            kept_tensors=dict(step.kept_tensors),
            kept_bytes=dict(step.kept_bytes),
            restored_tensors=step.restored_tensors,
            layers_offloaded=step.layers_offloaded,
            host_bytes_held=self.ledger.bytes_held,
            live_host_copies=self.ledger.copies_alive,
            total_layer_scopes=life.layer_scopes,
            total_pack_calls=life.pack_calls,
            total_unpack_calls=life.unpack_calls,
        )

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
            self._warn_once("cpu", _NO_ACCELERATOR)
            yield
            return
        if starts_pass:
            self._start_pass(pass_protected)
        self.mode = "cpu-simulation" if device.type == "cpu" else device.type
        self.lifetime.layer_scopes += 1
        transfer = self._transfer_for(device)
        packer = _LayerPacker(self, transfer, device, keep, storage_ptrs(protected()))
        with torch.autograd.graph.saved_tensors_hooks(packer.pack, self._unpack):
            yield
        if keep:
            return
        self.step.layers_offloaded += 1
        if packer.calls == 0:
            self._warn_once(
                "shadowed",
                f"hf_offload: decoder layer {name} saved no tensors through hf_offload's hooks, so nothing "
                "was offloaded from it. Another saved_tensors_hooks context inside the layer takes them, "
                "typically transformers' activation_checkpointing_enable(offload=True): call "
                "activation_checkpointing_enable() without offload=True to let hf_offload move the "
                "checkpoint inputs instead.",
            )

    def note_no_accelerator(self) -> None:
        self._warn_once("cpu", _NO_ACCELERATOR)

    def _start_pass(self, pass_protected: Callable[[], Iterable[torch.Tensor]]) -> None:
        if self._backward_since_step_start:
            self.step = StepCounters()
            self._backward_since_step_start = False
        self._offloaded_this_pass.clear()
        self._pass_protected = storage_ptrs(pass_protected())

    def _transfer_for(self, device: torch.device) -> HostTransfer:
        transfer = self._transfers.get(device.type)
        if transfer is None:
            transfer = HostTransfer(pin=device.type != "cpu")
            self._transfers[device.type] = transfer
        return transfer

    def _unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self.lifetime.unpack_calls += 1
        self.step.restored_tensors += 1
        self._backward_since_step_start = True
        return packed.restore()  # type: ignore[attr-defined]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


class _LayerPacker:
    """The pack hook of one layer call."""

    __slots__ = ("offloader", "transfer", "device", "keep", "protected", "calls")

    def __init__(
        self,
        offloader: ActivationOffloader,
        transfer: HostTransfer,
        device: torch.device,
        keep: bool,
        protected: set[int],
    ) -> None:
        self.offloader = offloader
        self.transfer = transfer
        self.device = device
        self.keep = keep
        self.protected = protected
        self.calls = 0

    def pack(self, tensor: torch.Tensor) -> object:
        offloader = self.offloader
        step = offloader.step
        self.calls += 1
        offloader.lifetime.pack_calls += 1
        nbytes = tensor.nbytes
        # Kept tensors are returned detached: returning a saved *output* itself would make a
        # reference cycle through its grad_fn that keeps the whole graph alive.
        if self.keep:
            step.keep("kept_layer", nbytes)
            return tensor.detach()
        if isinstance(tensor, torch.nn.Parameter):
            step.keep("parameter", nbytes)
            return tensor.detach()
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout is not torch.strided
            or tensor.device != self.device
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            step.keep("unsupported", nbytes)
            return tensor.detach()
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.protected or ptr in offloader._pass_protected:
            step.keep("parameter", nbytes)
            return tensor.detach()
        if nbytes < offloader.min_offload_bytes or nbytes == 0:
            step.keep("too_small", nbytes)
            return tensor.detach()
        version = tensor._version
        entry = offloader._offloaded_this_pass.get(ptr)
        if entry is not None and entry.matches(storage, version):
            copy = entry.copy()
            if copy is not None:
                step.keep("duplicate", nbytes)
                return OffloadedTensor(copy, tensor)
        copy = HostCopy(storage, self.transfer, offloader.ledger)
        offloader._offloaded_this_pass[ptr] = _DedupEntry(storage, version, copy)
        step.offloaded_tensors += 1
        step.offloaded_bytes += storage.nbytes()
        return OffloadedTensor(copy, tensor)
