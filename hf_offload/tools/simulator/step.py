"""One real training step of a Hugging Face causal LM, without memory or compute.

The model is built from its config on the meta device, whose tensors have shapes, dtypes,
storages and autograd but no data, and whose ops compute nothing; PEFT is applied there. Then
the step runs as a user's would, through transformers' own code, PEFT, transformers'
checkpointing, hf_offload's engine (with `MetaStreams`), Liger's causal-LM forward with a
stand-in for its Triton loss, and AdamW: `model(input_ids=ids, labels=ids).loss`, then
`backward()`, then `optimizer.step()` and `zero_grad(set_to_none=True)`. `MemoryTracker` counts
what each op allocates; `stand_ins` has the three places where a GPU's path must be named;
`linear_attention` the kernels of hybrid models' Gated DeltaNet layers (fla, causal-conv1d).

(PyTorch's FakeTensorMode would do the same on fake CPU tensors, at several times the cost per
op: an 8B LoRA step took 6-10 s that way on this project's 2-core machine, and 3-5 s on meta tensors,
with the same peaks.)
"""

from __future__ import annotations

import contextlib
import gc
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

import hf_offload
from hf_offload.config import DEFAULT_MIN_OFFLOAD_BYTES, DISK_SPACE_SHARE, HOST_MEMORY_SHARE, TilingOptions
from hf_offload.engine import offloader, recompute
from hf_offload.internal import (
    MetaStreams,
    TierPlan,
    device_streams,
    find_final_norm,
    place_last_pass,
    resolve_layers,
    simulated_device,
    unwrap_model,
)
from hf_offload.tools.devices import DEVICES, Device
from hf_offload.tools.modes import NEEDS_ACCELERATOR, Mode, parse_mode, set_checkpointing, set_liger_flce

from .four_bit import FourBit, dequantizing_gemm, quantize, quantized_state_tensors
from .generation import DECODE_STEPS, GenerationResult, result_from_steps, run_generate
from .linear_attention import linear_attention_as_on_cuda, linear_attention_exchanged, uses_linear_attention
from .memo import SliceMemo
from .stand_ins import (
    UlyssesTraffic,
    attention_as_on_cuda,
    autocast_as_on_cuda,
    autocast_regions_on_meta,
    real_device_masking,
    simulated_liger_loss,
    simulated_ulysses,
)
from .tracker import MemoryTracker, Peak
from .trl import TrlStep, fused_head_added, fused_head_as_on_cuda, not_divisible_by_batch, trl_step

# Modes whose offloading is not hf_offload's: they need pinned memory or an accelerator.
NOT_SIMULATED = NEEDS_ACCELERATOR


@dataclass(frozen=True)
class Training:
    """How the model is trained, beside the mode."""

    dtype: torch.dtype = torch.bfloat16
    lora_rank: int | None = None
    lora_targets: str | tuple[str, ...] = "all-linear"
    # PEFT casts adapters of a bf16 model to float32 unless get_peft_model(..., autocast_adapter_dtype=False).
    lora_dtype: torch.dtype = torch.float32
    optimizer_states: int = 0  # 0: forward and backward only; 2: AdamW's step
    batch_size: int = 1
    keep_last_layers: int = 1
    prefetch_layers: int = 1
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES
    # What a checkpointed layer's recompute saves for its attention waits on the host past
    # `RECOMPUTE_OFFLOAD_BYTES` a layer (hf_offload's behaviour, `engine/recompute.py`); False keeps
    # it on the device, as systems without it do (ALST's setups in `benchmarks/published.py`).
    recompute_offload: bool = True
    # A layer's copies to the host let go of their device memory before the next layer's attention
    # from `EARLY_RELEASE_BYTES` a layer (hf_offload's behaviour, `engine/offloader.py`); False: at
    # the next layer's end, as before (ALST's setups in `benchmarks/published.py`).
    early_release: bool = True
    host_memory_bytes: int | None = None  # the simulated host's RAM; None: unlimited
    # Free space for the disk tier (hf_offload's default max_disk_bytes is 80% of it); None: no disk
    # tier. With it the step offloads every layer (nothing stays on the device for want of host
    # memory) and `place_tiers` says where the copies go and whether host and disk hold them.
    disk_memory_bytes: int | None = None
    device: Device = DEVICES["h200"]
    device_memory_bytes: int | None = None  # what the "_auto" modes read as the device's memory
    device_budget_bytes: int | None = None  # max_device_bytes for the other hf_offload modes (None: no budget)
    tile_tokens: int | None = None  # for the "+tiled" modes (None: tiling's defaults)
    # Mixed precision: the forward and loss under autocast to this dtype (the Trainer's bf16=True on
    # a float32 model: dtype=float32, autocast=bfloat16); None: no autocast.
    autocast: torch.dtype | None = None
    # A batch padded to its longest sequence: an attention mask that masks positions, as a collator
    # makes; the kernels then take a sequence x sequence mask. (Every row is as long as seq_len.)
    padded: bool = False
    # DeepSpeed Ulysses over this many ranks: the step simulated is one rank's, on seq / sp_size
    # tokens, with attention over the whole sequence and heads / sp_size heads.
    sp_size: int = 1
    # Weights, gradients and optimizer state on the host, as DeepSpeed ZeRO-3 with offload_param and
    # offload_optimizer to the CPU keeps them (`ParameterOffload` below).
    offload_params: bool = False
    # The parts the "+tiled" modes tile, as enable_sequence_tiling's keyword options (mlp, norms,
    # projections, attention, loss: `hf_offload.TilingOptions`); None: its defaults, every part.
    # ALST's tiling is the MLP alone: dict(mlp=True, norms=False, projections=False, attention=False, loss=False).
    # Kept as sorted (name, value) pairs, so that a Training stays hashable.
    tiling: Mapping[str, bool] | tuple[tuple[str, bool], ...] | None = None
    # A base loaded in 4 bits by bitsandbytes (QLoRA's), as BitsAndBytesConfig(load_in_4bit=True, ...)
    # says (`four_bit.py`); None: the weights in `dtype`.
    four_bit: FourBit | None = None
    # A TRL trainer's step (`trl.py`): its fused loss head, DPO's reference pass, GRPO's old and
    # reference log-probabilities; None: the model's own forward and loss.
    trl: TrlStep | None = None

    def __post_init__(self) -> None:
        if self.optimizer_states not in (0, 2):
            raise ValueError(f"optimizer_states must be 0 (no optimizer) or 2 (AdamW), got {self.optimizer_states}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1 or None, got {self.lora_rank}")
        if self.autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast must be torch.bfloat16, torch.float16 or None, got {self.autocast}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if isinstance(self.sp_size, bool) or not isinstance(self.sp_size, int) or self.sp_size < 1:
            raise ValueError(f"sp_size must be an int >= 1, got {self.sp_size!r}")
        if self.sp_size > 1 and self.padded:
            # Under Ulysses each rank's mask covers its shard only; what DeepSpeed does with a
            # padding mask is not simulated.
            raise ValueError("a padded batch under sequence parallelism is not simulated: drop padded or sp_size")
        if self.tiling is not None:
            parts = dict(self.tiling)
            if "tile_tokens" in parts:
                raise ValueError("give tile_tokens as Training.tile_tokens, not in tiling")
            TilingOptions.from_kwargs(**parts)  # an unknown part or a non-bool fails here, by name
            object.__setattr__(self, "tiling", tuple(sorted(parts.items())))
        if self.four_bit is not None and self.lora_rank is None:
            raise ValueError("a 4-bit base is trained through adapters: give lora_rank with four_bit")
        if self.four_bit is not None and self.offload_params:
            raise ValueError("a 4-bit base with offload_params is not simulated: drop four_bit or offload_params")
        if self.trl is not None:
            not_simulated = [name for name, on in (("sp_size > 1", self.sp_size > 1), ("padded", self.padded),
                             ("offload_params", self.offload_params)) if on]  # fmt: skip
            if not_simulated:
                raise ValueError(f"a TRL step with {', '.join(not_simulated)} is not simulated")
            self.trl.check_tuning(peft=self.lora_rank is not None)
            if self.trl.trainer == "grpo" and self.trl.generation_rows % self.batch_size:
                raise ValueError(not_divisible_by_batch(self.trl.generation_rows, self.batch_size))
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise ValueError(f"host_memory_bytes must be > 0 or None, got {self.host_memory_bytes}")
        if self.disk_memory_bytes is not None:
            if self.disk_memory_bytes <= 0:
                raise ValueError(f"disk_memory_bytes must be > 0 or None, got {self.disk_memory_bytes}")
            if self.host_memory_bytes is None:
                raise ValueError(
                    f"disk_memory_bytes={self.disk_memory_bytes} needs host_memory_bytes: with unlimited host "
                    "memory nothing goes to disk"
                )

    @property
    def host_budget_bytes(self) -> int | None:
        """max_host_bytes as hf_offload's default takes it from this much RAM."""
        return None if self.host_memory_bytes is None else int(self.host_memory_bytes * HOST_MEMORY_SHARE)

    @property
    def disk_budget_bytes(self) -> int | None:
        """max_disk_bytes as hf_offload's default takes it from this much free space."""
        return None if self.disk_memory_bytes is None else int(self.disk_memory_bytes * DISK_SPACE_SHARE)


@dataclass
class StepResult:
    """What one simulated step held on the device and moved."""

    mode: str
    seq_len: int
    batch_size: int
    tracked_peak_bytes: int  # what the step's ops held at most
    workspace_bytes: int  # library workspaces on top (cuBLAS)
    peak: Peak
    host_bytes: int | None = None  # hf_offload's host buffer pool
    offloaded_bytes: int | None = None
    over_budget_bytes: int | None = None  # what hf_offload kept on the device for the host budget
    layers_kept_for_budget: int | None = None
    matmul_flops: int = 0
    attention_flops: int = 0  # counted over the whole sequence square, as flop_counter does
    traffic_bytes: int = 0  # what the ops without FLOPs (casts, norms, activations, copies) read and write
    flops_by_tag: dict[tuple, tuple[int, int]] = field(default_factory=dict, repr=False)  # (matmul, attention)
    # FLOPs as the kernels compute them, by ("matmul" or "attention", dtype): the time model's input
    # (a causal attention kernel computes half the square flop_counter counts, a masked one all of it).
    compute: dict[tuple[str, torch.dtype], float] = field(default_factory=dict, repr=False)
    layer_offloaded_bytes: int | None = None  # the most hf_offload moved for one layer
    offload_stats: dict | None = field(default=None, repr=False)  # hf_offload's statistics of the step
    # With a disk tier: where `place_tiers` puts the copies of this step for the host and disk
    # budgets, from the host bytes of each layer call and how many leading calls were offloaded.
    tiers: TierPlan | None = None
    layer_host_bytes: list[int] | None = field(default=None, repr=False)
    offloaded_layers: int | None = None
    trace: list[int] | None = field(default=None, repr=False)
    # The most bytes live while each (phase, module) was current: lines through two lengths by tag
    # predict where per-op lines cannot (a tiled step runs more ops at longer lengths).
    tag_peaks: dict[tuple, int] = field(default_factory=dict, repr=False)
    seconds: float = 0.0  # how long the simulation took
    sp_size: int = 1  # seq_len is the whole sequence's; the rank simulated ran seq_len / sp_size tokens
    sp_sent_bytes: int = 0  # what the rank sent through Ulysses's all-to-alls (and received as much)
    sp_exchanges: int = 0  # how many all-to-alls (a chunk of query heads at a time: more, as large in all)
    params_gathered_bytes: int = 0  # with offload_params: the weights brought from the host
    params_host_bytes: int | None = None  # with offload_params: weights, gradients, optimizer on the host

    @property
    def peak_bytes(self) -> int:
        """What torch.cuda.max_memory_allocated would report."""
        return self.tracked_peak_bytes + self.workspace_bytes

    @property
    def flops(self) -> int:
        return self.matmul_flops + self.attention_flops

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def rank_seq_len(self) -> int:
        return -(-self.seq_len // self.sp_size)


@dataclass
class _Attribution:
    """Stamps each allocation with the phase and the module making it: module hooks in forward
    (and in a checkpoint's recompute), and in backward a gradient hook on each module's output,
    which fires as that module's backward starts."""

    tracker: MemoryTracker
    labels: dict[int, str]
    hooked: set[int]
    phase: str = "forward"
    stack: list[tuple] = field(default_factory=list)
    # Told each tag set (parameter offload follows the module running from it).
    listener: Callable[[tuple], None] | None = None

    def _set(self, tag: tuple) -> None:
        self.tracker.tag = tag
        if self.listener is not None:
            self.listener(tag)

    def enter_phase(self, phase: str, where: str) -> None:
        self.phase = phase
        self.stack.clear()
        self._set((phase, where))

    def pre(self, module, args) -> None:
        label = self.labels.get(id(module))
        if label is not None:
            self.stack.append(self.tracker.tag)
            self._set(("recompute" if self.phase == "backward" else self.phase, label))

    def post(self, module, args, output) -> None:
        key = id(module)
        if key not in self.labels:
            return
        if self.stack:
            self._set(self.stack.pop())
        if self.phase == "forward" and key in self.hooked:
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                label = self.labels[key]
                tensor.register_hook(lambda grad, label=label: self._backward_reached(label))

    def _backward_reached(self, label: str) -> None:
        self.stack.clear()
        self._set(("backward", label))

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        registrations = torch.nn.modules.module
        handles = [
            registrations.register_module_forward_pre_hook(self.pre),
            registrations.register_module_forward_hook(self.post, always_call=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _first_grad_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return item
    return None


def _module_labels(model: torch.nn.Module) -> tuple[dict[int, str], set[int]]:
    """A coarse label for every module ("layer 3 mlp", "lm_head", "norm", "loss" for the causal
    LM's own code), and the modules whose backward start is marked."""
    _adapter, layers = resolve_layers(model)
    labels: dict[int, str] = {}
    hooked: set[int] = set()
    layer_ids = {id(layer) for layer in layers}
    for name, module in model.named_modules():
        if not name:
            labels[id(module)] = "loss"
            continue
        if id(module) in layer_ids:
            continue
        labels.setdefault(id(module), name.split(".")[-1])
        if name.count(".") <= 1:
            hooked.add(id(module))
    for index, layer in enumerate(layers):
        for module in layer.modules():
            labels[id(module)] = f"layer {index}"
        for child_name, child in layer.named_children():
            for module in child.modules():
                labels[id(module)] = f"layer {index} {child_name}"
            hooked.add(id(child))
        hooked.add(id(layer))
    return labels, hooked


class _TrackedStreams(MetaStreams):
    """The engine's meta streams, with its host buffers marked as host memory and what it brings
    back in backward tagged as such."""

    def __init__(self, device: torch.device, tracker: MemoryTracker) -> None:
        super().__init__(device)
        self.tracker = tracker

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        with self.tracker.host_allocations():
            return super().host_buffer(nbytes)

    def shrink(self, storage: torch.UntypedStorage) -> None:
        super().shrink(storage)
        self.tracker.resized(storage)

    def regrow(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        super().regrow(storage, nbytes)
        self.tracker.resized(storage)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        tag = self.tracker.tag
        self.tracker.tag = ("restored", tag[1] if len(tag) > 1 else "")
        try:
            return super().device_buffer(nbytes)
        finally:
            self.tracker.tag = tag


class ParameterOffload:
    """The device's share of the weights under DeepSpeed ZeRO-3 with `offload_param` and
    `offload_optimizer` on the CPU: the weights live partitioned on the host, and a unit's are
    gathered whole on the device while it runs. Units: the input embeddings, each decoder layer,
    and the rest (final norm, loss head). Assumed, of ZeRO-3's defaults: the unit running and the
    next in the pass's order are gathered (its prefetch reads ahead through
    `stage3_prefetch_bucket_size`, 5e7 elements by default, 100 MB in bf16: a whole next layer
    overstates it for a large model and is the simple bound); a unit's gradients stay on the device
    until the pass leaves it (ZeRO reduces and moves them in buckets), then go to the host, where
    the optimizer steps. Parameters are marked as host memory in the tracker, so that views of them
    cost nothing; the gathered copies are one counted block per unit."""

    TAG = ("weights", "gathered")

    def __init__(self, model: torch.nn.Module, base: torch.nn.Module, tracker: MemoryTracker) -> None:
        self.tracker = tracker
        _adapter, layers = resolve_layers(base)
        embeddings = base.get_input_embeddings()
        in_layers = [{id(p): p for p in layer.parameters()} for layer in layers]
        first = {id(p): p for p in embeddings.parameters()} if embeddings is not None else {}
        taken = set(first).union(*in_layers)
        rest = {id(p): p for p in model.parameters() if id(p) not in taken}
        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        if isinstance(head, torch.nn.Module):  # tied to the embeddings: gathered for the loss head too
            rest.update((id(p), p) for p in head.parameters())
        self.units = [list(first.values()), *(list(u.values()) for u in in_layers), list(rest.values())]
        self.unit_bytes = [sum(p.numel() * p.element_size() for p in unit) for unit in self.units]
        self.layers = len(layers)
        self.gathered: dict[int, torch.Tensor] = {}
        self.current: tuple[int, int] | None = None  # (unit, direction)
        self.gathered_bytes = 0  # what the step brought from the host: weights, every gather

    def unit_of(self, label: str) -> int | None:
        match = _LAYER.match(label)
        if match:
            return int(match.group(1)) + 1
        if label == "embed_tokens":
            return 0
        if label in ("norm", "lm_head", "loss"):
            return self.layers + 1
        return None

    def follow(self, tag: tuple) -> None:
        """The module running changed: keep its unit and the next gathered, free the others, and
        send the gradients of the units left behind to the host."""
        phase = tag[0]
        if phase == "optimizer":
            self.release()
            return
        unit = self.unit_of(tag[1]) if len(tag) > 1 else None
        if unit is None:
            return
        direction = 1 if phase == "forward" else -1
        if self.current == (unit, direction):
            return
        self.current = (unit, direction)
        wanted = {unit, unit + direction} & set(range(len(self.units)))
        for other in list(self.gathered):
            if other not in wanted:
                del self.gathered[other]
        for index, parameters in enumerate(self.units):
            if index != unit:
                for parameter in parameters:
                    parameter.grad = None
        for index in sorted(wanted - set(self.gathered)):
            nbytes = self.unit_bytes[index]
            self.gathered[index] = self.tracker.allocate((nbytes,), (1,), torch.uint8, self.TAG)
            self.gathered_bytes += nbytes

    def release(self) -> None:
        self.gathered.clear()
        self.current = None
        for unit in self.units:
            for parameter in unit:
                parameter.grad = None

    def host_bytes(self, optimizer_states: int) -> int:
        """What the host holds for the weights: the bf16 (the model's dtype) partitions, and for each
        trainable parameter its float32 gradient, master copy and AdamW's two float32 states
        (DeepSpeed's CPU offload keeps the optimizer's side in float32)."""
        unique = {id(p): p for unit in self.units for p in unit}.values()
        total = sum(p.numel() * p.element_size() for p in unique)
        trainable = sum(p.numel() for p in unique if p.requires_grad)
        per_trainable = 4 + (4 + 4 * optimizer_states if optimizer_states else 0)
        return total + trainable * per_trainable


# The config fields that size a table of positions, in the order they are looked up.
POSITION_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len", "seq_length")
_POSITION_NAMES = ("wpe", "embed_positions", "position_embeddings", "pos_emb", "pos_embed", "positional_embedding")


@dataclass(frozen=True)
class PositionTable:
    """A model whose positions are rows of an embedding table (GPT-2's `wpe`, OPT's
    `embed_positions`: learned, or fixed as an `nn.Embedding`): a sequence with more positions
    than its rows indexes past the table, which on a GPU fails (index out of range). Rotary and
    ALiBi models have no such table and no such limit."""

    field: str  # the config field that sizes the table ("" where none does)
    rows: int  # the most positions a sequence can have
    module: str  # the table's module, by name

    def describe(self, model_type: str) -> str:
        size = f"{self.field}={self.rows}" if self.field else f"{self.rows} rows"
        return f"{model_type}'s positions are a table of {size} ({self.module})"


def position_table(model: torch.nn.Module, config) -> PositionTable | None:
    """The table `model` looks its positions up in, if any: an `nn.Embedding` other than the token
    embeddings, named or typed as positions, its rows given by the config field that sizes it (OPT's
    and BART's tables keep 2 rows more than `max_position_embeddings` for an offset), or a fixed
    table kept as a buffer (CTRL's `pos_encoding`)."""
    text = config.get_text_config()
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Embedding) or module is tokens:
            continue
        if name.rsplit(".", 1)[-1] not in _POSITION_NAMES and "position" not in type(module).__name__.lower():
            continue
        for field_name in POSITION_FIELDS:
            value = getattr(text, field_name, None)
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= module.num_embeddings - value <= 2:
                return PositionTable(field_name, value, name)
        return PositionTable("", module.num_embeddings, name)
    for name, buffer in model.named_buffers():  # a fixed table kept as a buffer (CTRL's sinusoids)
        if name.rsplit(".", 1)[-1] in _POSITION_NAMES + ("pos_encoding",) and buffer.dim() == 2:
            for field_name in POSITION_FIELDS:
                value = getattr(text, field_name, None)
                if isinstance(value, int) and not isinstance(value, bool) and buffer.shape[0] == value:
                    return PositionTable(field_name, value, name)
    return None


class Simulator:
    """A model built once on the meta device, then stepped in any mode at any length.

    `replay=True` (the default) learns each module call that sequence tiling repeats slice after
    slice once and replays it (`memo.py`): the same peak, FLOPs and traffic as running every slice
    (`replay=False`), in a fraction of the time."""

    def __init__(self, config, training: Training = Training(), *, replay: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        self.training = training
        if training.sp_size > 1:
            from hf_offload.integrations.sequence_parallel import check_sequence_parallel

            check_sequence_parallel(config, training.sp_size, world_size=training.sp_size)
        self.traffic = UlyssesTraffic(training.sp_size)
        self.replay = replay
        self.memo: SliceMemo | None = None  # the last tiled run's, for its counts
        self.scoring = None  # with a TRL step: what its fused head scores, told per call
        self.tracker = MemoryTracker()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=training.dtype)
        if training.four_bit is not None:
            model = quantize(model, training.four_bit, training.dtype)
        if training.lora_rank is not None:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=training.lora_rank, target_modules=_targets(training.lora_targets))
            model = get_peft_model(model, lora)
            for parameter in model.parameters():
                if parameter.requires_grad:  # on meta PEFT always makes float32 adapters: set the dtype asked for
                    parameter.data = parameter.data.to(training.lora_dtype)
        model.train()
        self.model = model
        self.base = unwrap_model(model)
        with self.tracker.host_allocations() if training.offload_params else contextlib.nullcontext():
            for parameter in model.parameters():
                self.tracker.adopt(parameter)
        for buffer in model.buffers():
            self.tracker.adopt(buffer)
        for statistics in quantized_state_tensors(model):
            self.tracker.adopt(statistics)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        for parameter in self.trainable:
            parameter.register_post_accumulate_grad_hook(lambda p: self.tracker.retag(p.grad, ("gradients", "")))
        self.optimizer = None
        self.param_offload = ParameterOffload(model, self.base, self.tracker) if training.offload_params else None
        if training.optimizer_states and not training.offload_params:  # offloaded, the optimizer steps on the host
            self._create_optimizer_state()
        self.labels, self.hooked = _module_labels(self.base)
        self.reference = self._reference_model(config) if training.trl is not None else None
        self.resident_bytes = self.tracker.live  # weights, the reference model's, optimizer state
        self.positions = position_table(self.base, config)  # None: no table, no limit on the length

    def _reference_model(self, config):
        """The second model a TRL trainer keeps on the device (`TrlStep.loads_reference`): loaded
        with `from_pretrained` in the policy's dtype (quantized as the policy's base is, where one
        is given to a QLoRA policy), in eval mode, without the policy's adapters, checkpointing,
        offloading or tiling (TRL builds it from the path; nothing of the policy's is applied)."""
        from transformers import AutoModelForCausalLM

        training = self.training
        if not training.trl.loads_reference(peft=training.lora_rank is not None):
            return None
        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(config, dtype=training.dtype)
        if training.four_bit is not None:
            reference = quantize(reference, training.four_bit, training.dtype)
        reference.eval()
        reference.requires_grad_(False)
        tag, self.tracker.tag = self.tracker.tag, ("reference",)
        for tensor in (*reference.parameters(), *reference.buffers(), *quantized_state_tensors(reference)):
            self.tracker.adopt(tensor)
        self.tracker.tag = tag
        return reference

    @property
    def reference_bytes(self) -> int:
        """The reference model's weights (0 without one)."""
        return sum(n for tag, n in self.tracker.live_by_tag.items() if tag[0] == "reference")

    @property
    def weight_bytes(self) -> int:
        return sum(n for tag, n in self.tracker.live_by_tag.items() if tag[0] == "weights")

    def _create_optimizer_state(self) -> None:
        """AdamW's two states per trainable parameter exist from the first step on: a step in
        steady training starts with them. foreach=True, as torch picks on CUDA (its temporaries
        are part of the step's peak)."""
        with self.tracker:
            self.tracker.tag = ("optimizer", "")
            self.optimizer = torch.optim.AdamW(self.trainable, lr=1e-5, foreach=True)
            for parameter in self.trainable:
                parameter.grad = torch.zeros_like(parameter)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        gc.collect()

    def run(self, mode: str | Mode, seq_len: int, *, trace: bool = False) -> StepResult:
        """One step of `mode` at `seq_len` tokens per sequence (with a device-memory budget it runs
        twice: the first step measures the layers for the plan, as in training)."""
        parsed = mode if isinstance(mode, Mode) else parse_mode(mode)
        if parsed.base in NOT_SIMULATED:
            raise ValueError(f"mode {parsed.name!r} cannot be simulated: {NOT_SIMULATED[parsed.base]}")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (a causal LM predicts each token from those before), got {seq_len}")
        positions = self.training.trl.row_length(seq_len) if self.training.trl is not None else seq_len
        if self.positions is not None and positions > self.positions.rows:
            raise ValueError(
                f"{self.positions.describe(self.config.get_text_config().model_type)}: a sequence of {positions:,} "
                f"tokens would index past it (on a GPU, an index out of range in the lookup); at most "
                f"{self.positions.rows:,} tokens per sequence"
            )
        if parsed.liger and self.training.trl is not None:
            raise ValueError(f"mode {parsed.name!r}: TRL's trainers refuse Liger's fused cross-entropy (theirs runs)")
        started = time.perf_counter()
        budgeted = parsed.hf_offload and (parsed.budget or self.training.device_budget_bytes is not None)
        with self._configured(parsed):
            for _ in range(2 if budgeted else 1):
                result = self._step(parsed, seq_len, trace=trace)
        result.seconds = time.perf_counter() - started
        return result

    @contextlib.contextmanager
    def _configured(self, mode: Mode) -> Iterator[None]:
        training, base = self.training, self.base
        tracker = self.tracker
        device_memory = training.device_memory_bytes

        def read_device() -> tuple[int, int]:
            return max(device_memory - tracker.live - training.device.workspace_bytes, 0), device_memory

        with contextlib.ExitStack() as stack:
            set_checkpointing(base, mode.checkpointing)
            stack.callback(set_checkpointing, base, False)
            if mode.liger:
                set_liger_flce(base, True)
                stack.callback(set_liger_flce, base, False)
                stack.enter_context(simulated_liger_loss())
            if mode.budget and device_memory is None:
                raise ValueError(f"mode {mode.name!r} reads the device's memory: give the device memory")
            if device_memory is not None:
                # What the product reads of the device: "auto"'s free memory, the total that sizes
                # tiling's default slices.
                stack.enter_context(simulated_device(read_device))
            if mode.tiled:
                if self.replay:
                    # Under tiling's wrappers, so that its slices call the memo.
                    self.memo = SliceMemo(tracker)
                    stack.enter_context(self.memo.installed(self._memo_modules()))
                hf_offload.enable_sequence_tiling(base, tile_tokens=training.tile_tokens, **dict(training.tiling or ()))
                stack.callback(hf_offload.disable_sequence_tiling, base)
            if mode.hf_offload:
                # With a disk tier the host budget holds what the disk does not: the step offloads
                # everything, and `place_tiers` judges the two tiers after it.
                host = None if training.disk_memory_bytes is not None else training.host_budget_bytes
                if not training.recompute_offload:
                    stack.enter_context(recompute.threshold(2**62))
                if not training.early_release:
                    stack.enter_context(offloader.early_release_threshold(2**62))
                hf_offload.enable_activation_offloading(
                    base,
                    simulate_on_cpu=True,
                    keep_last_layers=training.keep_last_layers,
                    prefetch_layers=training.prefetch_layers,
                    min_offload_bytes=training.min_offload_bytes,
                    max_host_bytes=2**62 if host is None else host,
                    max_device_bytes="auto" if mode.budget else training.device_budget_bytes,
                )
                stack.callback(hf_offload.disable_activation_offloading, base)
            stack.enter_context(device_streams(lambda device: _TrackedStreams(device, tracker)))
            stack.enter_context(real_device_masking(padded=training.padded))
            stack.enter_context(attention_as_on_cuda(training.device.compute_capability))
            if uses_linear_attention(self.config):
                stack.enter_context(linear_attention_as_on_cuda(training.device.compute_capability))
            stack.enter_context(autocast_regions_on_meta())
            if training.autocast is not None:
                stack.enter_context(autocast_as_on_cuda(tracker.in_the_step))
            if training.four_bit is not None:
                stack.enter_context(dequantizing_gemm())
            if training.trl is not None:
                # After tiling and offloading, as a TRL trainer adds its head to the model it is given.
                stack.enter_context(fused_head_added(base, training.trl.trainer))
                if self.reference is not None:
                    stack.enter_context(fused_head_added(self.reference, training.trl.trainer, reference=True))
                self.scoring = stack.enter_context(fused_head_as_on_cuda(training.trl.kernel))
            if training.sp_size > 1:
                # After tiling's wrappers: Ulysses gathers the sequence, then attention tiled over heads runs.
                implementation = base.config._attn_implementation or "sdpa"
                stack.enter_context(simulated_ulysses(implementation, training.sp_size, self.traffic))
                if uses_linear_attention(self.config):  # their own exchange, as register_ulysses prepares them
                    stack.enter_context(linear_attention_exchanged(base, training.sp_size, self.traffic))
            yield

    def generate(self, mode: str | Mode, *, rows: int, prompt_length: int, padded: bool = False,
                 generation_kwargs: dict | None = None) -> GenerationResult:  # fmt: skip
        """GRPO's generation before a step of `mode`: transformers' `generate` on this model as TRL
        calls it (`generation.py`), for `rows` prompts of `prompt_length` tokens, through the
        prefill and DECODE_STEPS decode steps; what it holds is counted above `resident_bytes`, and
        its decode steps are lines in the step."""
        parsed = mode if isinstance(mode, Mode) else parse_mode(mode)
        if parsed.base in NOT_SIMULATED:
            raise ValueError(f"mode {parsed.name!r} cannot be simulated: {NOT_SIMULATED[parsed.base]}")
        started = time.perf_counter()
        tracker = self.tracker
        with self._configured(parsed), tracker:
            # TRL switches checkpointing off around generation (unwrap_model_for_generation).
            set_checkpointing(self.base, False)
            tracker.start(trace=False)
            counts, answered = run_generate(
                self.model, self.base, tracker, rows=rows, prompt_length=prompt_length, padded=padded,
                max_new_tokens=DECODE_STEPS + 2, generation_kwargs=generation_kwargs,
            )  # fmt: skip
            tracker.finish()
        gc.collect()
        leaked = tracker.live - self.resident_bytes
        if leaked:
            raise RuntimeError(f"the simulated generation left {leaked} bytes allocated after it (a reference kept?)")
        result = result_from_steps(counts, rows=rows, prompt_length=prompt_length, padded=padded,
                                   config=self.config, kv_dtype=self.training.dtype, answered=answered)  # fmt: skip
        result.seconds = time.perf_counter() - started
        return result

    def _memo_modules(self) -> list[torch.nn.Module]:
        """What tiling may run slice by slice: the decoder layers' parts (not the layers), the final
        norm (a per-token module of its own, and a stage of the tiled loss where lm_head takes its
        output) and lm_head."""
        _adapter, layers = resolve_layers(self.base)
        modules = [module for layer in layers for module in layer.modules() if module is not layer]
        norm = find_final_norm(self.base, layers)
        if norm is not None:
            modules.append(norm)
        head = self.base.get_output_embeddings() if hasattr(self.base, "get_output_embeddings") else None
        if isinstance(head, torch.nn.Module):
            modules.append(head)
        return modules

    def _step(self, mode: Mode, seq_len: int, *, trace: bool) -> StepResult:
        tracker, training = self.tracker, self.training
        attribution = _Attribution(tracker, self.labels, self.hooked)
        offload = self.param_offload
        if offload is not None:
            attribution.listener = offload.follow
            offload.gathered_bytes = 0
        self.traffic.sent_bytes = self.traffic.calls = 0
        with tracker, attribution.installed():
            tracker.start(trace=trace)
            attribution.enter_phase("forward", "inputs")
            # One rank's shard of the sequence (Ulysses pads the last to the same length).
            rank_tokens = -(-seq_len // training.sp_size)
            # The forward and the loss under autocast, the backward after it, as the Trainer runs them.
            autocast = training.autocast is not None
            ids = None
            with torch.autocast("cpu", dtype=training.autocast or torch.bfloat16, enabled=autocast):
                if training.trl is not None:
                    loss = trl_step(self.model, training.trl, batch_size=training.batch_size, seq_len=rank_tokens,
                                    device="meta", scoring=self.scoring, reference=self.reference,
                                    phase=lambda name: attribution.enter_phase(name, "inputs"))  # fmt: skip
                else:
                    ids = torch.zeros((training.batch_size, rank_tokens), dtype=torch.long, device="meta")
                    inputs = dict(input_ids=ids, labels=ids)
                    if training.padded:
                        inputs["attention_mask"] = torch.ones_like(ids)
                    loss = self.model(**inputs).loss
                    del inputs
            attribution.enter_phase("backward", "loss")
            loss.backward()
            del loss, ids
            if self.optimizer is not None:
                attribution.enter_phase("optimizer", "")
                self.optimizer.step()
            self.model.zero_grad(set_to_none=True)
            if offload is not None:
                offload.release()
            peak = tracker.finish()
        gc.collect()
        result = StepResult(
            mode=mode.name,
            seq_len=seq_len,
            batch_size=training.batch_size,
            tracked_peak_bytes=peak.bytes,
            workspace_bytes=training.device.workspace_bytes,
            peak=replace(peak),
            matmul_flops=tracker.matmul_flops,
            attention_flops=tracker.attention_flops,
            traffic_bytes=tracker.traffic_bytes,
            flops_by_tag={tag: tuple(counts) for tag, counts in tracker.flops_by_tag.items()},
            compute=dict(tracker.compute),
            trace=tracker.trace,
            tag_peaks=dict(tracker.main.tag_peaks),
            sp_size=training.sp_size,
            sp_sent_bytes=self.traffic.sent_bytes,
            sp_exchanges=self.traffic.calls,
        )
        if offload is not None:
            result.params_gathered_bytes = offload.gathered_bytes
            result.params_host_bytes = offload.host_bytes(training.optimizer_states)
        if mode.hf_offload:
            stats = hf_offload.activation_offloading_stats(self.base)
            result.host_bytes = stats.pool_bytes
            result.offloaded_bytes = stats.offloaded_bytes
            result.over_budget_bytes = stats.kept_bytes.get("over_budget", 0)
            result.layers_kept_for_budget = stats.layers_kept_for_budget
            result.layer_offloaded_bytes = stats.max_layer_offloaded_bytes
            result.offload_stats = stats.as_dict()
            if training.disk_memory_bytes is not None:
                result.tiers, result.layer_host_bytes, result.offloaded_layers = place_last_pass(
                    self.base, host_bytes=training.host_budget_bytes, disk_bytes=training.disk_budget_bytes
                )
        leaked = tracker.live - self.resident_bytes
        if leaked:
            raise RuntimeError(f"the simulated step left {leaked} bytes allocated after it (a reference kept?)")
        return result


def _targets(targets: str | tuple[str, ...]):
    return targets if isinstance(targets, str) else list(targets)


# -- where the peak's bytes came from -------------------------------------------------------------

PHASES = {
    "weights": "weights",
    "reference": "the reference model's weights",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "forward": "forward",
    "scoring": "scoring under no_grad (reference and old log-probabilities)",
    "recompute": "recomputed in backward",
    "backward": "backward",
    "restored": "brought back by hf_offload",
}
_RESIDENT = ("weights", "reference", "gradients", "optimizer")
_NAMES = {"loss": "loss head", "lm_head": "loss head", "norm": "final norm", "embed_tokens": "embeddings"}
_LAYER = re.compile(r"layer (\d+)(?: (.+))?$")


@dataclass(frozen=True)
class Part:
    """Bytes live at the peak from one origin."""

    phase: str  # a key of PHASES
    what: str  # "layers 0-30", "layer 31", "loss head", ...
    bytes: int
    layers: int = 0  # how many layers the row sums (0: not decoder layers)


def composition(peak: Peak) -> list[Part]:
    """The peak's bytes by origin, largest first: decoder layers grouped into runs of layers that
    hold the same bytes, other modules by name."""
    per_layer: dict[str, dict[int, int]] = {}
    parts: dict[tuple[str, str], int] = {}
    for (phase, *where), nbytes in peak.live_by_tag.items():
        label = where[0] if where else ""
        if phase in _RESIDENT:
            label = ""
        match = _LAYER.match(label)
        if match and phase not in _RESIDENT:
            per_layer.setdefault(phase, {}).setdefault(int(match.group(1)), 0)
            per_layer[phase][int(match.group(1))] += nbytes
            continue
        key = (phase, _NAMES.get(label, label))
        parts[key] = parts.get(key, 0) + nbytes
    rows = [Part(phase, what, nbytes) for (phase, what), nbytes in parts.items() if nbytes]
    for phase, layers in per_layer.items():
        for first, last, total in _runs(layers):
            what = f"layer {first}" if first == last else f"layers {first}-{last}"
            rows.append(Part(phase, what, total, last - first + 1))
    return sorted(rows, key=lambda part: -part.bytes)


def _runs(layers: dict[int, int]) -> Iterator[tuple[int, int, int]]:
    """(first, last, total bytes) of consecutive layers holding the same bytes (within 1%)."""
    order = sorted(layers)
    start = 0
    for index in range(1, len(order) + 1):
        ends = index == len(order)
        if not ends:
            same = abs(layers[order[index]] - layers[order[start]]) <= 0.01 * max(layers[order[start]], 1)
            consecutive = order[index] == order[index - 1] + 1
        if ends or not (same and consecutive):
            chosen = order[start:index]
            yield chosen[0], chosen[-1], sum(layers[i] for i in chosen)
            start = index
