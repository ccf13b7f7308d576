"""What hf_offload relies on in other libraries beyond their documented API, in one place: every
private name it reads or replaces, every call-stack read, every structure or version-specific
behaviour of transformers, TRL, PEFT, accelerate, DeepSpeed, bitsandbytes, kernels and Liger
Kernel that the product or the tools (the simulator's stand-ins first) touch. One `Reliance` each
in `INVENTORY`: where we use it, what of ours depends on it, the versions it was checked on, and
what happens when a release removes or renames it.

A name is reached through this module, never directly: `resolve(entry)` returns it, and where the
installed library lacks it raises `UpstreamChanged`, which names the library, its version, the
versions checked and the feature that stops (never an AttributeError from deeper down, nor a
stand-in silently left unused); `replaced(entry, value)` puts a stand-in in its place for a block,
after the same check. Where a feature goes on without the name, `present(entry)` tells and
`announce(entry)` says so once. A behaviour that no lookup can check is held by a test against the
real library, named in its entry. tests/test_upstream.py removes or renames each entry's name and
asserts the message or the fallback; `python -m hf_offload.integrations.upstream` prints the table
docs/upstream.md holds.

Nothing here imports another library until an entry is resolved.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata

logger = logging.getLogger("hf_offload")

# The versions every entry was checked on unless it says otherwise (2026-12-04; peft 0.22.0 and
# huggingface-hub 2.5.0 on 2026-12-07): the newest releases
# (.ci/run's install) and the lowest bounds pyproject.toml allows (.ci/oldest).
CHECKED = {
    "transformers": "5.24.0, 5.25.0",
    "trl": "1.16.0",
    "peft": "0.21.2, 0.22.0",
    "accelerate": "1.15.0, 1.16.0",
    "deepspeed": "0.19.8",
    "bitsandbytes": "0.50.0, 0.50.2",
    "kernels": "0.19.1",
    "liger-kernel": "0.8.5",
    "huggingface-hub": "2.4.0, 2.5.0",
}

ERROR = "error"  # missing: UpstreamChanged, naming library, version and feature
FALLBACK = "fallback"  # missing: the feature goes on without it, said once (`announce`)
HELD = "held"  # a behaviour: a test against the real library notices when it changes


@dataclass(frozen=True)
class Reliance:
    library: str  # the distribution, as pip names it
    name: str  # "module:attribute.path" for a name; for a behaviour, what it is
    kind: str  # private name, replaced, call stack, structure, behaviour
    used_by: str  # where hf_offload uses it
    feature: str  # what of ours depends on it
    when_missing: str  # ERROR, FALLBACK or HELD
    missing: str = ""  # FALLBACK: what happens instead; HELD: the test that holds it
    checked: str = ""  # versions, where not CHECKED's

    @property
    def versions(self) -> str:
        return self.checked or CHECKED[self.library]


_SIM = "hf_offload/tools/simulator/"
_GRPO_ULYSSES = "hf_offload/integrations/grpo_ulysses.py"
# Every file that reads or writes a config's `_attn_implementation` (tests/test_upstream.py holds the list
# to the source).
ATTN_IMPLEMENTATION_USERS = (
    "hf_offload/integrations/sequence_parallel.py, tiling/__init__.py, tiling/attention.py, tools/determinism.py, "
    "tools/simulator/step.py, tools/benchmarks/gpu_multi.py, tools/benchmarks/cpu_tiling.py"
)
_TRL_HEAD = "estimate --trainer (TRL's fused LM head on the meta device, as on a CUDA device)"
_LINEAR_ATTENTION = "simulated steps of Qwen3.5 and Qwen3-Next (their linear attention's GPU kernels on meta)"
_MASKS = "every simulated step (masks decided on meta as on a GPU with unpadded inputs)"
_FOUR_BIT = "estimate --load-in-4bit (a 4-bit base quantized on the meta device)"
_GENERATION = "estimate --trainer grpo (transformers' generate on the meta device, as TRL calls it)"

INVENTORY: dict[str, Reliance] = {
    # -- the simulator's stand-ins ---------------------------------------------------------------
    "trl.use_triton": Reliance(
        "trl", "trl.kernels.chunked_logprob:_use_triton", "replaced", _SIM + "trl.py", _TRL_HEAD, ERROR),
    "trl.trainer_use_triton": Reliance(
        "trl", "trl.trainer.utils:_use_triton", "replaced", _SIM + "trl.py",
        _TRL_HEAD + ": only the labelled rows scored", ERROR),
    "trl.addmm_fp32": Reliance(
        "trl", "trl.kernels.chunked_logprob:_addmm_fp32", "replaced", _SIM + "trl.py",
        _TRL_HEAD + ": fp32 accumulation without fp32 copies of the tiles", ERROR),
    "trl.forward_kernel": Reliance(
        "trl", "trl.kernels.chunked_logprob:_forward_kernel", "replaced", _SIM + "trl.py", _TRL_HEAD, ERROR),
    "trl.backward_kernel": Reliance(
        "trl", "trl.kernels.chunked_logprob:_backward_kernel", "replaced", _SIM + "trl.py", _TRL_HEAD, ERROR),
    "trl.triton_cdiv": Reliance(
        "trl", "trl.kernels.chunked_logprob:triton", "replaced", _SIM + "trl.py",
        _TRL_HEAD + " on a machine without Triton", FALLBACK,
        "TRL imports triton only where Triton is installed; elsewhere a stand-in gives its cdiv"),
    "trl.add_fused_lm_head": Reliance(
        "trl", "trl.trainer.utils:add_fused_lm_head", "structure", _SIM + "trl.py", _TRL_HEAD, ERROR),
    "trl.disable_gradient_checkpointing": Reliance(
        "trl", "trl.models.utils:disable_gradient_checkpointing", "private name", _SIM + "trl.py",
        "estimate --trainer dpo|grpo (the reference and old log-probability passes)", ERROR),
    "trl.use_adapter": Reliance(
        "trl", "trl.trainer.utils:use_adapter", "private name", _SIM + "trl.py",
        "estimate --trainer dpo|grpo with LoRA (the reference pass without adapters)", ERROR),
    "trl.step": Reliance(
        "trl", "what SFT, DPO and GRPO run in a step: fused head outputs, boolean-mask row selection, "
        "the autocast query, kernels that allocate nothing", "behaviour", _SIM + "trl.py", _TRL_HEAD, HELD,
        "tests/test_simulator_trl.py::test_simulated_trl_step_matches_real_cpu_allocations"),
    "transformers.find_packed_sequence_indices": Reliance(
        "transformers", "transformers.masking_utils:find_packed_sequence_indices", "replaced",
        _SIM + "stand_ins.py", _MASKS, ERROR),
    "transformers.fast_all": Reliance(
        "transformers", "transformers.masking_utils:fast_all", "replaced", _SIM + "stand_ins.py", _MASKS, ERROR),
    "transformers.sdpa_call": Reliance(
        "transformers", "attention calls torch.nn.functional.scaled_dot_product_attention through the module",
        "behaviour", _SIM + "stand_ins.py", "every simulated step (the flash or efficient kernel on meta)", HELD,
        "tests/test_simulator.py::test_attention_runs_the_cuda_kernel_and_not_the_math_path"),
    "transformers.bnb_quantize": Reliance(
        "transformers", "transformers.integrations.bitsandbytes:Bnb4bitQuantize", "private name",
        _SIM + "four_bit.py", _FOUR_BIT, ERROR),
    "bitsandbytes.gemm_4bit": Reliance(
        "bitsandbytes", "torch.ops.bitsandbytes:gemm_4bit", "replaced", _SIM + "four_bit.py",
        _FOUR_BIT + ": the dequantized weight of each 4-bit product", ERROR),
    "bitsandbytes.name2qmap": Reliance(
        "bitsandbytes", "bitsandbytes.functional:name2qmap", "private name", _SIM + "four_bit.py",
        _FOUR_BIT + ": the process-wide code cache left as found", ERROR),
    "bitsandbytes.params4bit_quantize": Reliance(
        "bitsandbytes", "bitsandbytes.nn:Params4bit._quantize", "private name", _SIM + "four_bit.py",
        _FOUR_BIT, ERROR),
    "liger-kernel.fused_linear_cross_entropy": Reliance(
        "liger-kernel", "liger_kernel.transformers.functional:LigerFusedLinearCrossEntropyFunction", "replaced",
        _SIM + "stand_ins.py", "estimate and bench's +liger modes (Liger's fused loss on meta)", ERROR),
    "liger-kernel.apply_functions": Reliance(
        "liger-kernel", "liger_kernel.transformers.monkey_patch:MODEL_TYPE_TO_APPLY_LIGER_FN", "private name",
        "hf_offload/tools/modes.py", "estimate and bench's +liger modes (Liger applied to the model)", ERROR),
    "transformers.attention_registry": Reliance(
        "transformers", "transformers.modeling_utils:AttentionInterface._global_mapping", "replaced",
        "hf_offload/tiling/attention.py, integrations/sequence_parallel.py, " + _SIM + "stand_ins.py",
        "attention tiled over heads; Ulysses' attention under sequence parallelism; estimate --sp", ERROR),
    "deepspeed.ulysses_layout": Reliance(
        "deepspeed", "UlyssesSPAttentionHF's all-to-all layout and buffers", "behaviour", _SIM + "stand_ins.py",
        "estimate --sp (one rank's all-to-alls)", HELD,
        "tests/test_simulator_parallel.py::"
        "test_one_ulysses_rank_halves_the_per_token_parts_and_sees_the_whole_sequence_in_attention"),
    "transformers.generate_reads": Reliance(
        "transformers", "transformers.generation.utils: generate's reads of tensor values (StopCheck.__call__, "
        "generate, _prepare_special_tokens, _get_logits_processor), answered on meta by function and statement",
        "call stack", _SIM + "generation.py", _GENERATION, HELD,
        "tests/test_generation.py::test_simulated_generation_matches_real_cpu_generate", checked="5.25.0"),
    "transformers.dynamic_cache_growth": Reliance(
        "transformers", "DynamicCache grows each layer by torch.cat every decode step, the same ops each step; "
        "the batch decodes until its last row ends", "behaviour", _SIM + "generation.py",
        _GENERATION + ": the cache's growth extrapolated", HELD,
        "tests/test_generation.py::test_the_check_tells_the_cache_growth_from_the_textbook_formula",
        checked="5.25.0"),
    "trl.grpo_generation_call": Reliance(
        "trl", "GRPOTrainer's generate call: the training model's generate under no_grad in training mode, "
        "checkpointing off, its GenerationConfig (sampling defaults, disable_compile)", "behaviour",
        _SIM + "generation.py", _GENERATION, HELD, "tests/test_generation.py::test_the_generation_config_is_trls"),
    # -- the other tools -------------------------------------------------------------------------
    "trl.activation_offloading": Reliance(
        "trl", "trl.models.activation_offloading:get_act_offloading_ctx_manager", "private name",
        "hf_offload/tools/bench.py, tools/benchmarks/trl_trainers.py", "bench's trl_offload mode", ERROR),
    "transformers.causal_lm_types": Reliance(
        "transformers", "transformers.models.auto.modeling_auto:MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "private name",
        "hf_offload/tools/presets.py", "estimate --model (a config that is no causal LM refused)", ERROR),
    "huggingface-hub.constants": Reliance(
        "huggingface-hub", "huggingface_hub.constants:ENDPOINT", "private name", "hf_offload/tools/presets.py",
        "estimate --model with a hub id (offline told before huggingface_hub retries)", ERROR),
    # -- the product -----------------------------------------------------------------------------
    "transformers.output_collector": Reliance(
        "transformers", "transformers.utils.output_capturing:_active_collector", "private name",
        "hf_offload/integrations/transformers_outputs.py", "tiled MoE MLPs: one router record per layer, with "
        "its gradient (outputs.router_logits, the load-balancing loss)", ERROR),
    "transformers.local_attention_functions": Reliance(
        "transformers", "transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS._local_mapping", "private name",
        "hf_offload/integrations/sequence_parallel.py, tiling/attention.py",
        "unregister_ulysses (Ulysses' attention taken off again)", ERROR),
    # UlyssesGRPOTrainer overrides or swaps these; a name TRL renamed would leave ours uncalled (a silently
    # different step), so the class is not built without them.
    "trl.grpo_train_sampler": Reliance(
        "trl", "trl.trainer.grpo_trainer:GRPOTrainer._get_train_sampler", "replaced",
        _GRPO_ULYSSES, "UlyssesGRPOTrainer (the SP group sampling the same prompts)", ERROR),
    "trl.grpo_repeat_sampler": Reliance(
        "trl", "trl.trainer.utils:RepeatSampler", "private name",
        _GRPO_ULYSSES, "UlyssesGRPOTrainer (the SP group sampling the same prompts)", ERROR),
    "trl.grpo_prepare_inputs": Reliance(
        "trl", "trl.trainer.grpo_trainer:GRPOTrainer._prepare_inputs", "replaced",
        _GRPO_ULYSSES, "UlyssesGRPOTrainer (the SP group shuffling its batch alike)", ERROR),
    "trl.grpo_shuffle": Reliance(
        "trl", "trl.trainer.grpo_trainer:shuffle_sequence_dict", "replaced",
        _GRPO_ULYSSES, "UlyssesGRPOTrainer (the SP group shuffling its batch alike)", ERROR),
    "trl.grpo_generate_and_score": Reliance(
        "trl", "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions", "replaced",
        _GRPO_ULYSSES, "UlyssesGRPOTrainer (advantages over one process per SP group)", ERROR),
    "trl.grpo_compute_loss": Reliance(
        "trl", "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss", "replaced",
        _GRPO_ULYSSES, "UlyssesGRPOTrainer (the loss's normalisation over one process per SP group)", ERROR),
    "trl.grpo_gather": Reliance(
        "trl", "trl.trainer.grpo_trainer:gather", "replaced",
        _GRPO_ULYSSES, "UlyssesGRPOTrainer (TRL's gathers over one process per SP group)", ERROR),
    "trl.grpo_gather_object": Reliance(
        "trl", "trl.trainer.grpo_trainer:gather_object", "replaced",
        _GRPO_ULYSSES, "UlyssesGRPOTrainer (TRL's gathers over one process per SP group)", ERROR),
    "trl.grpo_generate_single_turn": Reliance(
        "trl", "trl.trainer.grpo_trainer:GRPOTrainer._generate_single_turn", "replaced",
        _GRPO_ULYSSES, "UlyssesGRPOTrainer (one generation per SP group, broadcast)", ERROR),
    "trl.grpo_per_token_logps": Reliance(
        "trl", "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies", "replaced",
        _GRPO_ULYSSES, "UlyssesGRPOTrainer (each rank scoring its slice, log-probs gathered over the group)", ERROR),
    "transformers.load_balancing_loss_func": Reliance(
        "transformers", "each MoE modeling module's load_balancing_loss_func, Switch Transformer's loss (checked on "
        "random router logits), replaced in its module while a model is prepared for Ulysses", "replaced",
        "hf_offload/integrations/router_loss.py", "the MoE load-balancing loss under Ulysses, the whole sequence's",
        HELD, "tests/test_linear_attention.py::test_moe_load_balancing_loss_under_ulysses_matches_one_process",
        checked="5.24.0, 5.25.0"),
    "transformers.attn_implementation": Reliance(
        "transformers", "transformers.configuration_utils:PreTrainedConfig._attn_implementation", "private name",
        ATTN_IMPLEMENTATION_USERS,
        "sequence parallelism's check of the attention implementation; attention tiled over heads", ERROR),
    "transformers.loss_function": Reliance(
        "transformers", "transformers.modeling_utils:PreTrainedModel.loss_function (it returns _loss_function)",
        "private name", "hf_offload/tiling/loss.py", "the tiled loss head", FALLBACK,
        "the loss runs untiled, said once (the logits are made whole)"),
    "transformers.checkpointing_layer": Reliance(
        "transformers", "transformers.modeling_layers:GradientCheckpointingLayer", "structure",
        "hf_offload/adapters/generic.py, api.py",
        "finding decoder layers (the generic adapter); the offload scope outside transformers' checkpoint", ERROR),
    "transformers.pretrained_model": Reliance(
        "transformers", "transformers.modeling_utils:PreTrainedModel", "replaced (methods added)",
        "hf_offload/model_methods.py", "model.enable_activation_offloading() and the other model methods",
        FALLBACK, "the methods are not added, said once: hf_offload.enable_activation_offloading(model) and the "
        "other functions work as they do"),
    "kernels.kernelize": Reliance(
        "kernels", "kernelize sets or deletes the forward of the modules it visits; transformers kernelizes "
        "at every train()/eval() that changes the mode", "behaviour", "hf_offload/tiling/__init__.py",
        "tiled norms under transformers' hub kernels", HELD,
        "tests/test_kernels.py::test_tiling_survives_the_kernelize_of_every_train_call"),
    "kernels.kernel_funcs": Reliance(
        "kernels", "kernels:use_kernelized_func (its forward reads self._kernel_funcs)", "behaviour",
        "hf_offload/integrations/kernels.py", "a model built without it refused by name", FALLBACK,
        "not refused: the model fails at its first forward with kernels' own error, as without hf_offload"),
    "trl.fused_forward_frame": Reliance(
        "trl", "add_fused_lm_head's forward, a frame named _fused_forward with the local fused_lm_head",
        "call stack", "hf_offload/integrations/trl.py", "the notice that TRL's fused head, not tiling's, scores "
        "tokens (information only)", HELD,
        "tests/test_trl_tiling.py::test_sft_trainer_tiles_the_final_norm_under_trls_fused_head"),
    "trl.offloading_hooks": Reliance(
        "trl", "trl.models.activation_offloading:OffloadActivations (its hooks' module)", "call stack",
        "hf_offload/integrations/trl.py, api.py", "the warning that TRL's activation offloading is on too",
        FALLBACK, "the warning is not given (both stay exact)"),
    "liger-kernel.forwards": Reliance(
        "liger-kernel", "liger_kernel.transformers.model.llama:lce_forward (its forwards' package)", "structure",
        "hf_offload/integrations/liger.py", "the loss head left to Liger's fused cross-entropy", FALLBACK,
        "the tiled loss wraps Liger's forward, which never calls lm_head: nothing tiled, nothing lost"),
    "peft.base_layer": Reliance(
        "peft", "peft.tuners.lora.layer:LoraLayer.base_layer", "structure", "hf_offload/adapters/base.py",
        "LoRA'd attention projections tiled; the late prefetch point", HELD,
        "tests/test_tiling.py::test_any_order_of_tiling_offloading_and_peft"),
    "peft.autocast_on_the_parameters_device": Reliance(
        "peft", "peft.tuners.lora.layer:_LoraFactorsProxy.forward (torch.autocast(device_type=W.device.type))",
        "behaviour", _SIM + "stand_ins.py (autocast_regions_on_meta)",
        "estimate of a mixture of experts with LoRA on its experts (PEFT >= 0.22: \"meta\" has no autocast)", HELD,
        "tests/test_cli_arguments.py::test_a_mixture_of_experts_with_lora_is_simulated", "0.22.0"),
    "accelerate.shared_state": Reliance(
        "accelerate", "accelerate.state:PartialState._shared_state", "private name",
        "hf_offload/integrations/sequence_parallel.py",
        "check_sequence_parallel: refusing a process count accelerate would get wrong", FALLBACK,
        "that check is skipped, said once"),
    "deepspeed.sequence_parallel_group": Reliance(
        "deepspeed", "deepspeed.runtime.sequence_parallel.parallel_state_sp:_SEQUENCE_PARALLEL_GROUP",
        "private name", "hf_offload/integrations/sequence_parallel.py",
        "register_ulysses, sequence_parallel_loss (the group Ulysses runs in)", ERROR),
    "deepspeed.release_groups": Reliance(
        "deepspeed", "deepspeed.runtime.sequence_parallel.parallel_state_sp:_release_sequence_parallel_groups",
        "private name", "hf_offload/integrations/sequence_parallel.py",
        "register_ulysses again (another model, another batch size)", ERROR),
    "deepspeed.all_to_all": Reliance(
        "deepspeed", "deepspeed.runtime.sequence_parallel.ulysses_sp:_dim_zero_all_to_all", "private name",
        "hf_offload/integrations/sequence_parallel.py",
        "query heads a chunk at a time through Ulysses' exchange (attention tiled over heads)", ERROR),
    "deepspeed.ulysses_attention": Reliance(
        "deepspeed", "deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPAttentionHF", "structure",
        "hf_offload/integrations/sequence_parallel.py",
        "query heads a chunk at a time through Ulysses' exchange: its forward replaced on the instance the "
        "registered function holds in its closure (with world_size, process_group, attn)", FALLBACK,
        "each rank's query heads go through the exchange at once, as DeepSpeed runs them, said once (also where "
        "the instance lacks world_size, process_group or attn)"),
    "deepspeed.all_to_all_counted": Reliance(
        "deepspeed", "deepspeed.runtime.sequence_parallel.ulysses_sp:_dim_zero_all_to_all", "replaced",
        "hf_offload/tools/benchmarks/gpu_multi.py", "the multi-GPU benchmark's count of Ulysses' all-to-alls "
        "(calls and bytes sent)", ERROR),
    "transformers.num_key_value_groups": Reliance(
        "transformers", "attention functions read module.num_key_value_groups to repeat keys and values (sdpa)",
        "behaviour", "hf_offload/tiling/attention.py (key_value_groups), integrations/sequence_parallel.py, "
        + _SIM + "stand_ins.py", "attention over a part of the heads (head tiling, Ulysses' chunks, a rank's "
        "own rows after DeepSpeed set the module's ratio for its exchanged heads): the ratio set for the call "
        "and put back", HELD,
        "tests/test_upstream.py::test_transformers_sdpa_repeats_keys_by_the_modules_num_key_value_groups"),
    "deepspeed.zero3_gradients": Reliance(
        "deepspeed", "ZeRO-3 parameters carry ds_id and reduce once ds_grad_is_ready", "behaviour",
        "hf_offload/tiling/gradients.py", "tiled modules under ZeRO-3", HELD,
        "tests/test_distributed.py::test_sequence_tiling_under_deepspeed_zero3"),
    "bitsandbytes.cpu_inference_repack": Reliance(
        "bitsandbytes", "a 4-bit layer in eval mode without grad repacks its weight in place (CPU, AVX512-BF16)",
        "behaviour", "hf_offload/tiling/replay.py", "tiling a 4-bit base on the CPU", HELD,
        "tests/test_qlora.py::test_bitsandbytes_repacks_for_inference_on_an_eval_forward_without_grad"),
    "transformers.gated_deltanet_structure": Reliance(
        "transformers", "Qwen3.5's and Qwen3-Next's GatedDeltaNet: in_proj_qkvz/in_proj_qkv, in_proj_ba/in_proj_a/b, "
        "conv1d, A_log, dt_bias, norm, out_proj, and its module's apply_mask_to_padding_states, causal_conv1d_fn, "
        "torch_chunk_gated_delta_rule", "structure", "hf_offload/integrations/linear_attention.py",
        "Gated DeltaNet across the SP ranks (its forward, re-run a rank's heads at a time)", HELD,
        "tests/test_linear_attention.py::test_hybrids_under_ulysses_match_one_process", "5.24.0, 5.25.0"),
    **{
        f"transformers.{module}.{function}": Reliance(
            "transformers", f"transformers.models.{module}.modeling_{module}:{name}", "replaced",
            _SIM + "linear_attention.py", _LINEAR_ATTENTION, ERROR)
        for module in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
        for function, name in (("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
                               ("causal_conv1d_fn", "causal_conv1d_fn"))
    },
}  # fmt: skip


class UpstreamChanged(RuntimeError):
    """Another library no longer has what hf_offload relies on (an INVENTORY entry)."""


def installed_version(library: str) -> str:
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _split(entry: Reliance) -> tuple[str, list[str]]:
    module, _, path = entry.name.partition(":")
    return module, [part for part in path.split(" ")[0].split(".") if part]


def _owner_and_attribute(entry_id: str) -> tuple[object, str]:
    """The object holding the entry's last name, and that name; raises UpstreamChanged."""
    entry = INVENTORY[entry_id]
    module_name, path = _split(entry)
    if not path:
        raise ValueError(f"inventory entry {entry_id!r} names a behaviour, not something to look up")
    try:
        owner = _import(module_name)
        for part in path[:-1]:
            owner = getattr(owner, part)
    except (ImportError, AttributeError) as error:
        raise UpstreamChanged(_changed_message(entry_id, f"{type(error).__name__}: {error}")) from None
    if not hasattr(owner, path[-1]):
        raise UpstreamChanged(_changed_message(entry_id, f"no attribute {path[-1]!r} on {module_name}"))
    return owner, path[-1]


def _import(module_name: str) -> object:
    if module_name.startswith("torch.ops."):  # a custom-op namespace, filled when its library is imported
        import torch

        namespace = torch.ops
        for part in module_name.split(".")[2:]:
            namespace = getattr(namespace, part)
        return namespace
    return importlib.import_module(module_name)


def _changed_message(entry_id: str, detail: str) -> str:
    entry = INVENTORY[entry_id]
    module, path = _split(entry)
    name = f"{module}.{'.'.join(path)}" if path else entry.name
    return (
        f"hf_offload: {entry.feature} relies on {entry.library} {installed_version(entry.library)}'s {name} "
        f"({entry.kind}), which this install does not have ({detail}); it was checked on {entry.library} "
        f"{entry.versions}. Install one of those versions, or an hf_offload that knows this one (inventory entry "
        f"{entry_id!r}, docs/upstream.md)"
    )


def resolve(entry_id: str) -> object:
    """The entry's name in the installed library; UpstreamChanged if it has none."""
    owner, attribute = _owner_and_attribute(entry_id)
    return getattr(owner, attribute)


def present(entry_id: str) -> bool:
    """Whether the installed library has the entry's name (for a FALLBACK entry)."""
    try:
        _owner_and_attribute(entry_id)
    except UpstreamChanged:
        return False
    return True


_announced: set[str] = set()


def announce(entry_id: str) -> None:
    """Say once per process that a FALLBACK entry's name is missing and what happens instead."""
    if entry_id in _announced:
        return
    _announced.add(entry_id)
    entry = INVENTORY[entry_id]
    logger.warning(
        "hf_offload: %s %s has no %s: %s (%s; checked on %s %s; docs/upstream.md)",
        entry.library,
        installed_version(entry.library),
        entry.name,
        entry.missing,
        entry.feature,
        entry.library,
        entry.versions,
    )


@contextlib.contextmanager
def replaced(entry_id: str, value: object) -> Iterator[object]:
    """Within this block the entry's name is `value` (a stand-in); yields what it was. Raises
    UpstreamChanged first if the installed library lacks the name: a stand-in set beside a renamed
    original would be left unused while the original runs."""
    owner, attribute = _owner_and_attribute(entry_id)
    original = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        yield original
    finally:
        setattr(owner, attribute, original)


def unchecked_versions() -> dict[str, str]:
    """The installed libraries of the inventory whose version no entry was checked on: where a new
    release may have moved something (the tests say whether it did)."""
    found = {}
    for library in CHECKED:
        version = installed_version(library)
        checked = {v for entry in INVENTORY.values() if entry.library == library for v in entry.versions.split(", ")}
        if not version.startswith("(") and version not in checked:
            found[library] = version
    return found


def table() -> str:
    """The inventory as a markdown table (docs/upstream.md holds it)."""
    rows = [
        "| entry | library (checked on) | what | kind | our use | what depends on it | when it is missing |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry_id, entry in INVENTORY.items():
        when = {ERROR: "clear error (UpstreamChanged)", FALLBACK: f"fallback: {entry.missing}"}.get(
            entry.when_missing, f"held by `{entry.missing}`"
        )
        rows.append(
            f"| `{entry_id}` | {entry.library} ({entry.versions}) | `{entry.name}` | {entry.kind} | {entry.used_by} "
            f"| {entry.feature} | {when} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
