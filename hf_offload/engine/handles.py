"""What a pack hook returns: handles that own the host copy of a saved tensor.

A handle lives exactly as long as the autograd graph that saved it, so the host copy is
freed when the graph is (after backward, or when a forward's graph is dropped unused), it can
be unpacked any number of times (`retain_graph=True`), and any number of forwards may be
alive at once. There is no global registry to go stale.
"""

from __future__ import annotations

import weakref

import torch

from . import ordering
from .pool import HostBuffer

# Dtypes a tensor dense over its whole storage is copied in as itself (see `HostCopy.whole`).
COPIED_AS_ITSELF = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex128,
        torch.complex64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
    }
)


class HostLedger:
    """Host and device memory held by one offloader, for the statistics."""

    __slots__ = ("host_bytes", "copies_alive", "device_bytes", "peak_device_bytes")

    def __init__(self) -> None:
        self.host_bytes = 0
        self.copies_alive = 0
        self.device_bytes = 0  # sources whose copy out is in flight, copies brought back ahead
        self.peak_device_bytes = 0

    def hold_device(self, nbytes: int) -> None:
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)


class HostCopy:
    """One device storage's trip to host memory and back, shared by every handle that saved a
    view of it. It is itself the handle of the first tensor saved from that storage (the
    common case, one object per saved tensor); later saves of the storage get an
    `OffloadedTensor` pointing at it.

    `source` is the device storage until its copy out has completed and been released;
    `host_block` is the pooled host buffer once the copy out has been queued, its first `nbytes`
    bytes the storage's; `_ahead` is the device storage brought back ahead of need, with the event
    of that copy. `whole`: the saved tensor is dense over its whole storage from offset 0, so the
    copy out copies the tensor itself (through `version_probe`) into a host view of the same
    layout, and no byte view of the source is needed.
    """

    __slots__ = (
        "nbytes",
        "host_size",
        "dtype",
        "storage_offset",
        "shape",
        "stride",
        "whole",
        "source",
        "source_ref",
        "host_block",
        "version",
        "version_probe",
        "modified",
        "_device",
        "_ahead",
        "_ahead_event",
        "_ahead_waited",
        "_restored",
        "__weakref__",
    )

    def __init__(
        self,
        tensor: torch.Tensor,
        tensor_bytes: int,
        storage: torch.UntypedStorage,
        nbytes: int,
        host_size: int,
        device,
        version: int,
    ) -> None:
        # Counted in `ledger.copies_alive` by the layer that made it, when the layer returns.
        self.nbytes = nbytes  # the storage's
        self.host_size = host_size  # the pooled buffer it needs: rounded_size(nbytes)
        self.dtype = dtype = tensor.dtype
        self.storage_offset = offset = tensor.storage_offset()
        self.shape = tensor.shape
        self.stride = tensor.stride()
        # Only for dtypes whose element-wise copy is a byte copy on every backend.
        self.whole = tensor_bytes == nbytes and offset == 0 and dtype in COPIED_AS_ITSELF and tensor.is_contiguous()
        self.source: torch.UntypedStorage | None = storage
        # Weak, for deduplication within a forward pass: identity, not address, since a storage
        # freed in this pass and a new one at the same address are different data.
        self.source_ref = weakref.ref(storage)
        self.host_block: HostBuffer | None = None
        # Autograd cannot check versions through saved-tensor hooks. A detached view shares the
        # tensor's version counter, so an in-place change before the copy out has finished is
        # caught here and reported on unpack, as autograd itself would. Not the tensor itself: a
        # saved output would lead back here through its grad_fn, a cycle Python's collector
        # cannot see through autograd's C++ graph.
        self.version = version
        self.version_probe: torch.Tensor | None = tensor.detach()
        self.modified = False
        self._device = device  # the DeviceContext: streams, pool, ledger
        self._ahead: torch.UntypedStorage | None = None
        self._ahead_event = None
        self._ahead_waited = False
        # Weak, so views unpacked by different backward nodes share one restored storage while
        # any of them is alive, without this object keeping device memory alive.
        self._restored: weakref.ref[torch.UntypedStorage] | None = None

    def matches(self, storage: torch.UntypedStorage, version: int) -> bool:
        """Whether saving `storage` at `version` again can reuse this copy: the same storage
        object, not modified in place since (a modified storage is different data)."""
        return self.source_ref() is storage and self.version == version

    def restore(self) -> torch.Tensor:
        storage = self.device_storage()
        return _view(storage, self._device.device, self.dtype, self.storage_offset, self.shape, self.stride)

    def needs_restore(self) -> bool:
        if self.source is not None or self._ahead is not None:
            return False
        return self._restored is None or self._restored() is None

    def set_ahead(self, storage: torch.UntypedStorage, event) -> None:
        self._ahead, self._ahead_event, self._ahead_waited = storage, event, False
        self._device.ledger.hold_device(self.nbytes)

    def drop_ahead(self) -> None:
        if self._ahead is None:
            return
        if not self._ahead_waited:
            # Never used: the compute stream must still not reuse this memory before the copy
            # into it has finished.
            streams = self._device.streams
            ordering.before_dropping_unused(streams, streams.compute_stream(), self._ahead_event)
        self._ahead = self._ahead_event = None
        self._device.ledger.device_bytes -= self.nbytes

    def device_storage(self) -> torch.UntypedStorage:
        if self.modified:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a tensor of {self.nbytes} bytes saved for backward was changed in place after it "
                f"was saved (version {self.version}); detected by hf_offload"
            )
        if self.source is not None:  # still on the device: the copy out is in flight
            return self.source
        restored = self._restored() if self._restored is not None else None
        if restored is not None:
            return restored
        if self._ahead is None:
            self._device.restore_async([self])
        storage = self._ahead
        if not self._ahead_waited:
            streams = self._device.streams
            ordering.before_using_restored(streams, streams.compute_stream(), self._ahead_event)
            self._ahead_waited = True
        self._restored = weakref.ref(storage)
        return storage

    def __del__(self) -> None:
        self.drop_ahead()
        if self.host_block is not None:
            self._device.pool.release(self.host_block)
            self._device.ledger.host_bytes -= self.host_block.size
        self._device.ledger.copies_alive -= 1


class OffloadedTensor:
    """A later save of a storage already offloaded in this forward pass: its own metadata, the
    first save's host copy."""

    __slots__ = ("copy", "dtype", "storage_offset", "shape", "stride")

    def __init__(self, copy: HostCopy, tensor: torch.Tensor) -> None:
        self.copy = copy
        self.dtype = tensor.dtype
        self.storage_offset = tensor.storage_offset()
        self.shape = tensor.shape
        self.stride = tensor.stride()

    def restore(self) -> torch.Tensor:
        copy = self.copy
        storage = copy.device_storage()
        return _view(storage, copy._device.device, self.dtype, self.storage_offset, self.shape, self.stride)


def _view(storage: torch.UntypedStorage, device, dtype, storage_offset, shape, stride) -> torch.Tensor:
    # Same storage offset, sizes and strides as the saved tensor: kernels in backward see
    # exactly the layout they would have seen without offloading. On the layer's device, which is
    # the storage's own except for the memory simulator's fake tensors (their storages are "meta").
    return torch.empty(0, dtype=dtype, device=device).set_(storage, storage_offset, shape, stride)
