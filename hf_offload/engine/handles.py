"""What a pack hook returns: handles that own the host copy of a saved tensor.

A handle lives exactly as long as the autograd graph that saved it, so the host copy is
freed when the graph is (after backward, or when a forward's graph is dropped unused), it can
be unpacked any number of times (`retain_graph=True`), and any number of forwards may be
alive at once. There is no global registry to go stale.
"""

from __future__ import annotations

import weakref

import torch

from .transfer import HostTransfer


class HostLedger:
    """Live host memory held by one offloader's copies."""

    __slots__ = ("bytes_held", "copies_alive")

    def __init__(self) -> None:
        self.bytes_held = 0
        self.copies_alive = 0


class HostCopy:
    """The host copy of one device storage, shared by every handle that saved a view of it."""

    __slots__ = ("host", "device", "_transfer", "_ledger", "_restored", "__weakref__")

    def __init__(self, storage: torch.UntypedStorage, transfer: HostTransfer, ledger: HostLedger) -> None:
        self.host = transfer.to_host(storage)
        self.device = storage.device
        self._transfer = transfer
        self._ledger = ledger
        # Weak, so that views unpacked by different backward nodes share one restored storage
        # while any of them is alive, without this object keeping device memory alive.
        self._restored: weakref.ref[torch.UntypedStorage] | None = None
        ledger.bytes_held += self.host.numel()
        ledger.copies_alive += 1

    def __del__(self) -> None:
        self._ledger.bytes_held -= self.host.numel()
        self._ledger.copies_alive -= 1

    def restored_storage(self) -> torch.UntypedStorage:
        storage = self._restored() if self._restored is not None else None
        if storage is None:
            storage = self._transfer.to_device(self.host, self.device)
            self._restored = weakref.ref(storage)
        return storage


class OffloadedTensor:
    """A saved tensor's metadata plus the host copy of its storage."""

    __slots__ = ("copy", "dtype", "storage_offset", "shape", "stride")

    def __init__(self, copy: HostCopy, tensor: torch.Tensor) -> None:
        self.copy = copy
        self.dtype = tensor.dtype
        self.storage_offset = tensor.storage_offset()
        self.shape = tensor.shape
        self.stride = tensor.stride()

    def restore(self) -> torch.Tensor:
        storage = self.copy.restored_storage()
        # Same storage offset, sizes and strides as the saved tensor: kernels in backward see
        # exactly the layout they would have seen without offloading.
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.storage_offset, self.shape, self.stride
        )
