"""GRPO's step split across the ranks of an SP group (DeepSpeed's Ulysses), exactly.

TRL 1.16's `GRPOConfig` refuses `sp_size > 1`. `UlyssesGRPOTrainer` is TRL's `GRPOTrainer` with
the changes that make its step, split across a sequence-parallel group registered by
`register_ulysses`, the step one process would take on the same completions:

- The ranks of one SP group hold the same prompts and completions: the training sampler gives
  them the same rows (the SP group is one data-parallel process), group rank 0 generates and
  broadcasts its completions to the group (generation attends locally: no exchange). TRL's
  collectives (rewards, advantages, DAPO's token count, metrics) see one process per group.
- Every scoring forward (the policy's loss forward, the old and the reference log-probs) feeds
  each rank only its slice of each sequence, through Ulysses' exchange, with the whole sequence's
  `position_ids` and labels shifted on the whole sequence (each row's left padding moved to its
  end, each token keeping the position it has on one process). The per-token log-probs (and
  entropies) are gathered over the group before TRL's loss and its normalisation, whichever
  `loss_type`.
- Each rank's backward carries its own slice's share of the gradient, scaled by the group's size
  where the gradients are then averaged over all ranks (DDP): the group's gradients are summed.

Before each scoring the group checks that its ranks hold the same sequences, and refuses
otherwise (each rank would score another's). Options that would not be exact here are refused by
name when the trainer is built. TRL is imported only when the class is first used.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

from .sequence_parallel import (
    IGNORE_INDEX,
    declare_shard,
    disarm_shard,
    registered_ulysses,
    sums_over_sequence_parallel_ranks,
)
from .upstream import resolve

TRAINER_NAME = "UlyssesGRPOTrainer"
# TRL's private names the trainer overrides or swaps (integrations/upstream.py's inventory).
RELIED_ON = (
    "trl.grpo_train_sampler",
    "trl.grpo_repeat_sampler",
    "trl.grpo_prepare_inputs",
    "trl.grpo_shuffle",
    "trl.grpo_generate_and_score",
    "trl.grpo_compute_loss",
    "trl.grpo_gather",
    "trl.grpo_gather_object",
    "trl.grpo_generate_single_turn",
    "trl.grpo_per_token_logps",
)


def _trl():
    try:
        from trl import GRPOTrainer
        from trl.trainer import grpo_trainer
    except ImportError as error:
        raise ImportError(f"{TRAINER_NAME} subclasses TRL's GRPOTrainer, and trl is not installed ({error})") from error
    for entry_id in RELIED_ON:  # UpstreamChanged, naming what TRL renamed, before a class that would skip it
        resolve(entry_id)
    return GRPOTrainer, grpo_trainer


# --- TRL's collectives, seen as one process per SP group -----------------------------------------


class _GroupLayout:
    """The world as SP groups of consecutive ranks (DeepSpeed's `parallel_state_sp` makes them so)."""

    def __init__(self, ulysses) -> None:
        self.ulysses = ulysses
        self.sp = ulysses.size
        self.world = torch.distributed.get_world_size()
        self.rank = torch.distributed.get_rank()
        ranks = list(torch.distributed.get_process_group_ranks(ulysses.group))
        first = self.rank - self.rank % self.sp
        if ranks != list(range(first, first + self.sp)):
            raise ValueError(
                f"{TRAINER_NAME}: the SP group of rank {self.rank} is {ranks}, not consecutive ranks "
                f"{list(range(first, first + self.sp))}: TRL's data sharding is read as one process per group of "
                "consecutive ranks (as DeepSpeed's parallel_state_sp makes them; register_ulysses does)"
            )
        self.first = first  # the group's rank 0, in the world

    @property
    def data_parallel_rank(self) -> int:
        return self.rank // self.sp

    @property
    def data_parallel_size(self) -> int:
        return self.world // self.sp

    def one_per_group(self, gathered: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """`gathered` (every rank's `local`, concatenated along dim 0) with one copy per group."""
        if local.dim() == 0:
            return gathered.reshape(self.world)[:: self.sp].contiguous()
        per_rank = gathered.reshape(self.world, *local.shape)[:: self.sp]
        return per_rank.reshape(-1, *local.shape[1:]).contiguous()


class _DataParallelView:
    """The trainer's accelerator, its collectives over one rank per SP group: TRL on W ranks in
    groups of sp computes what it computes on W / sp processes (the ranks of a group hold the
    same rows)."""

    def __init__(self, accelerator, layout: _GroupLayout) -> None:
        self._accelerator = accelerator
        self._layout = layout

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @property
    def process_index(self) -> int:
        return self._layout.data_parallel_rank

    @property
    def num_processes(self) -> int:
        return self._layout.data_parallel_size

    def gather(self, tensor):
        return _gather_one_per_group(self._layout, self._accelerator.gather, tensor)

    def gather_for_metrics(self, tensor, *args, **kwargs):
        return self.gather(tensor)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        stacked = self.gather(tensor.unsqueeze(0))
        if reduction == "sum":
            total = stacked.sum(dim=0)
        elif reduction == "mean":
            total = stacked.mean(dim=0)
        else:
            raise ValueError(f"{TRAINER_NAME}: reduction {reduction!r} (valid: 'sum', 'mean')")
        return total * scale if scale != 1.0 else total


def _gather_one_per_group(layout: _GroupLayout, gather, value):
    if isinstance(value, dict):
        return {key: _gather_one_per_group(layout, gather, item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_gather_one_per_group(layout, gather, item) for item in value)
    if not torch.is_tensor(value):
        raise TypeError(f"{TRAINER_NAME}: gathering a {type(value).__name__} across SP groups (tensors only)")
    return layout.one_per_group(gather(value), value)


def _gather_object_one_per_group(layout: _GroupLayout):
    def gather_object(values):
        gathered = [None] * layout.world
        torch.distributed.all_gather_object(gathered, list(values))
        return [item for rank in range(0, layout.world, layout.sp) for item in gathered[rank]]

    return gather_object


# --- The sampler: the ranks of one SP group get the same rows -----------------------------------


class _GroupRepeatSampler(torch.utils.data.Sampler):
    """TRL's `RepeatSampler` for one process per SP group, each of its batches given to the
    group's `sp` ranks in turn: accelerate then hands the world's ranks batches round robin, so
    every rank of a group gets the same batch."""

    def __init__(self, inner, batch: int, data_parallel_size: int, sp: int) -> None:
        self.inner, self.batch, self.data_parallel_size, self.sp = inner, batch, data_parallel_size, sp

    def __len__(self) -> int:
        return len(self.inner) * self.sp

    def __iter__(self) -> Iterator[int]:
        block: list[int] = []
        for index in self.inner:
            block.append(index)
            if len(block) == self.batch * self.data_parallel_size:
                for dp in range(self.data_parallel_size):
                    for _ in range(self.sp):
                        yield from block[dp * self.batch : (dp + 1) * self.batch]
                block = []


# --- Scoring: each rank its slice of every sequence ---------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """all_gather of the ranks' slices along the sequence (dim 1). Every rank computes the same
    loss from the gathered tensor; backward keeps the rank's own slice of the gradient, times the
    group's size where the gradients are then averaged over the ranks (`scale`)."""

    @staticmethod
    def forward(ctx, piece: torch.Tensor, group, rank: int, size: int, scale: float) -> torch.Tensor:
        ctx.rank, ctx.width, ctx.scale = rank, piece.shape[1], scale
        pieces = [torch.empty_like(piece) for _ in range(size)]
        torch.distributed.all_gather(pieces, piece.contiguous(), group=group)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        own = grad[:, ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width]
        return own * ctx.scale if ctx.scale != 1.0 else own.clone(), None, None, None, None


def _shard_rank(ulysses) -> int:
    """Which slice of each sequence this rank feeds (its SP rank)."""
    return ulysses.rank


def _whole_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, size: int, pad: int):
    """The rows as Ulysses scores them: each row's left padding moved to its end, every token at the
    position it has on one process (TRL passes no position_ids: transformers numbers the padded row
    0, 1, ...), the completion's labels shifted on the whole row, the length padded to a multiple of
    `size`. Returns (ids, positions, shift_labels, index of each completion token's log-prob)."""
    rows, length = input_ids.shape
    prompt = length - logits_to_keep
    mask = attention_mask.to(torch.long)
    lead = (mask.cumsum(dim=1) == 0).sum(dim=1)  # left padding per row
    if bool((lead >= prompt).any()):
        raise ValueError(f"{TRAINER_NAME}: a row whose prompt is all padding (empty prompt): nothing to score from")
    source = (torch.arange(length, device=input_ids.device) + lead[:, None]) % length
    rolled_mask = mask.gather(1, source)
    if bool((rolled_mask[:, 1:] > rolled_mask[:, :-1]).any()):
        raise ValueError(
            f"{TRAINER_NAME}: an attention_mask with a hole inside a row (masked tokens between unmasked ones): "
            "Ulysses attends without the mask, so only left and right padding can be scored exactly"
        )
    ids = input_ids.gather(1, source)
    positions = torch.arange(length, device=input_ids.device)[None, :] + lead[:, None]
    labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, :prompt] = IGNORE_INDEX
    labels = labels.gather(1, source)
    shift_labels = torch.full_like(labels, IGNORE_INDEX)
    shift_labels[:, :-1] = labels[:, 1:]
    extra = -length % size
    if extra:
        ids = torch.nn.functional.pad(ids, (0, extra), value=pad)
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1, device=ids.device)], dim=1)
        shift_labels = torch.nn.functional.pad(shift_labels, (0, extra), value=IGNORE_INDEX)
    # Completion token k sits at prompt + k - lead in the moved row; its log-prob is scored one earlier.
    index = (prompt - 1 - lead)[:, None] + torch.arange(logits_to_keep, device=input_ids.device)[None, :]
    return ids, positions, shift_labels, index


def _fingerprint(*tensors: torch.Tensor) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for tensor in tensors:
        value = tensor.detach().contiguous().cpu()
        digest.update(repr((tuple(value.shape), str(value.dtype))).encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True) or 1


def _check_same_sequences(ulysses, device, input_ids, attention_mask, logits_to_keep: int) -> None:
    """Refuse on every rank of the group if its ranks do not hold the same sequences."""
    mine = _fingerprint(input_ids, attention_mask, torch.tensor([logits_to_keep]))
    prints = torch.zeros(ulysses.size, dtype=torch.int64, device=device)
    prints[ulysses.rank] = mine
    torch.distributed.all_reduce(prints, group=ulysses.group)
    values = prints.tolist()
    if len(set(values)) > 1:
        differing = [rank for rank, value in enumerate(values) if value != values[0]]
        raise ValueError(
            f"{TRAINER_NAME}: the ranks of the SP group do not hold the same sequences (SP rank(s) {differing} "
            "differ from SP rank 0): each would score slices of another rank's completions. The group's ranks must "
            f"get the same prompts and completions, as {TRAINER_NAME}'s sampler and generation give them; inputs "
            "prepared elsewhere must be the same on every rank of a group"
        )


# --- The trainer ----------------------------------------------------------------------------------


def _refusals(trainer, args) -> list[str]:
    """What this trainer does not run exactly (or has not been held running), by name."""
    refused = []
    if getattr(trainer, "use_vllm", False):
        refused.append("use_vllm=True (vLLM generates for every rank; the group's ranks need the same completions)")
    if getattr(trainer, "use_transformers_continuous_batching", False):
        refused.append("use_transformers_continuous_batching=True (not held with Ulysses)")
    if getattr(trainer, "rollout_func", None) is not None:
        refused.append("rollout_func (a rollout per rank: the group's ranks need the same completions)")
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None) is not None:
        refused.append("tools / environment_factory (multi-turn rollouts run per rank; not held with Ulysses)")
    if getattr(trainer, "aux_loss_enabled", False):
        refused.append("a router auxiliary loss (MoE output_router_logits: the load-balancing loss of a slice)")
    if getattr(args, "use_liger_kernel", False) or getattr(args, "use_liger_loss", False):
        refused.append("use_liger_kernel / use_liger_loss (Liger's GRPO loss scores whole sequences itself)")
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        refused.append(
            "DeepSpeed or FSDP (held with DDP only: group rank 0 generates alone, which needs unsharded weights)"
        )
    strategy = getattr(args, "eval_strategy", "no")
    if getattr(trainer, "eval_dataset", None) is not None or getattr(strategy, "value", strategy) != "no":
        refused.append("evaluation (eval_dataset / eval_strategy: its sampler gives each rank rows of its own)")
    if getattr(trainer, "_is_vlm", False):
        refused.append("a vision-language model (images are not split across the group)")
    return refused


def _build_class():
    GRPOTrainer, grpo_module = _trl()

    class UlyssesGRPOTrainer(GRPOTrainer):
        """TRL's `GRPOTrainer`, its step split across the SP group `register_ulysses` made: call
        `register_ulysses(model, sp_size, micro_batch_size=args.per_device_train_batch_size)` on
        every rank first. Each SP group acts as one data-parallel process: it samples, generates
        and scores its rows once, each rank holding a slice of every sequence; loss, per-token
        log-probs and gradients are those of TRL on `world_size / sp_size` processes."""

        def __init__(self, *args, **kwargs) -> None:
            ulysses = registered_ulysses()
            if ulysses is None:
                raise RuntimeError(
                    f"{TRAINER_NAME} splits GRPO's sequences across the SP group register_ulysses makes: call "
                    "register_ulysses(model, sp_size, micro_batch_size=per_device_train_batch_size) on every rank "
                    "before building the trainer"
                )
            self._ulysses = ulysses
            self._layout = _GroupLayout(ulysses)
            super().__init__(*args, **kwargs)
            refused = _refusals(self, self.args)
            if refused:
                raise ValueError(f"{TRAINER_NAME} does not run these under Ulysses: " + "; ".join(refused))
            rows = self.args.per_device_train_batch_size
            if ulysses.micro_batch_size != rows:
                raise ValueError(
                    f"{TRAINER_NAME}: Ulysses was registered for micro_batch_size={ulysses.micro_batch_size} and GRPO "
                    f"scores per_device_train_batch_size={rows} rows at a time: register_ulysses(model, "
                    f"{ulysses.size}, micro_batch_size={rows})"
                )
            generation_batch = self.args.generation_batch_size // self._layout.sp
            if generation_batch % self.num_generations:
                raise ValueError(
                    f"{TRAINER_NAME}: each SP group of {self._layout.sp} ranks is one process, so the generation batch "
                    f"is {generation_batch} rows (generation_batch_size {self.args.generation_batch_size} / sp_size), "
                    f"not a multiple of num_generations={self.num_generations}: raise per_device_train_batch_size or "
                    "steps_per_generation"
                )
            if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
                raise ValueError(f"{TRAINER_NAME}: an IterableDataset (a map-style dataset is sampled per SP group)")

        # Sampling: one process per SP group.
        def _get_train_sampler(self, dataset=None):
            from trl.trainer.utils import RepeatSampler

            if dataset is None:
                dataset = self.train_dataset
            layout = self._layout
            inner = RepeatSampler(
                data_source=dataset,
                mini_repeat_count=self.num_generations,
                batch_size=self.args.generation_batch_size // layout.sp // self.num_generations,
                repeat_count=self.num_iterations * self.args.steps_per_generation,
                shuffle=self.shuffle_dataset,
                seed=self.args.seed,
            )
            batch = self._train_batch_size * self.args.steps_per_generation
            return _GroupRepeatSampler(inner, batch, layout.data_parallel_size, layout.sp)

        @contextlib.contextmanager
        def _one_process_per_group(self):
            accelerator = self.accelerator
            saved = grpo_module.gather, grpo_module.gather_object
            self.accelerator = _DataParallelView(accelerator, self._layout)
            grpo_module.gather = self.accelerator.gather
            grpo_module.gather_object = _gather_object_one_per_group(self._layout)
            try:
                yield
            finally:
                self.accelerator = accelerator
                grpo_module.gather, grpo_module.gather_object = saved

        def _prepare_inputs(self, generation_batch):
            # TRL shuffles each generated batch with the rank's own RNG (seeded per rank): the group shuffles alike.
            original = grpo_module.shuffle_sequence_dict
            grpo_module.shuffle_sequence_dict = _shuffled_alike(self._ulysses, self._layout, original)
            try:
                return super()._prepare_inputs(generation_batch)
            finally:
                grpo_module.shuffle_sequence_dict = original

        def _generate_and_score_completions(self, inputs):
            with self._one_process_per_group():
                return super()._generate_and_score_completions(inputs)

        def _compute_loss(self, model, inputs):
            with self._one_process_per_group():
                return super()._compute_loss(model, inputs)

        # Generation: group rank 0 generates (locally, no exchange), the group receives its completions.
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
            ulysses = self._ulysses
            result = None
            if ulysses.rank == 0:
                result = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs
                )
            box = [result]
            torch.distributed.broadcast_object_list(box, src=self._layout.first, group=ulysses.group)
            return box[0]

        # Scoring: each rank its slice of every sequence, the log-probs gathered over the group.
        def _get_per_token_logps_and_entropies(
            self,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=None,
            compute_entropy=False,
            compute_aux_loss=False,
            **multimodal,
        ):
            given = sorted(name for name, value in multimodal.items() if value is not None)
            if given:
                raise ValueError(f"{TRAINER_NAME}: multimodal inputs {given} are not split across the SP group")
            if compute_aux_loss:
                raise ValueError(f"{TRAINER_NAME}: a router auxiliary loss is not split across the SP group")
            return _score(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy)

    UlyssesGRPOTrainer.__module__ = __name__
    return UlyssesGRPOTrainer


def _shuffled_alike(ulysses, layout: _GroupLayout, shuffle):
    """`shuffle` (TRL's shuffle_sequence_dict) run on every rank of the group with the seed its rank 0 draws."""

    def shuffled(batch):
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        seed = (seed if ulysses.rank == 0 else torch.zeros_like(seed)).to(ulysses.device)
        torch.distributed.broadcast(seed, src=layout.first, group=ulysses.group)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed.item()))
            return shuffle(batch)

    return shuffled


def _score(trainer, model, input_ids, attention_mask, logits_to_keep: int, compute_entropy: bool):
    ulysses = trainer._ulysses
    device = input_ids.device
    _check_same_sequences(ulysses, device, input_ids, attention_mask, logits_to_keep)
    rows = ulysses.micro_batch_size
    if input_ids.shape[0] % rows:
        raise ValueError(
            f"{TRAINER_NAME}: {input_ids.shape[0]} rows to score, not a multiple of micro_batch_size={rows} "
            "(Ulysses' shapes are fixed at registration)"
        )
    scale = 1.0 if sums_over_sequence_parallel_ranks(model) else float(ulysses.size)
    part = _shard_rank(ulysses)
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.shape[0], rows):
        ids, positions, shift_labels, index = _whole_sequences(
            input_ids[start : start + rows],
            attention_mask[start : start + rows],
            logits_to_keep,
            ulysses.size,
            ulysses.pad_token_id,
        )
        width = ids.shape[1] // ulysses.size
        piece = slice(part * width, (part + 1) * width)
        shard = {"input_ids": ids[:, piece].contiguous(), "position_ids": positions[:, piece].contiguous()}
        declare_shard(shard)
        try:
            with trainer.accelerator.autocast():
                outputs = model(**shard, shift_labels=shift_labels[:, piece].contiguous(), fused_lm_head=True)
        finally:
            disarm_shard()  # no later forward (generate's) is taken for this shard
        logps = _GatherSequence.apply(outputs.log_probs, ulysses.group, ulysses.rank, ulysses.size, scale)
        all_logps.append(logps.gather(1, index))
        if compute_entropy:
            entropy = _GatherSequence.apply(outputs.entropy, ulysses.group, ulysses.rank, ulysses.size, scale)
            all_entropies.append(entropy.gather(1, index))
    logps = torch.cat(all_logps, dim=0)
    entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
    return logps, entropies, None


_CLASS: list = []


def __getattr__(name: str):
    if name == TRAINER_NAME:
        if not _CLASS:
            _CLASS.append(_build_class())
        return _CLASS[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["UlyssesGRPOTrainer"]  # noqa: F822 (built by __getattr__ on first use)
