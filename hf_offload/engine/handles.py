"""What a pack hook returns: handles that own the host copy of a saved tensor.

A handle lives exactly as long as the autograd graph that saved it, so the host copy is
freed when the graph is (after backward, or when a forward's graph is dropped unused), it can
be unpacked any number of times (`retain_graph=True`), and any number of forwards may be
alive at once. There is no global registry to go stale.

One case where the graph outlives its last reference: a backward that raised (a DiskTierError,
a KeyboardInterrupt while it waited for the disk) leaves the nodes it had not run in torch's
queue of ready work, which the next backward clears (torch 2.13, with any saved-tensor hook that
raises). Until then their host buffers and disk extents stay held.
"""

from __future__ import annotations

import weakref

import torch

from . import ordering
from .disk import DiskTierError
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
    """Copies alive and device memory held by one offloader, for the statistics (the host memory
    held is the pools', in their `HostBudget`)."""

    __slots__ = ("copies_alive", "device_bytes", "peak_device_bytes")

    def __init__(self) -> None:
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

    A copy that goes to the disk tier has its `store`: `host_block` is then a staging buffer,
    held while the write from it runs (`job`) and again from a read back until backward has passed
    its layer; `disk_offset` is where its bytes are in the store's file once written. A write that
    failed leaves it in host memory (`disk_offset` None), as a host copy.
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
        "store",
        "disk_offset",
        "job",
        "read_error",
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
        store=None,
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
        self.store = store  # the disk tier's DiskStore, for a copy that goes to disk
        self.disk_offset: int | None = None
        self.job = None  # the write or read in flight
        self.read_error: BaseException | None = None

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
            if self.host_block is None:
                self._read_back()
            self._device.restore_async([self])
        storage = self._ahead
        if not self._ahead_waited:
            streams = self._device.streams
            ordering.before_using_restored(streams, streams.compute_stream(), self._ahead_event)
            self._ahead_waited = True
        self._restored = weakref.ref(storage)
        return storage

    def on_disk(self) -> bool:
        """Its bytes are in the disk tier's file and nowhere on the host."""
        return self.host_block is None and self.disk_offset is not None

    def _read_back(self) -> None:
        """Needed now and on disk: read it (or wait for the read ahead already under way)."""
        store, context = self.store, self._device
        if self.job is None and self.read_error is None:
            store.read(self, context, needed_now=True)
        if self.job is not None:
            store.wait(self.job)
        if self.read_error is not None or self.host_block is None:
            raise DiskTierError(
                f"hf_offload: the {self.nbytes} bytes of an activation offloaded to disk_dir={store.directory!r} "
                f"could not be read back ({self.read_error}); they exist nowhere else, so this backward cannot "
                "be computed. The file is private to this process (unlinked at creation): look for a failing "
                "disk or a full file system. The next step runs as usual."
            )

    def drop_staging(self) -> None:
        """Backward has passed this copy's layer: give back the buffer it was read into."""
        if self.disk_offset is not None and self.host_block is not None and self.job is None:
            block = self.host_block
            self.host_block = None
            self._device.pool.release(block)

    def __del__(self) -> None:
        try:
            inherited = self._device.inherited
        except (AttributeError, TypeError):
            # At interpreter exit, with the modules' globals already cleared (a graph torch still
            # holds then): the process ends, and nothing it holds needs giving back.
            return
        if inherited:
            # A forked child dropping the graph it inherited: the buffer, the extent and the device
            # memory are the parent's (`forks`); there is nothing here to give back or wait for.
            return
        self.drop_ahead()
        job = self.job
        if job is None or not self.store.orphan(job):
            # Nothing in flight: what it holds is its own to give back (a job in flight gives
            # back its buffer and extent itself when it is settled).
            if self.host_block is not None:
                self._device.pool.release(self.host_block)
            if self.disk_offset is not None:
                self.store.release(self.disk_offset, self.host_size)
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
