"""The options of `enable_activation_offloading`, validated with errors that name the fix."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .engine.disk import check_directory, free_bytes
from .engine.pool import ALIGNMENT

# Chosen by `python -m hf_offload.benchmarks.min_offload_bytes`: offloading and restoring one
# saved tensor costs ~20 us of fixed engine work (measured 2026-12-01 on a 2-core x86 CPU,
# torch 2.13, batches of 16 tensors per layer; ~30 us before the per-tensor work was cut), the
# time a 25 GB/s host link needs for ~495 KiB. Rounded to a power of two; the tensors below it
# (per-head statistics, masks, short rotary tables) are a negligible share of a layer's
# activations at the sequence lengths where offloading matters.
DEFAULT_MIN_OFFLOAD_BYTES = 512 * 1024

# Share of the host memory available at enable time that offloading may use, split between
# the processes of this host (torchrun and accelerate set LOCAL_WORLD_SIZE): the rest is left
# for the data loader, the optimizer's host state and the other ranks.
HOST_MEMORY_SHARE = 0.8


# Share of the free space in disk_dir the disk tier may use by default, split between the
# processes of this host like the host memory share.
DISK_SPACE_SHARE = 0.8


def available_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        import psutil

        return psutil.virtual_memory().available


def local_process_count() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def default_max_host_bytes() -> int:
    return int(available_host_bytes() * HOST_MEMORY_SHARE) // local_process_count()


@dataclass(frozen=True)
class OffloadOptions:
    """Options for activation offloading. All are keyword-only in the public API.

    keep_last_layers: how many of the last decoder layers (in forward order) keep their
        activations on the device. Backward needs the last layer first, so offloading it
        would copy its tensors out and straight back. 0 offloads every layer.
    min_offload_bytes: saved tensors smaller than this many bytes stay on the device.
    prefetch_layers: in backward, how many layers ahead of the one being differentiated have
        their activations copied back in advance. 0 copies each layer's back only when its
        backward starts (nothing overlaps); 1 hides the copies behind one layer's backward.
    max_host_bytes: the most host memory offloaded activations may take. None (the default)
        means 80% of the host memory available when offloading is enabled, divided by the
        number of processes on this host (LOCAL_WORLD_SIZE). A tensor that would go over it
        stays on the device, and one warning with the numbers is logged.
    max_device_bytes: the most decoder-layer activation memory a step may keep on the device
        (what kept layers saved, copies in flight, copies brought back ahead, by the engine's
        accounting). None (the default) offloads every offloadable layer. An int (bytes): at the
        first layer of each forward pass the engine plans, from the bytes per token each layer
        saved in the last step and this step's tokens, the fewest leading layers to offload so
        that the step stays under it; the first step offloads every layer while it measures. A
        step that cannot fit offloads every layer, with one warning. "auto": the budget is read
        at each step from the device's free memory, less a margin and what the loss head and
        the gradients not yet allocated are predicted to need (see docs/budget.md).
    simulate_on_cpu: treat CPU tensors as device tensors, copying them into separate host
        storage, so that the whole engine runs on a machine without an accelerator (tests, CI).
        It saves no memory.
    disk_dir: a directory on a local disk for the disk tier (see docs/tiers.md). None (the
        default): no disk tier. Given: what does not fit max_host_bytes goes to one file there
        instead of staying on the device, the earliest layers first (backward needs them last),
        read back ahead of need. The file has no name (unlinked when opened), so nothing is left
        behind after a crash. The directory is checked when offloading is enabled: it must exist
        and take a file that is written and read back (a file system in memory, such as /dev/shm,
        works and is warned about: it spares no RAM). Enabling again with the same disk_dir keeps
        the file and what is in it.
    max_disk_bytes: the most bytes the disk tier's file may hold. None (the default) means 80% of
        the space free in disk_dir when offloading is enabled, divided by the number of processes
        on this host (LOCAL_WORLD_SIZE). More than is free there is an error.
    """

    keep_last_layers: int = 1
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES
    prefetch_layers: int = 1
    max_host_bytes: int | None = None
    max_device_bytes: int | str | None = None
    simulate_on_cpu: bool = False
    disk_dir: str | os.PathLike | None = None
    max_disk_bytes: int | None = None

    def __post_init__(self) -> None:
        _require_int("keep_last_layers", self.keep_last_layers, minimum=0)
        _require_int("min_offload_bytes", self.min_offload_bytes, minimum=0)
        _require_int("prefetch_layers", self.prefetch_layers, minimum=0)
        if self.max_host_bytes is not None:
            _require_int("max_host_bytes", self.max_host_bytes, minimum=0, or_none=True)
        budget = self.max_device_bytes
        if budget is not None and not (isinstance(budget, str) and budget == "auto"):
            if isinstance(budget, str):
                raise ValueError(f"option max_device_bytes must be an int >= 0, 'auto' or None, got {budget!r}")
            _require_int("max_device_bytes", budget, minimum=0, or_none=True, or_auto=True)
        _require_bool("simulate_on_cpu", self.simulate_on_cpu)
        if self.max_disk_bytes is not None:
            _require_int("max_disk_bytes", self.max_disk_bytes, minimum=ALIGNMENT, or_none=True)
            if self.disk_dir is None:
                raise ValueError(
                    f"option max_disk_bytes={self.max_disk_bytes} needs disk_dir, the directory for the disk tier"
                )
        if self.disk_dir is not None:
            # Here, before enabling changes anything: a directory that cannot take the file is an
            # error now rather than a warning in the middle of a step.
            check_directory(self.disk_dir, self.max_disk_bytes)

    def engine_options(self) -> dict[str, object]:
        """The options the engine itself reads (keep_last_layers is applied by the API)."""
        return {
            "min_offload_bytes": self.min_offload_bytes,
            "simulate_on_cpu": self.simulate_on_cpu,
            "prefetch_layers": self.prefetch_layers,
            "max_host_bytes": default_max_host_bytes() if self.max_host_bytes is None else self.max_host_bytes,
            "max_device_bytes": self.max_device_bytes,
            **self._disk_options(),
        }

    def _disk_options(self) -> dict[str, object]:
        if self.disk_dir is None:
            return {}
        directory = os.path.abspath(os.fspath(self.disk_dir))
        max_bytes = self.max_disk_bytes
        if max_bytes is None:
            max_bytes = int(free_bytes(directory) * DISK_SPACE_SHARE) // local_process_count()
        return {"disk_dir": directory, "max_disk_bytes": max_bytes}

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> OffloadOptions:
        unknown = sorted(set(kwargs) - set(cls.option_names()))
        if unknown:
            raise TypeError(
                f"unknown activation offloading option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(cls.option_names())}"
            )
        return cls(**kwargs)  # type: ignore[arg-type]


def reject_positional(function: str, positional: tuple, option_names: tuple[str, ...]) -> None:
    """Options are keyword-only: `enable_sequence_tiling(16)` says which keyword was meant."""
    if positional:
        values = ", ".join(map(repr, positional))
        raise TypeError(
            f"{function}() takes its options as keywords only, got positional {values}; valid options are: "
            f"{', '.join(option_names)} (e.g. {function}({option_names[-1]}=...))"
        )


def _require_int(name: str, value: object, *, minimum: int, or_none: bool = False, or_auto: bool = False) -> None:
    valid = f"an int >= {minimum}" + (", 'auto'" if or_auto else "") + (" or None" if or_none else "")
    # bool is an int subclass; `keep_last_layers=True` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"option {name} must be {valid}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"option {name} must be {valid}, got {value!r}")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"option {name} must be True or False, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class TilingOptions:
    """Options for sequence tiling. All are keyword-only in the public API.

    mlp: run each decoder layer's MLP one slice of the sequence at a time, saving only its input.
    norms: the same for the layer's own norms and its attention's (RMSNorm, LayerNorm; Qwen3's
        q_norm and k_norm: docs/api.md), whose float32 upcasts and
        backward temporaries then exist for one slice; and the final norm (between the last layer
        and lm_head), which with `loss` runs slice by slice with lm_head where lm_head takes what
        it returned, and otherwise (TRL's fused head, Liger's fused cross-entropy, a loss of the
        user's over the hidden states) slice by slice on its own.
    projections: the same for the attention's linear projections (q, k, v, o), found at each call
        so that LoRA layers added later are tiled whole: PEFT's float32 adapters then copy their
        input to float32 for one slice at a time.
    attention: attention itself mixes tokens, so it is tiled over heads instead: a group of
        key/value heads and their query heads at a time (at most 8 groups), each head computed as
        by the whole call, so that the kernel's own memory (FlashAttention's float32 gradient
        accumulators, keys and values expanded to every query head) exists for one group. For
        SDPA and FlashAttention 2/3/4; eager and flex attention run whole, said once.
    loss: compute lm_head and the cross-entropy one slice at a time, never holding the logits of
        the whole sequence (unless Liger's fused linear cross-entropy already computes the loss).
    tile_tokens: tokens per slice. None (the default) lets each part choose: the layers' parts
        take hidden_size tokens per slice (as ALST and Liger's tiled MLP slice it: a slice's MLP
        intermediates are then about as large as a weight matrix), the loss head as many as keep
        a slice's logits within 2**28 elements (about 2,000 tokens of a 128k vocabulary).
        Sequences no longer than one slice are not tiled.
    tile_heads: query heads per piece of attention tiled over heads: a multiple of the query heads
        per key/value head (whole key/value heads with their query heads) or a divisor of it
        (pieces of one key/value head's query heads, which share it). None (the default): a group
        of key/value heads at a time (at most 8 groups); under DeepSpeed's Ulysses, where each
        rank's attention runs over the whole sequence, its query heads a chunk at a time through
        the exchange, as few per chunk as make at most 8 chunks (docs/sequence_parallel.md).
    """

    mlp: bool = True
    norms: bool = True
    projections: bool = True
    attention: bool = True
    loss: bool = True
    tile_tokens: int | None = None
    tile_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("mlp", "norms", "projections", "attention", "loss"):
            _require_bool(name, getattr(self, name))
        if self.tile_tokens is not None:
            _require_int("tile_tokens", self.tile_tokens, minimum=1, or_none=True)
        if self.tile_heads is not None:
            _require_int("tile_heads", self.tile_heads, minimum=1, or_none=True)
            if not self.attention:
                raise ValueError(
                    f"tile_heads={self.tile_heads} sizes the pieces of attention tiled over heads, and attention=False "
                    "turns that off: drop tile_heads, or set attention=True"
                )
        if not (self.mlp or self.norms or self.projections or self.attention or self.loss):
            raise ValueError(
                "sequence tiling with every part off (mlp, norms, projections, attention, loss) tiles nothing; "
                "call disable_sequence_tiling() instead"
            )

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> TilingOptions:
        unknown = sorted(set(kwargs) - set(cls.option_names()))
        if unknown:
            raise TypeError(
                f"unknown sequence tiling option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(cls.option_names())}"
            )
        return cls(**kwargs)  # type: ignore[arg-type]
