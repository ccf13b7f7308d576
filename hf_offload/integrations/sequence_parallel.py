"""Sequence parallelism on DeepSpeed's Ulysses (the SP half of ALST), for a loop of one's own.

Ulysses splits each sequence across the ranks of a sequence-parallel (SP) group: every per-token
part of the model (embeddings, MLPs, norms, projections, the loss head) sees `seq / sp_size`
tokens, and around the attention kernel an all-to-all trades tokens for heads, so attention sees
the whole sequence with `heads / sp_size` heads. hf_offload's offloading and tiling work inside
each rank unchanged. Nothing here is needed with accelerate or the Trainer, which drive Ulysses
through `ParallelismConfig(sp_backend="deepspeed", sp_size=N)` (docs/sequence_parallel.md);
`check_sequence_parallel` gives their bad input a clear error before they start.

What this module adds to DeepSpeed's pieces, for a custom loop:

- `register_ulysses(model, sp_size)` checks the model and the process group first (attention
  heads divisible by `sp_size`, an attention implementation Ulysses can wrap, the world size),
  then registers Ulysses, with only shards (what `adapt` yields, what `sequence_parallel_loss` is
  given) going through its exchange: every other forward attends locally, each rank on its rows.
  DeepSpeed replaces the attention function process-wide and keeps its SP group in a module
  global; registering again (another model, another batch size) replaces the earlier
  registration instead of wrapping Ulysses in Ulysses, and `unregister_ulysses()` puts the
  attention function back.
- `Ulysses.adapt(loader)` wraps DeepSpeed's `UlyssesSPDataLoaderAdapter`: a batch without
  `position_ids` gets the ones transformers would use on one process, a sequence not divisible
  by `sp_size` is padded at its end (labels ignored, so nothing changes), and batches Ulysses
  would train on differently from one process (left padding, packed documents under sdpa) are
  refused on every rank at once, so that no rank waits forever in a collective. So are ranks
  that hold the same batches (a loader without a `DistributedSampler`): Ulysses trains every
  rank's batch in turn, so each row would be trained once per rank. Each batch comes on the
  process's device, contiguous.
- `Ulysses.loss(model, batch)` (and the function `sequence_parallel_loss`) runs the model on the
  rank's shard with `shift_labels` and `num_items_in_batch` set to the whole group's count of
  labelled tokens, and sums the ranks' parts: the loss one process would report on the whole
  sequence, whose backward, averaged over the ranks as DDP, FSDP and DeepSpeed average gradients,
  is that process's gradient. Tiled or not, the loss head honours both.
- `adopt_ulysses` (called by sequence tiling before each call of a tiled attention block): under
  any Ulysses registration, the rank's query heads go through the exchange a chunk at a time where
  attention is tiled over heads (`hf_offload.tiling.ulysses_heads`), with the bytes DeepSpeed
  sends; every other call runs DeepSpeed's own forward. Refused while torch's context parallelism
  is on (both would split the sequence).

DeepSpeed is imported only when one of these is called (`pip install "hf-offload[sp]"`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import types
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .linear_attention import ULYSSES_MODULE, check_token_mixers, prepare_linear_attention, set_forward_rule, ulysses_of
from .linear_attention import config_of as _config_of
from .upstream import announce, present, resolve

IGNORE_INDEX = -100
# Attention implementations Ulysses wraps (a hub kernel "org/name" too); eager needs the 4-D mask.
ULYSSES_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# With these, packed documents (position_ids restarting inside a row) are kept apart through the
# position_ids themselves; sdpa and flex_attention under Ulysses attend across them.
_PACKING_ATTENTION = ("flash_attention_2", "flash_attention_3")
_HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")
INSTALL_HINT = 'pip install "hf-offload[sp]" (DeepSpeed >= 0.18.2)'

# What register_ulysses changed in this process: {"implementation", "local", "ulysses"}; "local" is
# what ALL_ATTENTION_FUNCTIONS's own (instance) mapping held for the implementation before, or _ABSENT.
_REGISTERED: dict = {}
_ABSENT = object()
# Ranks holding identical batches are refused only when they did for this many batches in a row at
# the start of a pass (fewer if the loader has fewer): a dataset that repeats rows can give two ranks
# the same batch by chance, twice in a row far more rarely.
IDENTICAL_BATCHES_CHECKED = 2


def _deepspeed():
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError(
            f"sequence parallelism runs on DeepSpeed's Ulysses, and deepspeed is not installed ({error}): "
            f"{INSTALL_HINT}"
        ) from error
    try:
        from deepspeed.runtime.sequence_parallel import ulysses_sp  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"deepspeed {getattr(deepspeed, '__version__', '?')} has no Ulysses for transformers "
            f"(deepspeed.runtime.sequence_parallel.ulysses_sp): {INSTALL_HINT}"
        ) from error
    return deepspeed


def _valid_sizes(heads: int, kv_heads: int) -> list[int]:
    return [s for s in range(2, heads + 1) if heads % s == 0 and (kv_heads % s == 0 or s % kv_heads == 0)]


def check_sequence_parallel(model: object, sp_size: int, world_size: int | None = None) -> str:
    """Raise a clear error for what Ulysses cannot run: `sp_size` below 2, attention heads (or
    key/value heads) it does not divide, an attention implementation it cannot wrap (eager), a
    world size it does not divide, and on the CPU a process launched with several ranks whose
    DeepSpeed communication is not set up. `world_size=None` reads the process's: the initialised
    process group's, if any (and checks DeepSpeed's communication); a number checks the model
    against that world size alone. Returns the attention implementation Ulysses will wrap.

    Token mixers other than softmax attention (linear attention, state-space and convolution
    layers), which Ulysses would run on each rank's shard alone, are refused by name, except the
    Gated DeltaNet of Qwen3.5 and Qwen3-Next: given a model, this makes those run exactly across
    the SP group wherever Ulysses runs (`hf_offload.integrations.linear_attention`).

    Call it before `Trainer(...)` or `accelerate.prepare` with the same model and `sp_size`: they
    run the same checks later, some as bare assertions."""
    implementation = _check_model(model, sp_size)
    prepare_linear_attention(model, sp_size)
    _check_not_context_parallel()
    if world_size is None:
        _check_deepspeed_communication()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size()
        _check_accelerate_processes(world_size or _launched_world_size())
    if world_size is not None and world_size % sp_size:
        raise ValueError(
            f"sp_size={sp_size} does not divide the world size {world_size}: the ranks form groups of sp_size "
            f"(launch a multiple of {sp_size} processes, e.g. torchrun --nproc-per-node {sp_size})"
        )
    return implementation


_TORCH_CONTEXT_PARALLEL = "torch.distributed.tensor.experimental._context_parallel._attention"


def torch_context_parallel_active() -> bool:
    """Whether torch's context parallelism (`context_parallel`, accelerate's `cp_size`, TRL's
    `parallelism_config_cp_size`) has replaced `torch.nn.functional.scaled_dot_product_attention`
    with its ring dispatcher in this process: inside its context, each rank's sequence is already
    a shard of the whole. (Not imported here: where it never was, it is not on. A torch private
    name, out of the upstream inventory as torch's are: tests/test_context_parallel.py holds it.)"""
    attention = sys.modules.get(_TORCH_CONTEXT_PARALLEL)
    if attention is None:
        return False
    return torch.nn.functional.scaled_dot_product_attention in attention._replaced_functions


def _check_not_context_parallel() -> None:
    if torch_context_parallel_active():
        raise ValueError(
            "torch's context parallelism is on (scaled_dot_product_attention is its ring dispatcher), and Ulysses "
            "splits the sequence across ranks too: each rank's shard would be split again. Use one of them: "
            "ParallelismConfig(cp_size=N) on FSDP2, or sp_size=N with sp_backend='deepspeed' (accelerate refuses "
            "both at once); hf_offload's offloading and tiling compose with either (docs/sequence_parallel.md)"
        )


def _check_deepspeed_communication() -> None:
    """On the CPU, accelerate and the Trainer set up torch.distributed (gloo) but not DeepSpeed's
    communication, and DeepSpeed's Ulysses registration (in their `prepare`) asserts it: say so
    first. On an accelerator they set it up themselves, and a process not launched with several
    ranks has nothing to set up yet."""
    group = torch.distributed.is_available() and torch.distributed.is_initialized()
    launched = group or _launched_world_size() > 1
    if not launched or torch.accelerator.is_available():
        return
    _deepspeed()
    from deepspeed import comm as deepspeed_comm

    if deepspeed_comm.is_initialized():
        return
    raise RuntimeError(
        "sequence parallelism on the CPU: DeepSpeed's communication is not set up, and Ulysses's registration (in "
        "accelerate's or the Trainer's prepare) asserts it (a bare AssertionError: `assert dist.is_initialized()`). "
        "Call deepspeed.init_distributed(dist_backend='gloo') first, before TrainingArguments or Accelerator "
        "(torch.distributed.init_process_group alone does not set it up; accelerate does it only on accelerators)"
    )


def _check_accelerate_processes(world_size: int) -> None:
    """accelerate (and so the Trainer) shards its loader over the processes it counts. On the CPU
    it counts one unless told it runs there, and every rank then gets the whole dataset: with
    Ulysses training every rank's batch in turn, each row would be trained once per rank."""
    if "accelerate.state" not in sys.modules:  # accelerate has counted nothing
        return
    if not present("accelerate.shared_state"):
        announce("accelerate.shared_state")
        return
    counted = (resolve("accelerate.shared_state") or {}).get("num_processes")
    if not isinstance(counted, int) or world_size <= 1 or counted == world_size:
        return
    raise ValueError(
        f"accelerate counts {counted} process(es) of the world's {world_size}: it would give every rank the whole "
        f"dataset, and Ulysses trains every rank's batch in turn, so each row would be trained {world_size // counted} "
        "times. On the CPU tell it so: TrainingArguments(..., use_cpu=True) for the Trainer, PartialState(cpu=True) "
        "before the Accelerator for accelerate"
    )


def _launched_world_size() -> int:
    """The world size torchrun (or another launcher) gave this process, 1 if none."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _check_model(model: object, sp_size: int) -> str:
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 2:
        raise ValueError(
            f"sp_size must be an int >= 2 (the ranks one sequence is split across; 1 is no sequence "
            f"parallelism: train without it), got {sp_size!r}"
        )
    config = _config_of(model)
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if not isinstance(heads, int):
        raise ValueError(f"{type(config).__name__} has no num_attention_heads: Ulysses splits attention by heads")
    valid = _valid_sizes(heads, kv_heads)
    if heads % sp_size:
        raise ValueError(
            f"sp_size={sp_size} does not divide num_attention_heads={heads}: Ulysses gives each rank "
            f"num_attention_heads / sp_size heads; valid sp_size for this model: {valid or 'none'}"
        )
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ValueError(
            f"sp_size={sp_size} and num_key_value_heads={kv_heads}: one must divide the other (Ulysses splits "
            f"the key/value heads, or repeats them when there are fewer than ranks); valid sp_size for this "
            f"model: {valid or 'none'}"
        )
    # A config not yet given to a model has none resolved: transformers' default is sdpa.
    resolve("transformers.attn_implementation")
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation not in ULYSSES_ATTENTION and not _HUB_KERNEL.match(str(implementation)):
        raise ValueError(
            f"the model's attention implementation is {implementation!r}, which Ulysses cannot wrap (eager "
            f"builds the whole (seq x seq) mask): load the model with attn_implementation='sdpa' (CPU or GPU) "
            f"or 'flash_attention_2', or call model.set_attn_implementation('sdpa'); valid: "
            f"{', '.join(ULYSSES_ATTENTION)} or a hub kernel such as 'kernels-community/flash-attn2'"
        )
    check_token_mixers(model, sp_size)
    return implementation


@dataclass
class Ulysses:
    """What `register_ulysses` set up: the SP group of this rank and how to feed and score it."""

    size: int
    rank: int
    group: object  # torch.distributed.ProcessGroup
    mpu: object  # deepspeed's parallel_state_sp: pass as deepspeed.initialize(..., mpu=ulysses.mpu)
    attn_implementation: str
    micro_batch_size: int
    pad_token_id: int = 0

    @property
    def device(self) -> torch.device:
        from deepspeed.accelerator import get_accelerator

        return torch.device(get_accelerator().current_device_name())

    def adapt(self, loader: Iterable[dict], allow_identical_batches: bool = False) -> Iterable[dict]:
        """`loader`'s batches, each split across the SP group: over `size` steps every rank takes
        its shard of rank 0's batch, then of rank 1's, and so on (DeepSpeed's
        `UlyssesSPDataLoaderAdapter`). Every batch needs `input_ids` and `labels` of shape
        (micro_batch_size, tokens); the loader must give exactly `micro_batch_size` rows each time.

        Every rank's loader must give batches of its own (a `DistributedSampler` over all the
        ranks): since each rank's batch is trained in turn by the whole group, ranks holding the
        same batches train every row once per rank. Ranks whose first `IDENTICAL_BATCHES_CHECKED`
        batches of a pass are identical (a checksum of input_ids and labels, compared in the
        collective each batch already takes) are refused on every rank; pass
        `allow_identical_batches=True` where that is meant (a benchmark feeding one batch)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        batch_size = getattr(loader, "batch_size", None)
        if batch_size is not None and batch_size != self.micro_batch_size:
            raise ValueError(
                f"the loader gives batches of {batch_size} rows and Ulysses was registered for micro_batch_size="
                f"{self.micro_batch_size}: register_ulysses(model, sp_size, micro_batch_size={batch_size})"
            )
        dataset = getattr(loader, "dataset", None)
        if batch_size and not getattr(loader, "drop_last", True) and _length(dataset) % batch_size:
            raise ValueError(
                f"the loader's last batch would have {_length(dataset) % batch_size} rows, not micro_batch_size="
                f"{batch_size}, and Ulysses's shapes are fixed at registration: DataLoader(..., drop_last=True)"
            )
        prepared = _PreparedBatches(loader, self, 0 if allow_identical_batches else IDENTICAL_BATCHES_CHECKED)
        adapter = UlyssesSPDataLoaderAdapter(
            prepared, sp_rank=self.rank, sp_group=self.group, sp_world_size=self.size, device=self.device
        )
        return _OnDevice(adapter, self.device)

    def tokens(self, batch: dict) -> torch.Tensor:
        """The SP group's count of labelled tokens in this micro-batch (an int tensor)."""
        labels = _shift_labels(batch)
        count = (labels != IGNORE_INDEX).sum().to(self.device)
        torch.distributed.all_reduce(count, group=self.group)
        return count

    def loss(self, model: nn.Module, batch: dict, num_items_in_batch: torch.Tensor | int | None = None):
        """`model`'s loss over the whole sequence of this micro-batch: see `sequence_parallel_loss`."""
        return sequence_parallel_loss(model, batch, group=self.group, num_items_in_batch=num_items_in_batch)


def _length(dataset) -> int:
    try:
        return len(dataset)
    except TypeError:
        return 0


def _shift_labels(batch: dict) -> torch.Tensor:
    labels = batch.get("shift_labels")
    if labels is None:
        raise ValueError(
            f"the batch has no shift_labels (keys: {sorted(batch)}): under Ulysses each rank's labels are its "
            "shard of the shifted labels; take batches from Ulysses.adapt(loader) (or DeepSpeed's "
            "UlyssesSPDataLoaderAdapter), which makes them"
        )
    return labels


def _sp_group():
    group = resolve("deepspeed.sequence_parallel_group")
    if group is None:
        raise RuntimeError(
            "no sequence-parallel group: call register_ulysses(model, sp_size) first (accelerate and the "
            "Trainer register Ulysses themselves, when prepared with ParallelismConfig(sp_backend='deepspeed'))"
        )
    return group


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(SUM) of the ranks' shares of the loss. Backward gives each rank the gradient of
    its own share, times the group's size where the gradients are then averaged over the ranks
    (`scale_for_average`), so that the reduction yields the whole sequence's gradient either way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, scale_for_average: bool) -> torch.Tensor:
        ctx.group, ctx.scale = group, scale_for_average
        total = tensor.clone()
        torch.distributed.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.scale:  # every rank backpropagates the same total: their sum is size x grad
            grad = grad.clone()
            torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None, None


def sums_over_sequence_parallel_ranks(model: object) -> bool:
    """Whether `model`'s wrapper sums the gradients of the SP ranks instead of averaging them over
    all ranks: a DeepSpeed engine with ZeRO stage 0, 1 or 2, or stage 3 with reduce_scatter off
    (DeepSpeed 0.19.8 divides by world_size / sp_size there, by world_size in ZeRO-3's
    reduce-scatter). DDP, FSDP and ZeRO-3's default average."""
    stage = getattr(model, "zero_optimization_stage", None)
    if not callable(stage):
        return False
    if stage() < 3:
        return True
    reduce_scatter = getattr(model, "zero_reduce_scatter", None)
    return callable(reduce_scatter) and not reduce_scatter()


def sequence_parallel_loss(
    model: nn.Module, batch: dict, group=None, num_items_in_batch: torch.Tensor | int | None = None
) -> torch.Tensor:
    """The loss one process would report on the whole sequence of this micro-batch, computed on
    this rank's shard: `model` (a transformers causal LM, or a DDP/FSDP/PEFT/DeepSpeed wrapper of
    one) runs on the shard with `labels` and `shift_labels` the shard's shifted labels and
    `num_items_in_batch` the group's count of labelled tokens, so each rank's loss is its share of
    the whole; the shares are summed over the group (`group`: DeepSpeed's SP group by default).

    Backward gives each rank `sp_size` times its share of the gradient, which the usual average
    over ranks (DDP, FSDP, ZeRO-3; in a loop without them, all-reduce and divide by the world
    size) turns into the gradient of the whole sequence; for a DeepSpeed engine that sums over
    the SP ranks instead (ZeRO 0-2, or ZeRO-3 with reduce_scatter off) each rank's own share.
    `num_items_in_batch`: the count to divide by when accumulating several micro-batches (the sum
    of `Ulysses.tokens` over them);
    by default this micro-batch's."""
    if "position_ids" not in batch:
        raise ValueError(
            f"the batch has no position_ids (keys: {sorted(batch)}): under Ulysses every forward needs them, "
            "each rank's shard of the whole sequence's positions (Ulysses.adapt adds them when the loader "
            "gives none)"
        )
    labels = _shift_labels(batch)
    group = group if group is not None else _sp_group()
    _check_training_mode(model)
    if num_items_in_batch is None:
        num_items_in_batch = (labels != IGNORE_INDEX).sum()
        torch.distributed.all_reduce(num_items_in_batch, group=group)
    inputs = {key: value for key, value in batch.items() if key not in ("labels", "shift_labels")}
    declare_shard(inputs)  # the batch is this rank's shard, whatever model runs it
    output = model(**inputs, labels=labels, shift_labels=labels, num_items_in_batch=num_items_in_batch)
    loss = output.loss if hasattr(output, "loss") else output["loss"]
    if loss is None:
        raise ValueError(f"{type(model).__name__} returned no loss for a batch with labels")
    return _SumOverGroup.apply(loss, group, not sums_over_sequence_parallel_ranks(model))


def _check_training_mode(model: nn.Module) -> None:
    """accelerate and the Trainer register Ulysses with `disable_in_eval=True`: a model in eval
    mode (as `from_pretrained` returns it) then attends only within each rank's shard, and its
    loss is not the sequence's. register_ulysses keeps Ulysses on in eval mode."""
    inner, seen = model, 0
    while isinstance(getattr(inner, "module", None), nn.Module) and seen < 8:  # DDP, a DeepSpeed engine
        inner, seen = inner.module, seen + 1
    get_base_model = getattr(type(inner), "get_base_model", None)
    if callable(get_base_model):  # PEFT
        inner = inner.get_base_model()
    if inner.training or registered_ulysses() is not None:
        return
    raise ValueError(
        f"{type(inner).__name__} is in eval mode (from_pretrained returns models so), and Ulysses registered by "
        "accelerate or the Trainer (disable_in_eval=True) then attends only within each rank's shard of the "
        "sequence: the loss would not be the whole sequence's. Call model.train() before training (checkpointing "
        "and offloading, too, run only in training mode)"
    )


class _PreparedBatches:
    """The user's loader, batch by batch ready for DeepSpeed's adapter (which gathers every
    rank's batch and shards it): position_ids where none were given, the length padded to a
    multiple of the SP size, and batches Ulysses would train on differently refused on every
    rank together, as are ranks holding the same batches at the start of each pass (`checked`
    batches; 0: not checked)."""

    def __init__(self, loader: Iterable[dict], ulysses: Ulysses, checked: int = IDENTICAL_BATCHES_CHECKED) -> None:
        self.loader = loader
        self.ulysses = ulysses
        self.checked = checked

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict]:
        checked = self.checked
        with contextlib.suppress(TypeError):  # a loader of fewer batches decides on all of them
            checked = min(checked, len(self.loader))
        identical: set[int] | None = None  # the ranks whose batches matched another's so far
        for index, batch in enumerate(self.loader):
            error = None
            try:
                batch = self.prepare(batch)
            except ValueError as refused:
                error = refused
            checking = index < checked
            fingerprints = self.agree(error, _fingerprint(batch) if checking and error is None else 0)
            if checking:
                identical = _sharing(fingerprints) & (identical if identical is not None else set(fingerprints))
                if not identical:
                    checked = 0
                elif index + 1 == checked:
                    raise _identical_batches_error(sorted(identical), checked)
            yield batch

    def agree(self, error: ValueError | None, fingerprint: int = 0) -> dict[int, int]:
        """Every rank raises if any rank's batch was refused (the others would otherwise wait
        in the adapter's all_gather for it). The same collective gathers each rank's
        fingerprint of its batch (0: none): {rank: fingerprint}."""
        flags = torch.zeros(self.ulysses.size, 2, dtype=torch.int64, device=self.ulysses.device)
        flags[self.ulysses.rank, 0] = error is not None
        flags[self.ulysses.rank, 1] = fingerprint
        torch.distributed.all_reduce(flags, group=self.ulysses.group)
        if error is not None:
            raise error
        refused, fingerprints = flags[:, 0].tolist(), flags[:, 1].tolist()
        if any(refused):
            bad = [rank for rank, flag in enumerate(refused) if flag]
            raise ValueError(f"sequence parallelism: SP rank(s) {bad} refused their batch (their error says why)")
        return {rank: value for rank, value in enumerate(fingerprints) if value}

    def prepare(self, batch: dict) -> dict:
        if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(f"Ulysses needs batches as dicts with input_ids and labels, got {keys}")
        batch = dict(batch)
        ids = batch["input_ids"]
        rows, length = ids.shape[0], ids.shape[1]
        if rows != self.ulysses.micro_batch_size:
            raise ValueError(
                f"a batch of {rows} rows, and Ulysses was registered for micro_batch_size="
                f"{self.ulysses.micro_batch_size}: its shapes are fixed at registration"
            )
        mask = batch.get("attention_mask")
        if torch.is_tensor(mask) and mask.dim() == 2 and bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError(
                "a batch whose attention_mask hides tokens before others (left padding): Ulysses drops the mask "
                "and would attend to them; pad on the right (tokenizer.padding_side = 'right') with labels -100"
            )
        positions = batch.get("position_ids")
        if positions is None:
            # What transformers uses on one process without position_ids.
            positions = torch.arange(length, device=ids.device).repeat(rows, 1)
        elif self.ulysses.attn_implementation not in _PACKING_ATTENTION:
            restart = positions[:, 1:] != positions[:, :-1] + 1
            if bool(restart.any()):
                row, token = (int(i) for i in restart.nonzero()[0])
                raise ValueError(
                    f"position_ids restart inside row {row} at token {token + 1} (packed documents): Ulysses with "
                    f"{self.ulysses.attn_implementation!r} attends across them, unlike one process; use "
                    "attn_implementation='flash_attention_2', or one document per row"
                )
        batch["position_ids"] = positions
        pad = -length % self.ulysses.size
        if pad:
            batch = {key: _pad(key, value, length, pad, self.ulysses.pad_token_id) for key, value in batch.items()}
        return batch


def _fingerprint(batch: dict) -> int:
    """A checksum of the batch's input_ids and labels, shapes included: a nonzero int64."""
    digest = hashlib.blake2b(digest_size=8)
    for key in ("input_ids", "labels"):
        value = batch.get(key)
        if torch.is_tensor(value):
            value = value.detach().contiguous().cpu()
            digest.update(repr((key, tuple(value.shape), str(value.dtype))).encode())
            digest.update(value.view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True) or 1


def _sharing(fingerprints: dict[int, int]) -> set[int]:
    """The ranks whose fingerprint another rank has too."""
    counts: dict[int, int] = {}
    for value in fingerprints.values():
        counts[value] = counts.get(value, 0) + 1
    return {rank for rank, value in fingerprints.items() if counts[value] > 1}


def _identical_batches_error(ranks: list[int], batches: int) -> ValueError:
    return ValueError(
        f"sequence parallelism: SP ranks {ranks} hold the same batches (the first {batches} of this pass were "
        "identical on them), and Ulysses trains every rank's batch in turn across the group: each row would be "
        f"trained {len(ranks)} times. Give every rank batches of its own: DataLoader(dataset, batch_size=..., "
        "sampler=DistributedSampler(dataset, drop_last=True), drop_last=True), with the sampler over all the ranks "
        "of the world (its defaults), not only the data-parallel ones: the ranks of one SP group need different "
        "batches too. If the ranks are meant to train the same batches (a benchmark), "
        "adapt(loader, allow_identical_batches=True)"
    )


def _pad(key: str, value, length: int, pad: int, pad_token_id: int):
    """`value` padded at the end of the sequence by `pad` tokens that change nothing: causal
    attention never lets an earlier token see them, and their labels are ignored."""
    if not torch.is_tensor(value) or value.dim() < 2 or value.shape[1] != length:
        return value
    if key == "position_ids":
        return torch.cat([value, value[:, -1:] + torch.arange(1, pad + 1, device=value.device)], dim=1)
    fill = {"labels": IGNORE_INDEX, "input_ids": pad_token_id}.get(key, 0)
    return nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, pad), value=fill)


class _OnDevice:
    """DeepSpeed's adapter, its batches moved to the device and made contiguous (its shards are
    views of the gathered batch, and transformers' loss `view`s shift_labels)."""

    def __init__(self, adapter, device: torch.device) -> None:
        self.adapter = adapter
        self.device = device

    def __len__(self) -> int:
        return len(self.adapter)

    def __iter__(self) -> Iterator[dict]:
        for batch in self.adapter:
            batch = {
                key: value.to(self.device).contiguous() if torch.is_tensor(value) else value
                for key, value in batch.items()
            }
            arm_shard(batch)
            yield batch
        disarm_shard()  # the pass is over: no later forward is a shard of it


def register_ulysses(model: nn.Module, sp_size: int, micro_batch_size: int = 1) -> Ulysses:
    """Check `model` and the process group for Ulysses (`check_sequence_parallel`), then register
    it with transformers for `model`'s attention implementation: from here on, in this process,
    every model using that implementation runs it across the SP group. Call it on every rank,
    after `torch.distributed.init_process_group` (or `deepspeed.init_distributed`), before wrapping
    the model. Registering again replaces the earlier registration.

    Only a shard goes through Ulysses' exchange: a forward fed the batch `Ulysses.adapt` yielded
    last on this rank, or the batch `sequence_parallel_loss` is given. Every other forward (generate,
    evaluation, TRL's trainers: a rank's own rows, whole) attends locally with its own mask, as one
    process does (docs/sequence_parallel.md, "What goes through the exchange").

    Ulysses calls transformers' attention function as it is at each call, not as it was at
    registration: sequence tiling enabled afterwards still tiles the heads inside it."""
    deepspeed = _deepspeed()
    _check_model(model, sp_size)
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1 (rows per batch), got {micro_batch_size!r}")
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(
            "sequence parallelism needs the process group: launch with torchrun and call "
            "torch.distributed.init_process_group() (or deepspeed.init_distributed()) before register_ulysses"
        )
    from deepspeed import comm as deepspeed_comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    if not deepspeed_comm.is_initialized():  # DeepSpeed's view of the process group torch already has
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    implementation = check_sequence_parallel(model, sp_size)
    unregister_ulysses()

    if resolve("deepspeed.sequence_parallel_group") is not None:
        raise RuntimeError(
            "Ulysses is already registered in this process, not by register_ulysses (accelerate's prepare or the "
            "Trainer with ParallelismConfig(sp_backend='deepspeed') do it themselves): use the group they made, "
            "e.g. sequence_parallel_loss(model, batch)"
        )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = _local_mapping(ALL_ATTENTION_FUNCTIONS).get(implementation, _ABSENT)
    # DeepSpeed wraps what ALL_ATTENTION_FUNCTIONS holds when it registers; give it a function that
    # looks the implementation up at each call instead (hf_offload's head tiling may wrap it later).
    ALL_ATTENTION_FUNCTIONS[implementation] = _attention_as_registered(implementation, local)
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=_config_holder(model),
            core_attn_implementation=implementation,
            sequence_parallel_size=sp_size,
            micro_batch_size=micro_batch_size,
            seq_length_is_variable=True,
        )
    except BaseException:
        _restore_local(ALL_ATTENTION_FUNCTIONS, implementation, local)
        raise
    config = _config_of(model)
    ulysses = Ulysses(
        size=mpu.get_sequence_parallel_world_size(),
        rank=mpu.get_sequence_parallel_rank(),
        group=mpu.get_sequence_parallel_group(),
        mpu=mpu,
        attn_implementation=implementation,
        micro_batch_size=micro_batch_size,
        pad_token_id=_pad_token_id(config),
    )
    _REGISTERED.update(implementation=implementation, local=local, ulysses=ulysses)
    _REGISTERED["hooks"] = _gate_exchange(model, implementation, local)
    return ulysses


# DeepSpeed's Ulysses attention modules whose forward runs query heads a chunk at a time where the
# calling attention is tiled over heads (`adopt_ulysses`), each with the registered function it
# was found through.
_ADOPTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def adopt_ulysses(implementation: str) -> None:
    """Where DeepSpeed's Ulysses is registered for `implementation` (by `register_ulysses`, or by
    accelerate's or the Trainer's `prepare` with `ParallelismConfig(sp_backend="deepspeed")`), its
    attention runs the rank's query heads a chunk at a time through the exchange for calls whose
    attention module is tiled over heads (`hf_offload.tiling.ulysses_heads`), and as DeepSpeed
    runs it for every other call. Called by tiling before each call of a tiled attention block,
    so that a registration made after tiling was enabled is found too; cheap once done."""
    if ULYSSES_MODULE not in sys.modules:
        return
    wrapper = resolve("transformers.local_attention_functions").get(implementation)
    wrapper = getattr(wrapper, "_hf_offload_exchange", wrapper)  # register_ulysses's gate: DeepSpeed's behind it
    if wrapper is None or getattr(wrapper, "_hf_offload_adopted", False):
        return
    wrapper._hf_offload_adopted = True  # looked at once per registration
    if getattr(wrapper, "__module__", None) != ULYSSES_MODULE:
        return  # not DeepSpeed's registration (someone's own override): left as it is
    if not present("deepspeed.ulysses_attention"):
        announce("deepspeed.ulysses_attention")
        return
    instance = ulysses_of(wrapper, resolve("deepspeed.ulysses_attention"))
    if instance is None or not all(hasattr(instance, name) for name in _ULYSSES_ATTRIBUTES):
        # DeepSpeed's wrapper holding its attention some other way, or a release that renamed what the
        # chunked forward reads: DeepSpeed's own forward runs.
        announce("deepspeed.ulysses_attention")
        return
    instance.forward = types.MethodType(_forward_in_head_chunks, instance)
    _ADOPTED[instance] = weakref.ref(wrapper)


# What `_forward_in_head_chunks` reads of DeepSpeed's UlyssesSPAttentionHF instance.
_ULYSSES_ATTRIBUTES = ("world_size", "process_group", "attn")


def release_ulysses() -> None:
    """Put DeepSpeed's own forward back on every Ulysses attention `adopt_ulysses` changed (tiling
    disabled on every model of the process)."""
    for instance, wrapper_ref in list(_ADOPTED.items()):
        instance.__dict__.pop("forward", None)
        wrapper = wrapper_ref()
        if wrapper is not None:
            wrapper.__dict__.pop("_hf_offload_adopted", None)
    _ADOPTED.clear()


def _forward_in_head_chunks(self, module: nn.Module, query, key, value, attention_mask, *args, **kwargs):
    """`UlyssesSPAttentionHF.forward`, with the rank's query heads a chunk at a time through the
    exchange where `chunk_plan` says so (the module's attention tiled over heads, in training, a
    sequence longer than tiling's slice); else DeepSpeed's own forward. DeepSpeed's wrapper has
    dropped the attention mask already (but flex attention's block mask, which runs as DeepSpeed
    runs it)."""
    from hf_offload.tiling.ulysses_heads import attention_in_head_chunks, chunk_plan

    _check_not_context_parallel()  # one call of each would shard the shard
    _check_no_kv_cache(self, module, query, key)
    plan = None
    if not args and attention_mask is None:
        plan = chunk_plan(module, query, key, self.world_size, kwargs)
    if plan is None:
        return type(self).forward(self, module, query, key, value, attention_mask, *args, **kwargs)
    positions = kwargs.get("position_ids")
    if positions is None:
        raise ValueError(
            "Ulysses needs position_ids in every forward, each rank's shard of the whole sequence's positions "
            "(Ulysses.adapt and DeepSpeed's UlyssesSPDataLoaderAdapter add them)"
        )
    # As DeepSpeed does: the kernels see the whole sequence's positions (FlashAttention reads packing from them).
    gathered = [torch.empty_like(positions) for _ in range(self.world_size)]
    torch.distributed.all_gather(gathered, positions.contiguous(), group=self.process_group)
    kwargs["position_ids"] = torch.cat(gathered, dim=1)
    return attention_in_head_chunks(
        module, query, key, value, None, plan=plan, exchange=deepspeed_exchange(self.process_group), core=self.attn,
        **kwargs,
    )


def _check_no_kv_cache(ulysses, module: nn.Module, query: torch.Tensor, key: torch.Tensor) -> None:
    """A call whose keys are longer than its queries reads a KV cache (generate's decoding): it is a
    rank's own rows, never a shard, and DeepSpeed's exchange would stop on its bare shape assertion.
    Under accelerate's or the Trainer's registration (register_ulysses never lets it through), refuse
    by name where DeepSpeed would run its exchange: in training mode, or without disable_in_eval."""
    if key.shape[-2] == query.shape[-2] or (not module.training and getattr(ulysses, "disable_in_eval", False)):
        return
    raise ValueError(
        f"a forward with a KV cache ({query.shape[-2]} new tokens against {key.shape[-2]} keys: generate's "
        "decoding) reached DeepSpeed's Ulysses exchange, which would treat the ranks' different rows as one sequence "
        "split across them. With accelerate's or the Trainer's Ulysses (ParallelismConfig(sp_backend='deepspeed')), "
        "call model.eval() before generate (they register Ulysses with disable_in_eval=True); with register_ulysses, "
        "generate attends locally on its own"
    )


def deepspeed_exchange(group):
    """DeepSpeed's all-to-all over dimension 0 on `group` (its op with its own gradient, the same
    exchange in reverse), as Ulysses's attention calls it: looked up at each call, where DeepSpeed's
    own forward looks it up too."""
    resolve("deepspeed.all_to_all")

    def exchange(buffer: torch.Tensor) -> torch.Tensor:
        return resolve("deepspeed.all_to_all")(group, buffer)

    return exchange


def _local_mapping(functions) -> dict:
    """transformers' ALL_ATTENTION_FUNCTIONS keeps a mapping of its own in front of the class-wide
    one (`AttentionInterface.register`): item assignment writes there, and shadows the class-wide
    entry from then on."""
    return resolve("transformers.local_attention_functions")


def _restore_local(functions, implementation: str, local) -> None:
    """Put the instance mapping's entry back as it was: the value it held, or none at all (so that
    the class-wide entry shows through again)."""
    if local is not _ABSENT:
        functions[implementation] = local
    else:
        _local_mapping(functions).pop(implementation, None)


def _attention_as_registered(implementation: str, local):
    """The attention function `implementation` names, looked up at each call: the instance
    mapping's entry that was there before Ulysses, else the class-wide one (where hf_offload's
    head tiling, or anyone's `AttentionInterface.register`, puts theirs)."""
    registry = resolve("transformers.attention_registry")

    def attention(*args, **kwargs):
        function = local if local is not _ABSENT else registry[implementation]
        return function(*args, **kwargs)

    attention.__name__ = f"{implementation}_as_registered"
    return attention


def _config_holder(model: object):
    """What DeepSpeed's registration reads `.config` from."""

    @dataclass
    class Holder:
        config: object

    return Holder(_config_of(model))


def _pad_token_id(config) -> int:
    pad = getattr(config.get_text_config(), "pad_token_id", None)
    return pad if isinstance(pad, int) and pad >= 0 else 0


def registered_ulysses() -> Ulysses | None:
    """The registration in force in this process (from `register_ulysses`), if any."""
    return _REGISTERED.get("ulysses")


def unregister_ulysses() -> None:
    """Put back the attention function `register_ulysses` replaced, as it was (an entry of
    ALL_ATTENTION_FUNCTIONS's own mapping only if there was one: none left behind to shadow later
    registrations), and forget its SP group (the process group itself stays). No-op if nothing is
    registered."""
    if not _REGISTERED:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _restore_local(ALL_ATTENTION_FUNCTIONS, _REGISTERED["implementation"], _REGISTERED["local"])
    for handle in _REGISTERED.get("hooks", ()):
        handle.remove()
    disarm_shard()
    set_forward_rule(None)
    resolve("deepspeed.release_groups")()
    _REGISTERED.clear()


# --- Which forwards run through the exchange (register_ulysses) ----------------------------------
# Ulysses' exchange treats the SP ranks' inputs as the pieces of one sequence. Under register_ulysses
# it runs only for a forward fed the batch `Ulysses.adapt` yielded last on this rank (its input_ids
# and position_ids, by value: moved to another device or copied, still the batch), without a KV
# cache, or the batch `sequence_parallel_loss` is given; every other forward (generate, evaluation
# on a rank's own rows, TRL's trainers, which give each rank rows of its own) attends locally, with
# its own attention mask, as one process would on those rows. The decision is made once per forward,
# at the model's backbone, and kept with the forward's position_ids tensor, so that a checkpoint's
# recompute in backward makes the forward's decision again.
_SHARD: dict = {}  # "input_ids", "position_ids": the batch adapt yielded last on this rank
# The decision of the forward whose backbone was entered last, until its first attention call:
# (decision, the position_ids it was given or None).
_PENDING: list = []
# position_ids' storage -> (a weak reference to the tensor, the decision of the forward it fed)
_DECIDED: dict = {}


def arm_shard(batch: dict) -> None:
    """`batch` (one `Ulysses.adapt` yielded) is this rank's shard of a sequence split across the group."""
    _SHARD.clear()
    _SHARD.update(input_ids=batch.get("input_ids"), position_ids=batch.get("position_ids"))


def disarm_shard() -> None:
    _SHARD.clear()
    _PENDING.clear()


def declare_shard(inputs: dict) -> None:
    """The forward about to run on `inputs` is a shard (sequence_parallel_loss's contract), whatever
    model runs it; arms it for the model's backbone too."""
    if not _REGISTERED:
        return
    arm_shard(inputs)
    _PENDING[:] = [(True, inputs.get("position_ids"))]


def _is_shard(input_ids, position_ids, cache) -> bool:
    """Whether a forward given these inputs is the shard armed on this rank."""
    armed_ids, armed_positions = _SHARD.get("input_ids"), _SHARD.get("position_ids")
    if cache is not None or not torch.is_tensor(input_ids) or not torch.is_tensor(position_ids):
        return False
    if not torch.is_tensor(armed_ids) or not torch.is_tensor(armed_positions):
        return False
    if input_ids.shape != armed_ids.shape or position_ids.shape != armed_positions.shape:
        return False
    return bool(
        torch.equal(input_ids, armed_ids.to(input_ids.device))
        and torch.equal(position_ids, armed_positions.to(position_ids.device))
    )


def _backbone_of(model: object) -> nn.Module | None:
    """The module every forward of `model` enters with its input_ids (the decoder stack: generate, the
    Trainer and TRL's fused head, which calls it directly), through DDP, engines and PEFT."""
    seen = 0
    while isinstance(getattr(model, "module", None), nn.Module) and seen < 8:
        model, seen = model.module, seen + 1
    if callable(getattr(type(model), "get_base_model", None)):  # PEFT
        model = model.get_base_model()
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(Exception):
            decoder = get_decoder()
            if isinstance(decoder, nn.Module):
                return decoder
    return model if isinstance(model, nn.Module) else None


def _mark_forward(signature, module, args, kwargs) -> None:
    """The backbone's forward pre-hook: decide whether this forward is the armed shard."""
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = kwargs
    positions = bound.get("position_ids")
    if _PENDING and _PENDING[0][0] and _PENDING[0][1] is positions:
        return  # sequence_parallel_loss declared this forward a shard
    decision = _is_shard(bound.get("input_ids"), positions, bound.get("past_key_values"))
    _PENDING[:] = [(decision, positions if torch.is_tensor(positions) else None)]


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def _decided(positions) -> bool | None:
    if not torch.is_tensor(positions):
        return None
    entry = _DECIDED.get(_storage_key(positions))
    if entry is None or entry[0]() is None:
        return None
    return entry[1]


def _decide(positions, decision: bool) -> None:
    if not torch.is_tensor(positions):
        return
    for key in [key for key, (ref, _) in _DECIDED.items() if ref() is None]:
        del _DECIDED[key]
    _DECIDED[_storage_key(positions)] = (weakref.ref(positions), decision)


def through_exchange(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> bool:
    """Whether this attention call runs through Ulysses' exchange: the forward's decision, taken at
    its first attention call from what its backbone was given, and found again by its position_ids
    for the next layers and for a checkpoint's recompute."""
    positions = kwargs.get("position_ids")
    decision = _forward_decision(positions, take=True)
    if decision and (not torch.is_tensor(positions) or key.shape[-2] != query.shape[-2]):
        raise ValueError(
            "Ulysses: a forward fed the shard Ulysses.adapt yielded reached attention without its position_ids, or "
            f"with keys of another length than its queries ({key.shape[-2]} against {query.shape[-2]}: a KV cache): "
            "a shard runs whole, with the position_ids adapt gives"
        )
    return decision


def _forward_decision(positions, take: bool = False) -> bool:
    """Whether the forward that fed these position_ids runs through the exchange: a new forward's
    decision (its backbone's, pending), kept with its position_ids; a recompute's, found by them.
    `take`: the pending decision is used up (the first attention call); without it (the Gated
    DeltaNets of a hybrid, which run before its first softmax attention: `linear_attention.
    set_forward_rule`) the attention calls still find it."""
    pending = _PENDING[0] if _PENDING else None
    known = _decided(positions)
    if pending is not None and (pending[1] is positions or known is None):  # a new forward, not a recompute
        if take:
            _PENDING.clear()
        _decide(positions, pending[0])
        return pending[0]
    return bool(known)


def _gate_exchange(model: object, implementation: str, local) -> list:
    """Put the gate in front of DeepSpeed's registered function: a shard goes through the exchange,
    every other forward to the attention Ulysses wraps, with its mask (DeepSpeed's function drops it)
    and the module's grouped-query ratio as the call's own heads give it (DeepSpeed's forward sets
    `num_key_value_groups` for the exchanged heads where key/value heads are repeated). Returns the
    hook handles to remove."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_offload.tiling.attention import key_value_groups

    exchange = _local_mapping(ALL_ATTENTION_FUNCTIONS).get(implementation)
    core = _attention_as_registered(implementation, local)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if through_exchange(query, key, kwargs):
            return exchange(module, query, key, value, attention_mask, *args, **kwargs)
        with key_value_groups(module, max(query.shape[1] // max(key.shape[1], 1), 1)):
            return core(module, query, key, value, attention_mask, *args, **kwargs)

    attention._hf_offload_exchange = exchange
    attention.__name__ = f"{implementation}_ulysses_gate"
    ALL_ATTENTION_FUNCTIONS[implementation] = attention
    disarm_shard()
    _DECIDED.clear()
    backbone = _backbone_of(model)
    if backbone is None:
        return []
    import functools
    import inspect

    try:
        signature = inspect.signature(backbone.forward)
    except (TypeError, ValueError):
        signature = inspect.Signature()
    hook = functools.partial(_mark_forward, signature)
    set_forward_rule(_forward_decision)
    return [backbone.register_forward_pre_hook(hook, with_kwargs=True)]


__all__ = [
    "ULYSSES_ATTENTION",
    "Ulysses",
    "adopt_ulysses",
    "check_sequence_parallel",
    "register_ulysses",
    "registered_ulysses",
    "sequence_parallel_loss",
    "sums_over_sequence_parallel_ranks",
    "torch_context_parallel_active",
    "unregister_ulysses",
]
