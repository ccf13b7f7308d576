"""Byte copies between a device storage and host memory.

Copies run on the current (compute) stream, so stream order alone makes them safe: the
source is read before anything later on the stream can reuse its memory, and the copy back
lands before any later kernel reads it. Pinned host memory makes both copies asynchronous
with respect to the host.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("hf_offload")


def flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage, for copying it as raw bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostTransfer:
    """Copies whole storages to host memory and back.

    `pin` asks for page-locked host buffers (only meaningful with an accelerator); if pinning
    fails once, later buffers are pageable and the fallback is logged once.
    """

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin

    def to_host(self, storage: torch.UntypedStorage) -> torch.Tensor:
        host = self._allocate(storage.nbytes())
        host.copy_(flat_bytes(storage), non_blocking=self.pin)
        return host

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.UntypedStorage:
        restored = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        restored.copy_(host, non_blocking=self.pin)
        return restored.untyped_storage()

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as error:
                self.pin = False
                logger.warning(
                    "hf_offload: pinned host memory unavailable (%s); falling back to pageable memory, "
                    "so copies to the host are synchronous",
                    error,
                )
        return torch.empty(nbytes, dtype=torch.uint8)
