"""Run by tests/test_linear_attention.py under `torchrun --nproc-per-node N` (gloo, CPU,
DS_ACCELERATOR=cpu): hybrid models (Gated DeltaNet and softmax attention layers) under DeepSpeed's
Ulysses, the docs' loop recipe (register_ulysses, Ulysses.adapt, Ulysses.loss) against one process
on the whole sequences: the loss of every micro-batch and every gradient, in float64, plain and
with checkpointing, tiling and offloading on (offloading bit-identical to the same SP run without
it). Rank 0 writes what every rank saw to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import registry_models  # noqa: E402
import sequence_parallel_worker as spw  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import enable_sim  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from workers import write_results_and_tear_down  # noqa: E402

import hf_offload  # noqa: E402
from hf_offload.integrations import linear_attention  # noqa: E402
from hf_offload.integrations import sequence_parallel as sp  # noqa: E402

HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
TILE = 4  # tokens per slice: each rank's 8 tokens run as 2 slices


def hybrid(model_type: str, ranks: int, checkpointing=False, tiling=False, offload=False) -> torch.nn.Module:
    """A tiny hybrid in float64: layers linear, full, linear attention; as many key heads of the
    linear layers as ranks (value heads twice that), 4 query and 2 key/value heads of attention."""
    config = registry_models.tiny_config(model_type)
    heads = max(2, ranks)
    config.num_hidden_layers = 3
    config.layer_types = ["linear_attention", "full_attention", "linear_attention"]
    config.linear_num_key_heads, config.linear_num_value_heads = heads, 2 * heads
    config.use_cache = False
    # The MoE load-balancing loss (the registry's configs turn it on) is each rank's shard's under Ulysses,
    # for every MoE model: not this test's subject (the models' own default is off).
    config.output_router_logits = False
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = []
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).train()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
    if checkpointing:
        model.activation_checkpointing_enable()
    if tiling:
        hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    if offload:
        enable_sim(model)
    return model


class Float64Torch:
    """`torch` as a modeling module sees it, `torch.float32` answering float64 (see
    tests/test_linear_attention.py): the gated delta rule's torch fallback then runs in the
    model's float64."""

    def __getattr__(self, name: str):
        return torch.float64 if name == "float32" else getattr(torch, name)


@contextlib.contextmanager
def recurrence_in_float64(model_type: str):
    """transformers' Gated DeltaNet computes its decay (`.float()`) and its recurrence (the torch
    fallback's casts) in float32 whatever the model's dtype: here in float64, for a comparison to
    float64's rounding. Test instrument only."""
    model_class = AutoModelForCausalLM.from_config(registry_models.tiny_config(model_type)).__class__
    modeling = sys.modules[model_class.__module__]
    float32, original = torch.Tensor.float, modeling.torch
    modeling.torch = Float64Torch()
    torch.Tensor.float = lambda self: self if self.dtype == torch.float64 else float32(self)
    try:
        yield
    finally:
        modeling.torch, torch.Tensor.float = original, float32


def run(model_type: str, recipe: dict) -> tuple:
    """The docs' loop on the model (plain SGD, gradients averaged over the ranks as DDP would)."""
    model = hybrid(model_type, spw.SP, **recipe)
    ulysses = sp.register_ulysses(model, spw.SP, micro_batch_size=spw.ROWS)
    try:
        return spw.sp_train(model, model, ulysses), model
    finally:
        sp.unregister_ulysses()


def scenario_hybrids(types: tuple[str, ...] = HYBRIDS) -> dict:
    """Each hybrid type, the recurrence in float64: plain, and with checkpointing + tiling (+
    offloading, bit-identical); and each plain with transformers' own float32 recurrence."""
    results = {}
    for model_type in types:
        build = lambda model_type=model_type: hybrid(model_type, spw.SP)  # noqa: E731
        plain, model = run(model_type, {})
        results[f"{model_type}, float32 recurrence"] = spw.differences(spw.reference(build), plain)
        with recurrence_in_float64(model_type):
            ref = spw.reference(build)
            plain, model = run(model_type, {})
            results[f"{model_type}, plain"] = spw.differences(ref, plain)
            results[f"{model_type}, plain"]["prepared"] = sum(
                bool(getattr(m, linear_attention.PREPARED_ATTR, False)) for m in model.modules()
            )
            recipe = {"checkpointing": True, "tiling": True}
            tiled, _ = run(model_type, recipe)
            offloaded, model = run(model_type, {**recipe, "offload": True})
        result = spw.differences(ref, tiled)
        result.update(
            offloaded_identical=spw.identical(tiled, offloaded),
            stats=spw.stats_of(model),
            tiled=hf_offload.is_sequence_tiling(model),
        )
        results[f"{model_type}, checkpointing+tiling+offloading"] = result
    return results


def scenario_left_on_the_shard() -> dict:
    """Companion: Qwen3.5's Gated DeltaNet left on each rank's shard (the instance forward taken
    away again after register_ulysses, as before this fix): the comparison must see it."""
    model_type = HYBRIDS[0]
    with recurrence_in_float64(model_type):
        ref = spw.reference(lambda: hybrid(model_type, spw.SP))
        model = hybrid(model_type, spw.SP)
        ulysses = sp.register_ulysses(model, spw.SP, micro_batch_size=spw.ROWS)
        linear_attention.release_linear_attention(model)
        try:
            return spw.differences(ref, spw.sp_train(model, model, ulysses))
        finally:
            sp.unregister_ulysses()


def scenario_refused() -> dict:
    """A Mamba hybrid (Jamba) and LFM2's short convolutions: register_ulysses refuses them on every
    rank before anything runs."""
    errors = {}
    for model_type, layer_types in (("jamba", None), ("lfm2", ["conv", "full_attention"])):
        config = registry_models.tiny_config(model_type)
        if layer_types:
            config.layer_types = layer_types
        model = AutoModelForCausalLM.from_config(config)
        register = lambda model=model: sp.register_ulysses(model, spw.SP, micro_batch_size=spw.ROWS)  # noqa: E731
        errors[model_type] = spw._error(register)
    return errors


def scenario_own_rows() -> dict:
    """register_ulysses, then each rank's own rows, whole (generate with and without a cache in both
    modes, a DPO-like step, the eval loss: tests/sequence_parallel_worker.py's checks) on Qwen3.5:
    its Gated DeltaNets follow the exchange's decision and run whole on the rank's own rows, plain and
    with checkpointing and tiling. Companion: the forward rule forced on, the Gated DeltaNets run
    across the ranks' different rows."""
    model_type = HYBRIDS[0]
    results = {}
    for name, recipe in (("plain", {}), ("checkpointing+tiling", {"checkpointing": True, "tiling": True})):
        model = hybrid(model_type, spw.SP, **recipe)
        expected = spw.own_rows_checks(model)
        sp.register_ulysses(model, spw.SP, micro_batch_size=spw.ROWS)
        try:
            results[name] = spw.compare_own_rows(expected, spw.own_rows_checks(model))
        finally:
            sp.unregister_ulysses()
    model = hybrid(model_type, spw.SP)
    expected = spw.own_rows_checks(model)
    sp.register_ulysses(model, spw.SP, micro_batch_size=spw.ROWS)
    linear_attention.set_forward_rule(lambda positions: True)
    try:
        loss, eval_loss, grads = spw.preference_step(model)
    finally:
        sp.unregister_ulysses()
    results["forced"] = spw.compare_own_rows(expected, {**expected, "loss": loss, "eval_loss": eval_loss,
                                                         "grads": grads})  # fmt: skip
    return results


SCENARIOS = {
    "own_rows": scenario_own_rows,
    "hybrids": scenario_hybrids,
    "qwen3_5": lambda: scenario_hybrids(HYBRIDS[:1]),
    "left_on_the_shard": scenario_left_on_the_shard,
    "refused": scenario_refused,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default="hybrids,left_on_the_shard,refused,own_rows")
    args = parser.parse_args()

    import deepspeed

    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    spw.SP = dist.get_world_size()
    spw.OUT = os.path.abspath(args.out)
    results: dict[str, dict] = {}
    for name in args.scenarios.split(","):
        started = time.perf_counter()
        try:
            results[name] = SCENARIOS[name]()
        except Exception as error:  # recorded for the test to assert on; the other scenarios still run
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        with contextlib.suppress(Exception):
            spw.restore_attention()
        dist.barrier()
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
    write_results_and_tear_down(args.out, results)


if __name__ == "__main__":
    main()
