"""Run by tests/test_distributed.py under `python -m torch.distributed.run --standalone --nproc-per-node 2`.

Two CPU processes, gloo. Every scenario builds the same tiny Llama twice from one seed, one
plain and one with offloading (the engine running on CPU tensors), wraps both the same way
(DDP, FSDP2, accelerate; DeepSpeed ZeRO-3 when asked for) and trains both for a few steps on
the same per-rank data, in this process, so the two runs see the same collectives. Rank 0
writes what every rank saw to the JSON file named by --out; the test asserts on it.

Parameters are watched while the engine works: every storage the engine copies to the host
(spied on at `DeviceContext.offload_async`, as tests/routing.py does) is compared with the
storages of the model's parameters and buffers live at that moment: under FSDP2 that is the
running layer's unsharded parameters (recorded by a forward pre-hook, which runs after FSDP2's
unshard hook), the root's unsharded parameters and every other layer's local shard.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import traceback
from collections.abc import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import batch, enable_sim, tiny_model  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from workers import full_grads, write_results_and_tear_down  # noqa: E402

import hf_offload  # noqa: E402
from hf_offload.engine.offloader import DeviceContext  # noqa: E402

STEPS = 2
LR = 0.1


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def ptr(tensor: torch.Tensor) -> int:
    return local(tensor).untyped_storage().data_ptr()


class ParameterWatch:
    """Checks, at every batch of copies to the host, that no source is a live parameter."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.layer_ptrs: set[int] = set()  # the running layer's parameters, read at its call
        self.batches = 0
        self.sources = 0
        self.violations: list[str] = []
        self.plain_params_in_layer = 0  # parameters seen as plain tensors inside a layer call
        self.sharded_params_in_layer = 0  # parameters seen as DTensor shards inside a layer call

    def live_ptrs(self) -> set[int]:
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        # DeepSpeed ZeRO-3 keeps each parameter's partition in `ds_tensor`.
        partitions = (p.ds_tensor for p in self.model.parameters() if getattr(p, "ds_tensor", None) is not None)
        return {ptr(t) for t in itertools.chain(tensors, partitions)} | self.layer_ptrs

    def check(self, copies) -> None:
        if self.model is None:
            return
        self.batches += 1
        live = self.live_ptrs()
        for copy in copies:
            self.sources += 1
            if copy.source is not None and copy.source.data_ptr() in live:
                self.violations.append(f"batch {self.batches}: a {copy.source.nbytes()}-byte parameter storage")

    @contextlib.contextmanager
    def watching(self, model: torch.nn.Module) -> Iterator[None]:
        handles = []

        def pre_hook(module, args):
            params = list(module.parameters())
            self.plain_params_in_layer += sum(not isinstance(p, DTensor) for p in params)
            self.sharded_params_in_layer += sum(isinstance(p, DTensor) for p in params)
            self.layer_ptrs = {ptr(p) for p in params}

        for layer in model.model.layers:  # not resolve_layers: it rejects FSDP2's layer classes
            handles.append(layer.register_forward_pre_hook(pre_hook))
        self.model = model
        try:
            yield
        finally:
            self.model = None
            self.layer_ptrs = set()
            for handle in handles:
                handle.remove()

    def result(self) -> dict:
        return {
            "batches": self.batches,
            "sources": self.sources,
            "violations": self.violations,
            "plain_params_in_layer": self.plain_params_in_layer,
            "sharded_params_in_layer": self.sharded_params_in_layer,
        }


WATCH = ParameterWatch()
_original_offload_async = DeviceContext.offload_async


def _watched_offload_async(self, copies, engine):
    WATCH.check(copies)
    return _original_offload_async(self, copies, engine)


DeviceContext.offload_async = _watched_offload_async


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def train(wrapped, inner, step_fn: Callable | None = None, full: Callable | None = None) -> tuple[list, list, dict]:
    """STEPS SGD steps on this rank's batches: (losses, grads per step, final full weights).
    `full(wrapped)` returns (full gradients, full weights) where `inner`'s own do not show them."""
    full = full or (lambda _: (full_grads(inner), full_weights(inner)))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        ids = batch(seed=100 * step + dist.get_rank())
        optimizer.zero_grad(set_to_none=True)
        loss = wrapped(input_ids=ids, labels=ids).loss
        (step_fn or (lambda loss: loss.backward()))(loss)
        losses.append(loss.detach().clone())
        grads.append(full(wrapped)[0])
        optimizer.step()
    return losses, grads, full(wrapped)[1]


def compare(plain_run, offloaded_run, offloaded_inner) -> dict:
    (plain_losses, plain_grads, plain_weights), (losses, grads, weights) = plain_run, offloaded_run
    differing = sorted(
        {name for a, b in zip(plain_grads, grads, strict=True) for name in a if not torch.equal(a[name], b[name])}
    )
    stats = hf_offload.activation_offloading_stats(offloaded_inner)
    return {
        "losses": [float(x) for x in losses],
        "plain_losses": [float(x) for x in plain_losses],
        "losses_equal": all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True)),
        "grad_names": sorted(plain_grads[0]),
        "same_grad_names": all(a.keys() == b.keys() for a, b in zip(plain_grads, grads, strict=True)),
        "grads_differing": differing,
        "weights_equal": plain_weights.keys() == weights.keys()
        and all(torch.equal(plain_weights[k], weights[k]) for k in plain_weights),
        "grad_checksum": [float(sum(g.double().sum() for g in step.values())) for step in grads],
        "stats": stats.as_dict(),
    }


def twins(**overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    return tiny_model("llama", seed=0, **overrides), tiny_model("llama", seed=0, **overrides)


# --- scenarios ---------------------------------------------------------------------------------


def scenario_ddp(enable_after_wrap: bool = False) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    plain, offloaded = twins()
    if not enable_after_wrap:
        enable_sim(offloaded)
    plain_ddp, offloaded_ddp = DDP(plain), DDP(offloaded)
    if enable_after_wrap:
        enable_sim(offloaded_ddp.module)
    plain_run = train(plain_ddp, plain)
    with WATCH.watching(offloaded):
        offloaded_run = train(offloaded_ddp, offloaded)
    return compare(plain_run, offloaded_run, offloaded)


def shard(model: torch.nn.Module, lm_head_unit: bool = False) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if lm_head_unit:  # lm_head its own unit: unsharded only in its own calls, the tiled loss's slices included
        fully_shard(model.lm_head)
    fully_shard(model)


def scenario_fsdp2(enable_after_shard: bool = False, checkpointing: bool = False) -> dict:
    plain, offloaded = twins()
    for model in (plain, offloaded):
        if checkpointing:
            model.activation_checkpointing_enable()
    if not enable_after_shard:
        enable_sim(offloaded)
    shard(plain)
    shard(offloaded)
    if enable_after_shard:
        enable_sim(offloaded)
    plain_run = train(plain, plain)
    with WATCH.watching(offloaded):
        offloaded_run = train(offloaded, offloaded)
    result = compare(plain_run, offloaded_run, offloaded)
    result["sharded_at_rest"] = all(isinstance(p, DTensor) for p in offloaded.parameters())
    result["fsdp_class"] = type(offloaded.model.layers[0]).__name__
    return result


def scenario_fsdp1(use_orig_params: bool, enable_after_wrap: bool = False, checkpoint_wrappers: bool = False) -> dict:
    """FSDP1 (FullyShardedDataParallel, one unit per decoder layer, CPU, gloo). It frees each
    unit's gathered parameters after the unit's forward by resizing their storage to zero and
    gathers them again into the same storage in backward; none of that may reach the engine.
    `checkpoint_wrappers` then applies activation checkpointing the way accelerate's FSDP plugin
    does (non-reentrant checkpoint_wrapper around each decoder layer inside its FSDP1 unit)."""
    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        return fsdp1_wrap(model, use_orig_params, checkpoint_wrappers)

    plain, offloaded = twins()
    if not enable_after_wrap:
        enable_sim(offloaded)
    plain_wrapped, offloaded_wrapped = wrap(plain), wrap(offloaded)
    if enable_after_wrap:
        enable_sim(offloaded)  # the decoder layers are inside FSDP1 units now
    plain_run = train(plain_wrapped, plain, full=fsdp1_full)
    with WATCH.watching(offloaded):
        offloaded_run = train(offloaded_wrapped, offloaded, full=fsdp1_full)
    result = compare(plain_run, offloaded_run, offloaded)
    result["fsdp_class"] = type(offloaded.model.layers[0]).__name__
    result["wrapped_layer_class"] = type(getattr(offloaded, hf_offload.api.MODEL_STATE_ATTR).layers[0]).__name__
    return result


def fsdp1_wrap(model: torch.nn.Module, use_orig_params: bool, checkpoint_wrappers: bool = False) -> torch.nn.Module:
    """FSDP1, one unit per decoder layer and one for the rest, on the CPU."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    wrapped = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    if checkpoint_wrappers:
        apply_activation_checkpointing(
            wrapped,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda module: isinstance(module, LlamaDecoderLayer),
        )
    return wrapped


def fsdp1_full(wrapped: torch.nn.Module) -> tuple[dict, dict]:
    """FSDP1's full gradients and weights on every rank. Its summon_full_params cannot gather
    gradients of flat parameters, so each rank's gradient shard is all-gathered here."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    grads = {}
    for name, param in wrapped.named_parameters():
        if param.grad is not None:
            shards: list[torch.Tensor] = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(shards, param.grad.detach().clone())
            grads[name] = torch.cat(shards)
    with FSDP.summon_full_params(wrapped):
        weights = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    return grads, weights


@contextlib.contextmanager
def parameters_unprotected() -> Iterator[None]:
    """A deliberately broken engine that no longer recognises parameter storages: the watch must
    see their copies (the companion of the parity scenarios' "no violations")."""
    from hf_offload.engine import offloader, recompute

    originals = recompute.storage_ptrs, offloader.PARAMETER_TYPES
    recompute.storage_ptrs = lambda tensors: set()
    offloader.PARAMETER_TYPES = ()
    try:
        yield
    finally:
        recompute.storage_ptrs, offloader.PARAMETER_TYPES = originals


def scenario_unprotected(wrapper: str) -> dict:
    with parameters_unprotected():
        return scenario_fsdp1(use_orig_params=False) if wrapper == "fsdp1" else scenario_fsdp2()


def scenario_accelerate() -> dict:
    """accelerate's prepare (a DDP wrapper here) with gradient accumulation over 2 micro-batches
    (DDP's no_sync on the first)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    def run(model):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        # accelerate's loader gives each rank every other item: 2 micro-batches per step and rank.
        data = [batch(seed=i, batch_size=1)[0] for i in range(2 * STEPS * dist.get_world_size())]
        loader = torch.utils.data.DataLoader(data, batch_size=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses, grads = [], []
        for ids in loader:
            with accelerator.accumulate(prepared):
                loss = prepared(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grads.append(full_grads(model))
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach().clone())
        info = {"wrapper": type(prepared).__name__, "distributed_type": str(accelerator.distributed_type)}
        return (losses, grads, full_weights(model)), info

    plain, offloaded = twins()
    enable_sim(offloaded)
    plain_run, _ = run(plain)
    with WATCH.watching(offloaded):
        offloaded_run, info = run(offloaded)
    result = compare(plain_run, offloaded_run, offloaded)
    result.update(info, sync_steps=len(offloaded_run[1]))
    return result


def scenario_zero3(tiling: bool = False) -> dict:
    """DeepSpeed ZeRO-3 (needs `deepspeed`; DS_ACCELERATOR=cpu, gloo). The model is built under
    deepspeed.zero.Init, as transformers does for ZeRO-3, which also swaps F.linear for
    LinearFunctionForZeroStage3: it saves the weight Parameter itself, so that ZeRO-3 can free the
    gathered weight after the layer (free_param: `param.data = torch.empty(0)`) and gather it again
    in backward. Besides parity, this records how many gathered weights are still alive between
    forward and backward: with nothing holding them, none."""
    import deepspeed

    # The modeling module first, as from_pretrained and from_config resolve the class before entering
    # zero.Init: one first imported inside zero.Init loses the __init__ kernels' use_kernelized_func
    # gave its attention class (transformers >= 5.25) when zero.Init exits, and every model built
    # after that fails at its first forward, with or without hf_offload (check_kernel_funcs says so).
    import transformers.models.llama.modeling_llama  # noqa: F401
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from deepspeed.utils import safe_get_full_grad
    from torch.multiprocessing.reductions import StorageWeakRef
    from transformers.utils import is_kernels_available

    from hf_offload.instance_forward import dropped
    from hf_offload.tiling import per_token

    config = {
        "train_micro_batch_size_per_gpu": 2,
        # Partition every parameter and release each one as soon as its module has run (the defaults
        # keep a tiny model's weights gathered from the second step on).
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        },
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_allow_untested_optimizer": True,
    }

    taken_off: list[int] = []  # per tiled run: how many tiled modules kernelize took the wrapper off

    def run(offload: bool, tiled: bool = False):
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = tiny_model("llama", seed=0)
        if tiled:
            hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
        if offload:
            enable_sim(model)
        if is_kernels_available():
            # transformers' hub kernels on, as from_pretrained has them by default from 5.25: kernelize
            # takes tiling's wrapper off the norms, which must still run a slice at a time under ZeRO-3.
            model.set_use_kernels(True)
            if tiled:
                taken_off.append(sum(dropped(m) for m in model.modules() if per_token.is_tiled(m)))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        gathered: list[StorageWeakRef] = []
        names = {module: name for name, module in model.named_modules()}
        calls: dict[str, int] = {}  # calls of each module holding parameters, in the last step
        # ZeRO-3's gathers of each module holding parameters in the last step: [for forward, for backward]
        # (a call of the module gathers "for forward", in backward too; its backward hooks "for backward").
        fetches: dict[str, list[int]] = {}
        fetch = PartitionedParameterCoordinator.fetch_sub_module

        def counted_fetch(coordinator, module, forward: bool) -> None:
            if module in counted:
                fetches.setdefault(names[module], [0, 0])[0 if forward else 1] += 1
            return fetch(coordinator, module, forward)

        PartitionedParameterCoordinator.fetch_sub_module = counted_fetch
        in_layers = set(model.model.layers.modules())

        def record(module, args, output):
            calls[names[module]] = calls.get(names[module], 0) + 1
            if module not in in_layers:
                return
            for param in module.parameters(recurse=False):
                if param.numel() > 0:
                    gathered.append(StorageWeakRef(param.untyped_storage()))

        def train_step(step: int) -> None:
            gathered.clear()
            calls.clear()
            fetches.clear()
            ids = batch(seed=100 * step + dist.get_rank())
            loss = engine(input_ids=ids, labels=ids).loss
            alive.append(sum(not ref.expired() for ref in gathered))  # between forward and backward
            engine.backward(loss)
            grads.append({n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()})
            engine.step()
            losses.append(loss.detach().clone())

        # ZeRO-3 gathers and frees each module's own parameters around that module's forward: record
        # them in a forward hook that runs before ZeRO-3's release hook.
        counted = {
            module
            for module in model.modules()
            if next(module.parameters(recurse=False), None) is not None and module is not model.model.embed_tokens
        }
        handles = [module.register_forward_hook(record, prepend=True) for module in counted]
        losses, grads, alive = [], [], []
        watching = WATCH.watching(model) if offload else contextlib.nullcontext()
        with watching:
            for step in range(STEPS):
                train_step(step)
        for handle in handles:
            handle.remove()
        PartitionedParameterCoordinator.fetch_sub_module = fetch
        weights = {}
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                weights[name] = param.detach().clone()
        return (losses, grads, weights), model, alive, len(gathered), (calls, fetches)

    if tiling:
        # Tiled (3 slices, every part and the loss head) against untiled, and tiled + offloaded
        # against tiled alone; the loss head's slices gather lm_head's weight, the MLP's slices
        # their projections' (ZeRO-3 hooks), and ZeRO-3 reduces each gradient once.
        untiled_run, *_, (untiled_calls, untiled_fetches) = run(offload=False)
        tiled_run, tiled, tiled_alive, count, (tiled_calls, tiled_fetches) = run(offload=False, tiled=True)
        offloaded_run, offloaded, alive, *_ = run(offload=True, tiled=True)
        result = compare(tiled_run, offloaded_run, offloaded)
        close = [
            torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-6)
            for a, b in zip(untiled_run[1], tiled_run[1], strict=True)
            for name in a
        ]
        result.update(
            close_to_untiled=bool(close) and all(close),
            untiled_losses=[float(x) for x in untiled_run[0]],
            tiled=hf_offload.is_sequence_tiling(tiled),
            gathered_per_step=count,
            calls_per_step=tiled_calls,
            untiled_calls_per_step=untiled_calls,
            fetches_per_step=tiled_fetches,
            untiled_fetches_per_step=untiled_fetches,
            gathered_alive_plain=tiled_alive,
            gathered_alive_offloaded=alive,
            kernelize_took_off=taken_off,
        )
        return result
    plain_run, _, plain_alive, count, _ = run(offload=False)
    offloaded_run, offloaded, alive, *_ = run(offload=True)
    result = compare(plain_run, offloaded_run, offloaded)
    result.update(gathered_per_step=count, gathered_alive_plain=plain_alive, gathered_alive_offloaded=alive)
    return result


TILE = 4  # tokens per slice: the tiny batches' 12 tokens run as 3 slices


def gradient_arrivals(model: torch.nn.Module) -> tuple[Callable[[], dict], Callable[[], None]]:
    """Counts, per parameter, how often a gradient is accumulated into it (what DDP's reducer and
    FSDP2's post-backward react to): (read the counts of the last step, remove the hooks)."""
    counts: dict[str, int] = {}

    def arrived(name: str) -> None:
        counts[name] = counts.get(name, 0) + 1

    handles = [
        param.register_post_accumulate_grad_hook(lambda _param, name=name: arrived(name))
        for name, param in model.named_parameters()
        if param.requires_grad
    ]

    def read() -> dict:
        seen = dict(counts)
        counts.clear()
        return seen

    return read, lambda: [handle.remove() for handle in handles]


def scenario_tiling(wrapper: str, checkpointing: bool = False) -> dict:
    """Sequence tiling under DDP, FSDP2 (lm_head in the root unit, or a unit of its own) or FSDP1
    (flat parameters, or use_orig_params): tiled and offloaded bit-identical to tiled alone (the
    same collectives), both close to untiled training, and under DDP each parameter's gradient
    arriving once per step, as its reducer expects."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    untiled, tiled, offloaded = (tiny_model("llama", seed=0) for _ in range(3))
    for model in (untiled, tiled, offloaded):
        if checkpointing:
            model.activation_checkpointing_enable()
    for model in (tiled, offloaded):
        hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    enable_sim(offloaded)

    def wrapped(model):
        if wrapper == "ddp":
            return DDP(model)
        if wrapper.startswith("fsdp1"):
            return fsdp1_wrap(model, use_orig_params=wrapper == "fsdp1_orig_params")
        shard(model, lm_head_unit=wrapper == "fsdp2_lm_head")
        return model

    full = fsdp1_full if wrapper.startswith("fsdp1") else None

    # DDP keeps the parameters, so the count reads what its reducer sees; FSDP2 swaps them for
    # sharded ones and sets their gradients itself, so only parity speaks for it.
    read, remove = gradient_arrivals(tiled) if wrapper == "ddp" else (dict, lambda: None)
    arrivals = []
    untiled_run = train(wrapped(untiled), untiled, full=full)
    tiled_run = train(
        wrapped(tiled), tiled, step_fn=lambda loss: (loss.backward(), arrivals.append(read())), full=full
    )
    remove()
    with WATCH.watching(offloaded):
        offloaded_run = train(wrapped(offloaded), offloaded, full=full)
    result = compare(tiled_run, offloaded_run, offloaded)
    close = [
        name in b and torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-6)
        for a, b in zip(untiled_run[1], tiled_run[1], strict=True)
        for name in a
    ]
    result.update(
        close_to_untiled=bool(close) and all(close) and untiled_run[1][0].keys() == tiled_run[1][0].keys(),
        untiled_losses=[float(x) for x in untiled_run[0]],
        arrivals_per_step=[sorted(set(step.values())) for step in arrivals],
        parameters_arrived=[len(step) for step in arrivals],
        trainable=sum(p.requires_grad for p in tiled.parameters()),
        tiled=hf_offload.is_sequence_tiling(tiled),
    )
    return result


@contextlib.contextmanager
def tiles_accumulated_one_by_one() -> Iterator[None]:
    """A deliberately broken tiling that accumulates each slice's parameter gradients into .grad
    as it goes (several arrivals per step): DDP's reducer must refuse it (the companion of the
    tiling scenarios' one arrival per step)."""
    from hf_offload.tiling import per_token

    original = per_token._TiledMLP.backward

    def backward(ctx, *grads):
        run, (x,) = ctx.run, ctx.saved_tensors
        parameters = run.targets.tensors
        grad_x = torch.zeros_like(x)
        for start, stop in run.bounds:
            with torch.enable_grad():
                leaf = x[:, start:stop].detach().requires_grad_(True)
                output = run.forward_slice(leaf.clone())
            torch.autograd.backward(output, grads[0][:, start:stop], inputs=[leaf, *parameters])
            grad_x[:, start:stop] = leaf.grad
        return (None, grad_x, *[None] * len(parameters))

    per_token._TiledMLP.backward = staticmethod(backward)
    try:
        yield
    finally:
        per_token._TiledMLP.backward = original


@contextlib.contextmanager
def tiling_sees_parameters_only() -> Iterator[None]:
    """A deliberately broken tiling that looks for the tensors needing gradients among registered
    parameters only: inside an FSDP1 unit with flat parameters a module has none, so its weights'
    views would get no gradient (the companion of fsdp1_tiling's parity)."""
    from hf_offload.tiling import gradients

    original = gradients.Targets.of

    def parameters_only(module, extra=()):
        targets = original(module, extra)
        pairs = zip(targets.places, targets.tensors, strict=True)
        kept = [(place, tensor) for place, tensor in pairs if isinstance(tensor, torch.nn.Parameter)]
        return gradients.Targets([place for place, _ in kept], [tensor for _, tensor in kept], targets.zero3)

    gradients.Targets.of = staticmethod(parameters_only)
    try:
        yield
    finally:
        gradients.Targets.of = original


def scenario_fsdp1_tiling_parameters_only() -> dict:
    with tiling_sees_parameters_only():
        return scenario_tiling("fsdp1")


def scenario_tiling_accumulated_per_slice() -> dict:
    with tiles_accumulated_one_by_one():
        return scenario_tiling("ddp")


SCENARIOS = {
    "ddp": scenario_ddp,
    "ddp_enable_after_wrap": lambda: scenario_ddp(enable_after_wrap=True),
    "fsdp2": scenario_fsdp2,
    "fsdp2_checkpointing": lambda: scenario_fsdp2(checkpointing=True),
    "fsdp2_enable_after_shard": lambda: scenario_fsdp2(enable_after_shard=True),
    "fsdp1": lambda: scenario_fsdp1(use_orig_params=False),
    "fsdp1_orig_params": lambda: scenario_fsdp1(use_orig_params=True),
    "fsdp1_enable_after_wrap": lambda: scenario_fsdp1(use_orig_params=False, enable_after_wrap=True),
    "fsdp1_checkpoint_wrappers": lambda: scenario_fsdp1(use_orig_params=True, checkpoint_wrappers=True),
    "fsdp1_unprotected": lambda: scenario_unprotected("fsdp1"),
    "fsdp2_unprotected": lambda: scenario_unprotected("fsdp2"),
    "accelerate": scenario_accelerate,
    "ddp_tiling": lambda: scenario_tiling("ddp"),
    "ddp_tiling_checkpointing": lambda: scenario_tiling("ddp", checkpointing=True),
    "fsdp2_tiling": lambda: scenario_tiling("fsdp2"),
    "fsdp2_tiling_checkpointing": lambda: scenario_tiling("fsdp2", checkpointing=True),
    "fsdp2_lm_head_tiling": lambda: scenario_tiling("fsdp2_lm_head"),
    "fsdp1_tiling": lambda: scenario_tiling("fsdp1"),
    "fsdp1_orig_params_tiling": lambda: scenario_tiling("fsdp1_orig_params"),
    "fsdp1_tiling_parameters_only": scenario_fsdp1_tiling_parameters_only,
    "ddp_tiling_accumulated_per_slice": scenario_tiling_accumulated_per_slice,
}
# Run only when asked for: they need DeepSpeed.
OPTIONAL_SCENARIOS = {"zero3": scenario_zero3, "zero3_tiling": lambda: scenario_zero3(tiling=True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    all_scenarios = {**SCENARIOS, **OPTIONAL_SCENARIOS}
    args = parser.parse_args()

    dist.init_process_group("gloo")
    results: dict[str, dict] = {}
    for name in args.scenarios.split(","):
        WATCH.__init__()
        try:
            results[name] = all_scenarios[name]()
        except Exception as error:  # recorded for the test to assert on; the other scenarios still run
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        results[name]["watch"] = WATCH.result()
        dist.barrier()

    write_results_and_tear_down(args.out, results)


if __name__ == "__main__":
    main()
