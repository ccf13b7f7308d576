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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import registry_models  # noqa: E402
import sequence_parallel_worker as spw  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import enable_sim  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from workers import run_scenarios, write_results_and_tear_down  # noqa: E402

import hf_offload  # noqa: E402
from hf_offload.integrations import linear_attention, router_loss  # noqa: E402
from hf_offload.integrations import sequence_parallel as sp  # noqa: E402

HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
TILE = 4  # tokens per slice: each rank's 8 tokens run as 2 slices


AUX_COEF = 0.5  # router_aux_loss_coef where the load-balancing loss is on: large enough to matter in the loss


def hybrid(
    model_type: str, ranks: int, checkpointing=False, tiling=False, offload=False, router_loss=False
) -> torch.nn.Module:
    """A tiny hybrid in float64: layers linear, full, linear attention; as many key heads of the
    linear layers as ranks (value heads twice that), 4 query and 2 key/value heads of attention.
    An MoE one with its load-balancing loss where `router_loss` (else off: the models' default).
    A model type without linear attention (qwen3_moe): two layers of softmax attention."""
    config = registry_models.tiny_config(model_type)
    heads = max(2, ranks)
    if model_type in HYBRIDS:
        config.num_hidden_layers = 3
        config.layer_types = ["linear_attention", "full_attention", "linear_attention"]
        config.linear_num_key_heads, config.linear_num_value_heads = heads, 2 * heads
    config.use_cache = False
    config.output_router_logits = router_loss
    if router_loss:
        config.router_aux_loss_coef = AUX_COEF
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
    modeling.torch = router_loss.torch = Float64Torch()  # the load-balancing loss's float32 sums too
    torch.Tensor.float = lambda self: self if self.dtype == torch.float64 else float32(self)
    try:
        yield
    finally:
        modeling.torch, router_loss.torch, torch.Tensor.float = original, torch, float32


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


MOE = ("qwen3_5_moe_text", "qwen3_moe")


@contextlib.contextmanager
def with_attention_mask():
    """The scenarios' batches with an attention_mask of ones: Ulysses.adapt pads the 15-token batch
    to 16 with a 0 there, which keeps its pad token out of the load-balancing loss, as one process
    on the 15 tokens has it."""
    local, whole = spw.local_batches, spw.whole_order

    def masked(batches):
        return [{**batch, "attention_mask": torch.ones_like(batch["input_ids"])} for batch in batches]

    spw.local_batches = lambda masked_labels=False: masked(local(masked_labels))
    spw.whole_order = lambda masked_labels=False: masked(whole(masked_labels))
    try:
        yield
    finally:
        spw.local_batches, spw.whole_order = local, whole


def scenario_router_loss() -> dict:
    """The MoE load-balancing loss on (output_router_logits, router_aux_loss_coef 0.5): Qwen3.5-MoE
    (its recurrence in float64) and Qwen3-MoE, plain and with checkpointing + offloading, against
    one process; and (the companion) with transformers' own function put back, each rank's shard's
    loss summed over the group."""
    results = {}
    for model_type in MOE:
        build = lambda model_type=model_type, **recipe: hybrid(model_type, spw.SP, router_loss=True, **recipe)  # noqa: E731
        float64 = recurrence_in_float64(model_type) if model_type in HYBRIDS else contextlib.nullcontext()
        with float64, with_attention_mask():
            ref = spw.reference(build)
            full = {"checkpointing": True, "tiling": True, "offload": True}
            for name, recipe in (("plain", {}), ("checkpointing+tiling+offloading", full)):
                model = build(**recipe)
                ulysses = sp.register_ulysses(model, spw.SP, micro_batch_size=spw.ROWS)
                try:
                    results[f"{model_type}, {name}"] = spw.differences(ref, spw.sp_train(model, model, ulysses))
                finally:
                    sp.unregister_ulysses()
            model = build()
            ulysses = sp.register_ulysses(model, spw.SP, micro_batch_size=spw.ROWS)
            modeling = sys.modules[type(model).__module__]
            wrapped = modeling.load_balancing_loss_func
            modeling.load_balancing_loss_func = router_loss._ORIGINAL[modeling.__name__]
            try:
                results[f"{model_type}, shard's own loss"] = spw.differences(ref, spw.sp_train(model, model, ulysses))
            finally:
                modeling.load_balancing_loss_func = wrapped
                sp.unregister_ulysses()
    return results


SCENARIOS = {
    "own_rows": scenario_own_rows,
    "hybrids": scenario_hybrids,
    "qwen3_5": lambda: scenario_hybrids(HYBRIDS[:1]),
    "left_on_the_shard": scenario_left_on_the_shard,
    "refused": scenario_refused,
    "router_loss": scenario_router_loss,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default="hybrids,left_on_the_shard,refused,own_rows,router_loss")
    args = parser.parse_args()

    import deepspeed

    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    spw.SP = dist.get_world_size()
    spw.OUT = os.path.abspath(args.out)
    results = run_scenarios(SCENARIOS, args.scenarios, after_each=spw.restore_attention)
    write_results_and_tear_down(args.out, results)


if __name__ == "__main__":
    main()
