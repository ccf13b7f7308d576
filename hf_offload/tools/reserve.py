"""What a real run allocates on the device beside the simulated step: the reserve the longest
sequence leaves free (`hf-offload estimate` searches within the device's memory less it).

Each item is present only where the run as simulated has it, and each says where its figure
comes from:

- `reduce_bucket` (ZeRO-3, `offload_params`): DeepSpeed's ZeRO-3 optimizer allocates, with
  `contiguous_gradients` on (its default), one device buffer of `reduce_bucket_size` elements per
  communication dtype (`deepspeed/runtime/zero/stage3.py`: `torch.empty(self.reduce_bucket_size,
  dtype=dtype, device=...)`), the model's dtype here. Both defaults are read from the installed
  DeepSpeed's `DeepSpeedZeroConfig`.
- `prefetch` (ZeRO-3): DeepSpeed gathers ahead, parameter by parameter in the order of use, until
  `stage3_prefetch_bucket_size` elements are in flight (`partitioned_param_coordinator.py`: the
  last one may overshoot it). The simulated step already holds the whole next unit (a decoder
  layer) gathered; the reserve adds only what DeepSpeed's rule would hold beyond that (nothing,
  when a layer is larger than the bucket plus its largest parameter).
- `nccl` (more than one rank: `sp_size` > 1): NCCL's buffers, sized from NCCL's documented
  defaults (cited, not read: NCCL is not installed on a CPU machine): `NCCL_BUFFSIZE` 4 MiB per
  connection and channel, for the sequence-parallel group's all-to-alls (point to point, to each
  of the other ranks over `NCCL_P2P_CHANNELS_PER_PEER` channels) and for ZeRO-3's all-gathers and
  reduce-scatters (a ring: a connection to each of two neighbours over `NCCL_RING_CHANNELS`).
- `allocator`: PyTorch's caching allocator rounds each large block up to `kRoundLarge` (read from
  the installed torch's `c10/core/AllocatorConfig.h` where its headers are installed) and leaves
  freed blocks its next requests cannot reuse whole; how much at these sizes depends on the run's
  order of allocations, which no code fixes: `ALLOCATOR_SHARE` of the usable memory, an
  assumption (with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, ALST's setting, the
  allocator maps pages into one segment and leaves little more than the rounding).

The CUDA context is not an item: the device presets' usable memory already leaves it out
(`devices.RESERVED_GIB`, from the H200's usable memory against its total). Each item's default
can be replaced (`hf-offload estimate --reserve NAME=GIB`), and `extra` adds any amount.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MIB = 2**20
GIB = 2**30

# Cited from NCCL's documentation (environment variables; not read: NCCL is not installed here).
NCCL_BUFFSIZE = 4 * MIB  # NCCL_BUFFSIZE's default, per connection and channel
# Assumptions on the channels NCCL opens between NVLink-connected GPUs (NCCL picks them from the
# topology at run time): a ring over 16 channels for the collectives, 2 channels to each peer for
# point-to-point (NCCL_NCHANNELS_PER_NET_PEER's documented default, taken for NVLink peers too).
NCCL_RING_CHANNELS = 16
NCCL_P2P_CHANNELS_PER_PEER = 2
# The allocator's rounding and fragmentation, as a share of the usable device memory: an
# assumption (no measurement of reserved against allocated bytes at these sizes exists here).
ALLOCATOR_SHARE = 0.01
# torch's kRoundLarge when its header cannot be read (c10/core/AllocatorConfig.h, torch 2.13).
ROUND_LARGE_CITED = 2 * MIB

NAMES = ("reduce_bucket", "prefetch", "nccl", "allocator", "extra")


@dataclass(frozen=True)
class Item:
    name: str  # as `--reserve NAME=GIB` names it
    what: str  # what it is, in words
    bytes: int
    source: str  # where the figure comes from
    given: bool = False  # the user set it


@dataclass(frozen=True)
class Reserve:
    items: tuple[Item, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.items)

    def as_json(self) -> dict:
        return {
            "bytes": self.bytes,
            "items": [
                {"name": i.name, "what": i.what, "bytes": i.bytes, "source": i.source, "given": i.given}
                for i in self.items
            ],
        }


# DeepSpeed 0.19.8's defaults, cited for where DeepSpeed is not installed (`--offload-params`
# simulates its ZeRO-3 without it).
ZERO_DEFAULTS_CITED = {"reduce_bucket_size": 500_000_000, "prefetch_bucket_size": 50_000_000,
                       "contiguous_gradients": True}  # fmt: skip


def _zero_config():
    """DeepSpeed's `DeepSpeedZeroConfig`, or None where DeepSpeed is not installed. DeepSpeed's
    import logs its accelerator choice to stdout: sent to stderr, so that `--json` stays JSON."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:
        return None
    return DeepSpeedZeroConfig


def zero_config_default(field: str) -> int:
    """A default of DeepSpeed's ZeRO config, read from the installed `DeepSpeedZeroConfig`
    (`reduce_bucket_size`, `prefetch_bucket_size`, `contiguous_gradients`, ...), else cited."""
    config = _zero_config()
    return ZERO_DEFAULTS_CITED[field] if config is None else config.model_fields[field].default


def deepspeed_version() -> str:
    """"0.19.8's default (read)", or where DeepSpeed is not installed, the cited version's."""
    if _zero_config() is None:
        return "0.19.8's default (cited: DeepSpeed is not installed)"
    import deepspeed

    return f"{deepspeed.__version__}'s default (read)"


def torch_round_large() -> tuple[int, str]:
    """torch's caching allocator's `kRoundLarge`, read from the installed header, or cited."""
    import torch

    header = os.path.join(os.path.dirname(torch.__file__), "include", "c10", "core", "AllocatorConfig.h")
    try:
        with open(header) as file:
            found = re.search(r"kRoundLarge\s*=\s*(\d+)", file.read())
    except OSError:
        found = None
    if found:
        return int(found.group(1)), f"kRoundLarge read from torch {torch.__version__}'s c10/core/AllocatorConfig.h"
    return ROUND_LARGE_CITED, "kRoundLarge cited from torch 2.13's c10/core/AllocatorConfig.h (header not installed)"


def prefetch_elements(parameter_numels: Sequence[int], bucket: int) -> int:
    """The elements DeepSpeed's prefetch gathers from a unit whose parameters, in order of use,
    have these sizes: one after another while fewer than `bucket` are in flight."""
    taken = 0
    for numel in parameter_numels:
        if taken >= bucket:
            break
        taken += numel
    return taken


def device_reserve(
    *,
    usable_bytes: int,
    dtype_bytes: int,
    sp_size: int = 1,
    offload_params: bool = False,
    trainable: bool = True,
    units: Sequence[Sequence[int]] = (),
    overrides: Mapping[str, int] | None = None,
) -> Reserve:
    """The reserve of a run: `usable_bytes` the device's usable memory, `dtype_bytes` the size
    of the model's dtype (ZeRO-3's communication dtype), `units` the parameter sizes (in elements,
    in order of use) of each unit the simulated step gathers whole, the next one ahead of use.
    `overrides` replaces items' bytes by name (`NAMES`); one the run does not have is an error."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown reserve item {unknown[0]!r}; valid: {', '.join(NAMES)}")
    for name, value in overrides.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"reserve item {name!r} must be a number of bytes >= 0, got {value!r}")
    items: list[Item] = []
    absent: dict[str, str] = {}
    version = None
    if offload_params and trainable and zero_config_default("contiguous_gradients"):
        version = deepspeed_version()
        elements = zero_config_default("reduce_bucket_size")
        items.append(Item(
            "reduce_bucket", "ZeRO-3's gradient reduce bucket", elements * dtype_bytes,
            f"reduce_bucket_size {elements:.3g} elements x {dtype_bytes} bytes, DeepSpeed {version}, one "
            "device buffer (stage3.py, contiguous_gradients)",
        ))  # fmt: skip
    else:
        absent["reduce_bucket"] = "only with ZeRO-3 (--offload-params) and trainable parameters"
    if offload_params:
        version = version or deepspeed_version()
        bucket = zero_config_default("prefetch_bucket_size")
        # The unit where DeepSpeed's rule holds the most beyond the simulated whole unit.
        unit = max(units, key=lambda u: (prefetch_elements(u, bucket) - sum(u), sum(u)), default=())
        prefetched = prefetch_elements(unit, bucket) * dtype_bytes
        held = sum(unit) * dtype_bytes
        items.append(Item(
            "prefetch", "ZeRO-3's prefetch beyond the next unit gathered whole", max(prefetched - held, 0),
            f"stage3_prefetch_bucket_size {bucket:.3g} elements, DeepSpeed {version}: "
            f"{prefetched / MIB:.0f} MiB gathered ahead (the last parameter past the bucket included), the "
            f"simulated step holds the whole next layer ({held / MIB:.0f} MiB)",
        ))  # fmt: skip
    else:
        absent["prefetch"] = "only with ZeRO-3 (--offload-params)"
    if sp_size > 1:
        connections = NCCL_RING_CHANNELS * 2 + NCCL_P2P_CHANNELS_PER_PEER * (sp_size - 1)
        items.append(Item(
            "nccl", f"NCCL's buffers ({sp_size} ranks: all-to-alls, all-gathers)", connections * NCCL_BUFFSIZE,
            f"cited, not read (NCCL is not installed here): NCCL_BUFFSIZE {NCCL_BUFFSIZE // MIB} MiB (NCCL's "
            f"documented default) x {connections} connections: a ring of {NCCL_RING_CHANNELS} channels (2 "
            f"neighbours each) and {NCCL_P2P_CHANNELS_PER_PEER} channels to each of {sp_size - 1} peers (assumed)",
        ))  # fmt: skip
    else:
        absent["nccl"] = "only with more than one rank (--sp N)"
    round_large, where = torch_round_large()
    items.append(Item(
        "allocator", "the caching allocator's rounding and fragmentation", int(usable_bytes * ALLOCATOR_SHARE),
        f"assumed: {ALLOCATOR_SHARE:.0%} of the usable memory ({where}: {round_large // MIB} MiB per large block; "
        "expandable_segments:True keeps fragmentation near that)",
    ))  # fmt: skip
    for name, reason in absent.items():
        if name in overrides:
            raise ValueError(f"reserve item {name!r}: this run has none ({reason})")
    found = {item.name: item for item in items}
    for name, value in overrides.items():
        if name == "extra":
            continue
        item = found[name]
        found[name] = Item(item.name, item.what, value, f"given (default {item.bytes / GIB:.2f} GiB)", given=True)
    items = list(found.values())
    if overrides.get("extra"):
        items.append(Item("extra", "given beside the items", overrides["extra"], "given", given=True))
    return Reserve(tuple(items))


def parse_reserve(texts: Sequence[str]) -> dict[str, int]:
    """`--reserve NAME=GIB ...` as bytes by name; a bad name or number raises ValueError naming it."""
    found: dict[str, int] = {}
    for text in texts:
        name, sep, value = text.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"{text!r} is not NAME=GIB; names: {', '.join(NAMES)}")
        if name not in NAMES:
            raise ValueError(f"{text!r}: unknown item {name!r}; names: {', '.join(NAMES)}")
        try:
            gib = float(value)
        except ValueError:
            raise ValueError(f"{text!r}: {value!r} is not a number of GiB") from None
        if not gib >= 0 or gib == float("inf"):
            raise ValueError(f"{text!r}: GiB must be a finite number >= 0")
        if name in found:
            raise ValueError(f"{text!r}: {name} given twice")
        found[name] = int(gib * GIB)
    return found
