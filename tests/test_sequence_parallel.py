"""Sequence parallelism on DeepSpeed's Ulysses with hf_offload's offloading and tiling.

One launch of tests/sequence_parallel_worker.py (`torchrun --nproc-per-node 2`, gloo, CPU) runs
every scenario and writes what each rank saw; the tests below assert on it. Each scenario
splits the sequences of a tiny GQA Llama across the two ranks (SP=2) and compares with one
process training on the whole sequences: the loss of every micro-batch and every gradient, in
float64 where nothing forces float32 (transformers computes the loss in float32, DeepSpeed
reduces in float32). The bad-input checks that need no process group run here, in-process.
"""

from __future__ import annotations

import sys

import pytest
from conftest import tiny_model
from test_distributed import NPROC, launch

from hf_offload.integrations import sequence_parallel as sp

# The tiny Llama's 4 query heads and 2 key/value heads on 2 ranks, attention tiled over heads under
# accelerate's and the Trainer's Ulysses: per attention call 2 query chunks, the key, the value and 2
# output chunks (DeepSpeed's call: 4), in forward and the recompute, 3 layers, 4 micro-batches.
CHUNKED_EXCHANGES = (2 + 2 + 2) * 2 * 3 * 4
LAUNCH_TIMEOUT = 600  # seconds: a hang's guard (the suite's machine is shared; the launches take 1-3 min)
# float64 runs: the gradients agree to rounding; the loss, which transformers computes in float32,
# to float32's. float32 runs (DeepSpeed): both to float32's.
FLOAT64_GRAD = 1e-12
FLOAT32_GRAD = 1e-5
LOSS = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("sequence_parallel") / "results.json"
    # Every scenario in one launch: ~2.5 min on 2 idle cores; the timeout guards against a hang.
    return launch("sequence_parallel_worker.py", out, env={"DS_ACCELERATOR": "cpu"}, timeout=LAUNCH_TIMEOUT)


# The head-chunk scenarios on 4 ranks too (each rank 2 of the 8 query heads; fewer key/value heads
# than ranks at ratios 4 and 8, repeated as DeepSpeed repeats them): one launch of its own.
CHECKPOINTED = ("reentrant", "non_reentrant")
FOUR_RANK_SCENARIOS = "head_chunks_checkpointed,head_chunks_refusal"


@pytest.fixture(scope="module")
def runs_on_four(tmp_path_factory) -> dict[str, list[dict]]:
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("sequence_parallel_4") / "results.json"
    return launch(
        "sequence_parallel_worker.py", out, "--scenarios", FOUR_RANK_SCENARIOS, env={"DS_ACCELERATOR": "cpu"}, nproc=4,
        timeout=LAUNCH_TIMEOUT,
    )


def assert_matches_one_process(ranks: list[dict], grad_tolerance: float) -> None:
    assert len(ranks) == NPROC
    for rank, result in enumerate(ranks):
        assert "error" not in result, result.get("traceback", result.get("error"))
        assert result["steps"] == 4, result  # 2 batches per rank, each split across both ranks
        assert result["same_grad_names"]
        assert result["loss_rel"] < LOSS, f"rank {rank}: losses {result['losses']} != {result['reference_losses']}"
        assert result["grad_rel"] < grad_tolerance, f"rank {rank}: {result['worst']} off by {result['grad_rel']:.2e}"
    # Both ranks report the whole sequence's loss.
    assert ranks[0]["losses"] == ranks[1]["losses"]


def assert_offloading_bit_identical(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["offloaded_identical"], "offloading changed the SP run"
        stats = result["stats"]
        assert stats["mode"] == "cpu-simulation" and stats["offloaded_tensors"] > 0
        assert stats["restored_tensors"] >= stats["offloaded_tensors"] and stats["host_bytes_held"] == 0


@pytest.mark.parametrize(
    "scenario",
    ["loop", "loop_checkpointing_tiling", "peft", "ddp", "fsdp2"],
)
def test_sequence_parallel_matches_one_process_in_float64(runs, scenario):
    """A loop of one's own on register_ulysses / Ulysses.adapt / Ulysses.loss, float64: plain;
    with checkpointing and tiling; LoRA with offloading, LoRA, tiling and checkpointing enabled
    in that order; under DDP (tiling); under FSDP2 (checkpointing and tiling). The second local
    batch is 15 tokens long and is padded to 16. Loss and every gradient match one process on
    the whole sequences, and offloading on top is bit-identical."""
    ranks = runs[scenario]
    assert_matches_one_process(ranks, FLOAT64_GRAD)
    assert_offloading_bit_identical(ranks)
    for result in ranks:
        assert result["dtype"] == "torch.float64"
        assert result["tiled"] == (scenario not in ("loop",))


def test_sequence_parallel_matches_one_process_in_float32(runs):
    assert_matches_one_process(runs["loop_float32"], FLOAT32_GRAD)


def test_a_loss_not_aggregated_over_the_sp_group_is_caught(runs):
    """Companion: each rank backpropagating the mean over its own shard, as the tiled loss head
    reports it without the group's count, trains on another gradient; the comparison above sees it."""
    for result in runs["unaggregated"]:
        assert "error" not in result, result.get("traceback")
        assert result["grad_rel"] > 0.05 and result["loss_rel"] > 1e-4


def test_a_shard_without_labelled_tokens_contributes_zero(runs):
    """Rank 0's shard holds no labelled token (an SFT prompt longer than a shard): the group's
    count divides, so its share is 0, not 0/0, with the tiled loss."""
    assert_matches_one_process(runs["masked_shard"], FLOAT64_GRAD)
    assert all(result["finite"] for result in runs["masked_shard"])


@pytest.mark.parametrize("scenario", ["zero3", "zero3_offload_to_host", "zero1"])
def test_sequence_parallel_under_the_deepspeed_engine(runs, scenario):
    """The DeepSpeed engine with Ulysses's mpu: ZeRO-3 with tiling; ALST's full fine-tuning
    recipe (ZeRO-3 with parameters and optimizer state offloaded to the host, our checkpoint
    offload and tiling); ZeRO-1. Close to one process, offloading on top bit-identical."""
    ranks = runs[scenario]
    assert_matches_one_process(ranks, FLOAT32_GRAD)
    assert_offloading_bit_identical(ranks)
    for result in ranks:
        assert result["tiled"]
        if scenario.startswith("zero3"):
            assert result["zero_optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
            assert result["offload_param"] == (scenario == "zero3_offload_to_host")


def test_zero1_gradients_would_be_sp_size_times_too_large_without_the_engine_check(runs):
    """Companion of zero1: ZeRO-1/2 sum the SP ranks' gradients where ZeRO-3 averages them over
    all ranks. Scaled as for ZeRO-3, every gradient is twice the true one (SP=2)."""
    for result in runs["zero1_scaled_for_averaging"]:
        assert "error" not in result, result.get("traceback")
        assert result["grad_rel_per_step"][0] == pytest.approx(1.0, rel=1e-4)


def test_sequence_parallel_through_accelerate(runs):
    """Accelerator(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)) with a
    ZeRO-3 plugin: prepare registers Ulysses and adapts the loader, sequence_parallel_loss finds
    DeepSpeed's SP group; checkpointing and tiling (query heads a chunk at a time through the
    exchange, under the registration accelerate made), offloading on top bit-identical."""
    ranks = runs["accelerate"]
    assert_matches_one_process(ranks, FLOAT32_GRAD)
    assert_offloading_bit_identical(ranks)
    assert all(result["engine"] == "DeepSpeedEngine" for result in ranks)
    assert all(result["exchanges"] == CHUNKED_EXCHANGES for result in ranks)


@pytest.mark.parametrize("scenario", ["trainer", "trl"])
def test_sequence_parallel_through_the_trainer_and_trl(runs, scenario):
    """TrainingArguments / SFTConfig(deepspeed=ZeRO-3, parallelism_config=...): the Trainer (or TRL's
    SFTTrainer) registers Ulysses, adapts its loader and sums the ranks' losses. With our
    checkpoint offload and tiling (TRL: its fused LM head computes the loss, the layers' parts
    are tiled; the query heads a chunk at a time through the exchange the Trainer registered):
    the logged losses and the final weights match one process on the same whole micro-batches,
    and offloading on top is bit-identical."""
    for result in runs[scenario]:
        assert "error" not in result, result.get("traceback")
        assert result["steps"] == result["micro_batches"] == 4
        assert result["loss_rel"] < LOSS, (result["losses"], result["reference_losses"])
        assert result["weights_rel"] < FLOAT32_GRAD, result["worst"]
        assert_offloading_bit_identical([result])
        assert result["exchanges"] == CHUNKED_EXCHANGES


def test_batches_ulysses_would_train_on_differently_are_refused_on_every_rank(runs):
    """Packed documents under sdpa (refused on both ranks although only rank 1's batch is packed:
    neither waits for the other in a collective), left padding, a batch of the wrong size, a
    loader whose last batch would be short, a world size sp_size does not divide, a batch
    without position_ids or shift_labels, a model in eval mode under Ulysses as accelerate
    registers it (off in eval mode: each rank would attend within its shard), accelerate counting
    one process of two (on the CPU without being told: every rank would get the whole loader):
    each a ValueError saying what to do."""
    for rank, result in enumerate(runs["refusals"]):
        errors = result["errors"]
        expected = {
            "packed_on_one_rank": "position_ids restart" if rank == 1 else "SP rank(s) [1] refused",
            "left_padding": "pad on the right",
            "rows": "micro_batch_size=2",
            "batch_size": "register_ulysses(model, sp_size, micro_batch_size=3)",
            "last_batch": "drop_last=True",
            "world_size": "sp_size=4 does not divide the world size 2",
            "no_position_ids": "no position_ids",
            "no_shift_labels": "no shift_labels",
            "eval_mode": "Call model.train()",
            "accelerate_one_process": "accelerate counts 1 process(es) of the world's 2",
        }
        for key, text in expected.items():
            assert errors[key] is not None and errors[key].startswith("ValueError") and text in errors[key], (
                key,
                errors[key],
            )


def test_ranks_holding_the_same_batches_are_refused(runs):
    """Every rank loading the same batches (a DataLoader without a DistributedSampler) would train
    each row once per rank: refused on both ranks once the first two batches of the pass matched,
    naming the sampler and the way to allow it; allowed, the same batches train. A first batch the
    same by chance and a second different is not refused, nor are batches of their own; a loader
    of one batch is decided on it."""
    for result in runs["identical_batches"]:
        assert "error" not in result, result.get("traceback")
        same = result["same"]
        assert same["steps"] == 2 and same["error"].startswith("ValueError"), same  # after the first batch's 2 steps
        for text in ("SP ranks [0, 1] hold the same batches", "DistributedSampler(dataset, drop_last=True)",
                     "allow_identical_batches=True"):  # fmt: skip
            assert text in same["error"]
        assert result["one_batch"]["steps"] == 0 and "hold the same batches" in result["one_batch"]["error"]
        for key in ("same_allowed", "first_by_chance", "own"):
            assert result[key] == {"steps": 4, "error": None}, (key, result[key])


def test_the_docs_recipes_train_every_row_once_as_one_process_would(runs):
    """docs/sequence_parallel.md's loop, accelerate and Trainer recipes, run as written there on 2
    CPU ranks: the 4 rows are each trained once (without the DistributedSampler, use_cpu=True or
    PartialState(cpu=True) each would be trained twice), and each micro-batch's loss is one
    process's on the same rows with the recipe's optimizer (the Trainer: the first micro-batch's)."""
    for rank, result in enumerate(runs["docs_recipes"]):
        assert "error" not in result, result.get("traceback")
        for recipe in ("loop", "accelerate", "trainer"):
            run = result[recipe]
            assert run["rows_once"] and run["micro_batches"] == 4, (rank, recipe, run)
            assert run["loss_rel"] < 1e-5, (rank, recipe, run["losses"], run["reference_losses"])


def test_tiling_enabled_after_register_ulysses_tiles_the_heads_inside_it(runs):
    """register_ulysses hands DeepSpeed a function that looks transformers' attention up at each
    call: tiling enabled afterwards reaches every attention call (2 key/value heads per rank, split
    in 2 groups), and loss and gradients still match one process. Before, Ulysses called the
    function it found at registration and the heads ran whole."""
    for result in runs["late_tiling"]:
        assert "error" not in result, result.get("traceback")
        assert result["head_tiled_calls"] > 0
        assert result["loss_rel"] < LOSS and result["grad_rel"] < FLOAT64_GRAD, result["worst"]


def test_unregister_ulysses_leaves_the_attention_registry_as_it_was(runs):
    """DeepSpeed registers Ulysses in ALL_ATTENTION_FUNCTIONS's own mapping; unregistering removes
    that entry (an entry left there, even the original function, shadows a later
    AttentionInterface.register), and puts back an override that was there before."""
    for result in runs["attention_registry"]:
        assert "error" not in result, result.get("traceback")
        assert result["registered_locally"] and not result["left_behind"]
        assert result["later_registration_seen"] and result["override_restored"]


def test_the_multi_gpu_script_runs_on_the_cpu(runs):
    """hf_offload/tools/benchmarks/gpu_multi.py --cpu-smoke (ZeRO-3 with parameters and optimizer
    on the host, Ulysses over both ranks): every mode and length measured, the same losses with
    our offloading as without, tiling close, the tiled mode's query heads a chunk at a time (more
    all-to-alls than with the rank's heads at once, the same bytes), the JSON written; each row
    names the estimate command that simulates it."""
    for rank, result in enumerate(runs["gpu_multi_smoke"]):
        assert "error" not in result, result.get("traceback")
        rows = {(row["mode"], row["length"]): row for row in result["rows"]}
        modes = ("sp", "sp+hf_offload", "sp+hf_offload+tiled+whole_heads", "sp+hf_offload+tiled")
        assert set(rows) == {(mode, length) for mode in modes for length in (32, 64)}
        for length in (32, 64):
            plain, offloaded, whole, chunked = (rows[(mode, length)] for mode in modes)
            assert all(row["status"] == "ok" and row["step_seconds"] > 0 for row in (plain, offloaded, whole, chunked))
            assert offloaded["losses"] == plain["losses"] and offloaded["offloaded_bytes"] > 0
            for tiled in (whole, chunked):
                assert tiled["losses"] == pytest.approx(plain["losses"], rel=1e-5)
            assert chunked["all_to_all_sent_bytes"] == whole["all_to_all_sent_bytes"] > 0
            assert chunked["all_to_alls"] > whole["all_to_alls"] == plain["all_to_alls"]
            assert plain["peak_bytes"] is None  # CPU: no peak
            assert chunked["simulated"].startswith("hf-offload estimate --preset tiny ")
            assert "--sp 2 --seq-len" in chunked["simulated"]
            assert "--tile-heads 4" in whole["simulated"] and "--tile-heads" not in chunked["simulated"]
        assert result["written"] is (True if rank == 0 else None)


@pytest.mark.parametrize("ranks", [2, 4])
def test_query_heads_a_chunk_at_a_time_through_the_exchange_match_one_process(request, ranks):
    """Attention tiled over heads under Ulysses: each rank's query heads go through the all-to-all
    a chunk at a time (one query head per chunk, as tiling chooses, and 2 where a rank has more),
    at grouped-query ratios 1, 4 and 8 (at ratio 8, and at 4 on 4 ranks, fewer key/value heads
    than ranks), without checkpointing and with reentrant and non-reentrant checkpointing, in
    float64: loss and gradients of one process. It is chunked (more collectives than DeepSpeed's
    call) and sends the bytes DeepSpeed's call sends, each key/value head once per pass; with
    offloading on top (2 ranks), bit-identical."""
    if ranks == 2:
        results, checkpointing = request.getfixturevalue("runs")["head_chunks"], ("none", "reentrant", "non_reentrant")
    else:  # without checkpointing on 2 ranks only: 4 processes on the suite's 2 cores are slow
        results, checkpointing = request.getfixturevalue("runs_on_four")["head_chunks_checkpointed"], CHECKPOINTED
    assert len(results) == ranks
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("traceback")
        configs = {name: config for name, config in result.items() if name != "seconds"}
        expected = {f"ratio {r}, {c}, tile_heads None" for r in (1, 4, 8) for c in checkpointing}
        if ranks == 2:
            expected |= {f"ratio {r}, non_reentrant, tile_heads 2" for r in (1, 4, 8)}
        assert set(configs) == expected
        for name, config in configs.items():
            where = f"rank {rank}, {name}"
            assert config["steps"] == 2 * ranks and config["same_grad_names"], where  # 2 batches per rank
            assert config["loss_rel"] < LOSS, (where, config["losses"], config["reference_losses"])
            assert config["grad_rel"] < FLOAT64_GRAD, (where, config["worst"], config["grad_rel"])
            assert config["exchanges"] > config["deepspeed_exchanges"], where  # chunked, not DeepSpeed's call
            # Counted in forward and in the recompute (once per pass): without checkpointing, one pass of two.
            passes = 1 if ", none," in name else 2
            assert config["sent_bytes"] * 2 == config["deepspeed_sent_bytes"] * passes, where
            if "offloaded_identical" in config:
                assert config["offloaded_identical"], where
        assert any("offloaded_identical" in config for config in configs.values()) == (ranks == 2)


def test_the_chunked_exchange_gives_the_gradient_of_the_reported_loss(runs):
    """transformers reports the loss in float32: along a random direction of the weights, the
    chunked run's directional derivative is the central difference of the loss the SP group
    reports (ratio 4, one query head per chunk, non-reentrant checkpointing)."""
    for result in runs["head_chunks_finite_difference"]:
        assert "error" not in result, result.get("traceback")
        assert result["rel"] < 0.01, result


def test_chunks_attending_with_the_wrong_key_values_are_caught(runs):
    """Companion of the parity above: every chunk attending with its rank's first key/value head
    (a head kept past its query heads) trains on another gradient, and the comparison sees it."""
    for result in runs["head_chunks_wrong_key_values"]:
        assert "error" not in result, result.get("traceback")
        assert result["grad_rel"] > 0.05 and result["loss_rel"] > 1e-4, result


@pytest.mark.parametrize("ranks", [2, 4])
def test_padding_is_refused_with_chunked_heads_as_without(request, ranks):
    """Left padding (which Ulysses, dropping the mask, would attend to) is refused by Ulysses.adapt
    with attention tiled over heads as without; a sequence padded at its end to a multiple of the
    ranks trains (the 15-token batches of the parity runs)."""
    for result in request.getfixturevalue("runs" if ranks == 2 else "runs_on_four")["head_chunks_refusal"]:
        assert "error" not in result, result.get("traceback")
        assert result["left_padding"].startswith("ValueError") and "pad on the right" in result["left_padding"]


# --- bad input, in this process ---------------------------------------------------------------


def config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{"hidden_size": 96, "intermediate_size": 64, "num_hidden_layers": 1, **overrides})


def test_attention_heads_not_divisible_by_the_sp_size():
    six_heads = config(num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"sp_size=4 does not divide num_attention_heads=6.*valid sp_size.*\[2, 6\]"):
        sp.check_sequence_parallel(six_heads, 4)


def test_key_value_heads_and_sp_size_must_divide_one_another():
    with pytest.raises(ValueError, match=r"sp_size=6 and num_key_value_heads=4.*\[2, 4, 12\]"):
        sp.check_sequence_parallel(config(num_attention_heads=12, num_key_value_heads=4), 6)
    # Fewer key/value heads than ranks: Ulysses repeats them.
    assert sp.check_sequence_parallel(tiny_model("llama", num_key_value_heads=2), 4) == "sdpa"


def test_eager_attention_is_refused():
    model = tiny_model("llama", attn_implementation="eager")
    with pytest.raises(ValueError, match=r"'eager', which Ulysses cannot wrap.*attn_implementation='sdpa'"):
        sp.check_sequence_parallel(model, 2)


@pytest.mark.parametrize("bad", [1, 0, 2.0, True, "2"])
def test_sp_size_must_be_an_int_of_at_least_two(bad):
    with pytest.raises(ValueError, match=r"sp_size must be an int >= 2"):
        sp.check_sequence_parallel(tiny_model("llama"), bad)


def test_world_size_must_be_a_multiple_of_the_sp_size():
    with pytest.raises(ValueError, match=r"sp_size=2 does not divide the world size 3"):
        sp.check_sequence_parallel(tiny_model("llama"), 2, world_size=3)


def test_without_deepspeed_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    with pytest.raises(ImportError, match=r'pip install "hf-offload\[sp\]"'):
        sp.register_ulysses(tiny_model("llama"), 2)


def test_without_a_process_group_the_error_says_how_to_launch():
    pytest.importorskip("deepspeed")
    with pytest.raises(RuntimeError, match=r"torchrun.*init_process_group"):
        sp.register_ulysses(tiny_model("llama"), 2)


def test_on_the_cpu_deepspeed_communication_is_asked_for_before_accelerate_asserts(monkeypatch):
    """A process launched with two ranks on the CPU whose DeepSpeed communication is not set up
    (the Trainer and accelerate set up only torch's group there): the error names the call to
    make, where DeepSpeed's prepare would fail on a bare assert. Companion: once set up, the check
    passes."""
    pytest.importorskip("deepspeed")
    from deepspeed import comm

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delitem(sys.modules, "accelerate.state", raising=False)  # no accelerate state of other tests
    monkeypatch.setattr(sp.torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(comm, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"deepspeed\.init_distributed\(dist_backend='gloo'\) first"):
        sp.check_sequence_parallel(tiny_model("llama"), 2)
    monkeypatch.setattr(comm, "is_initialized", lambda: True)
    assert sp.check_sequence_parallel(tiny_model("llama"), 2) == "sdpa"


def test_a_chunk_size_the_rank_heads_do_not_allow_is_refused_by_name():
    from hf_offload.tiling.ulysses_heads import plan_chunks

    plan = plan_chunks(32, 8, 8)  # Llama-3-8B on 8 ranks: 4 query heads and 1 key/value head each
    assert (plan.rank_heads, plan.rank_kv_heads, plan.heads_per_chunk, plan.chunks) == (4, 1, 1, 4)
    assert plan_chunks(32, 8, 32).replication == 4  # 32 ranks: each key/value head to 4 of them
    with pytest.raises(ValueError, match=r"tile_heads=3 under Ulysses over 8 ranks: each rank computes 4 query heads "
                       r"with 1 key/value head\(s\).*valid tile_heads here: \[1, 2, 4\]"):  # fmt: skip
        plan_chunks(32, 8, 8, heads_per_chunk=3)
    with pytest.raises(ValueError, match=r"valid tile_heads here: \[1, 2, 4, 8\]"):  # 8 query, 4 key/value heads
        plan_chunks(32, 16, 4, heads_per_chunk=6)


def test_a_model_without_a_transformers_config_is_refused():
    import torch

    with pytest.raises(TypeError, match=r"transformers model"):
        sp.check_sequence_parallel(torch.nn.Linear(2, 2), 2)


# --- what is not one sequence split across the group (issue 48) ---------------------------------
OWN_ROWS_MODES = ("none", "reentrant", "non_reentrant")


@pytest.mark.parametrize("mode", OWN_ROWS_MODES)
def test_a_ranks_own_rows_run_as_one_process_under_register_ulysses(runs, mode):
    """After register_ulysses, a rank's own rows, whole (generate, evaluation, TRL's preference and
    online trainers' batches) attend locally: greedy generate with and without a KV cache, in training
    and eval mode, gives one process's tokens (never DeepSpeed's shape assertion); a DPO-like step on
    each rank's own pairs (right-padded rejected rows) gives one process's loss and gradients, and the
    rows' eval loss under no_grad (what evaluate() computes) one process's, with checkpointing as named
    (tiling over heads on)."""
    for rank, ranks in enumerate(runs["own_rows"]):
        assert "error" not in ranks, ranks.get("traceback")
        result = ranks[mode]
        assert all(result["same_tokens"].values()), f"rank {rank}: {result['same_tokens']}"
        assert result["loss_rel"] == 0.0 and result["eval_loss_rel"] == 0.0 and result["grad_rel"] == 0.0, result


def test_a_rank_scoring_another_ranks_rows_is_caught(runs):
    """Companion: the exchange forced on for the own rows (as before the gate) makes the ranks'
    different rows halves of one sequence: the comparison above sees the gradients move on every
    rank and rank 1's loss."""
    ranks = runs["own_rows"]
    assert all(result["forced_exchange"]["grad_rel"] > 0.1 for result in ranks)
    assert ranks[1]["forced_exchange"]["loss_rel"] > 1e-4 and ranks[1]["forced_exchange"]["eval_loss_rel"] > 1e-4


@pytest.mark.parametrize("scenario", ["interleaved", "interleaved_reentrant"])
def test_shards_still_go_through_the_exchange_between_own_forwards(runs, scenario):
    """Adapted training with a cached generate on each rank's own prompts between every shard's
    forward and its backward (one key/value head: DeepSpeed repeats it and sets the module's
    grouped-query ratio for its heads): the checkpoint's recompute exchanges again, and the losses
    and gradients are one process's on the whole sequences."""
    ranks = [result[scenario] for result in runs["own_rows"]]
    assert_matches_one_process(ranks, FLOAT64_GRAD)


def test_a_recompute_that_forgets_its_forwards_decision_is_caught(runs):
    """Companion: a reentrant checkpoint's recompute not finding its forward's decision attends
    locally, and the gradients are no longer one process's (non-reentrant checkpointing refuses it
    itself: the recompute saves other tensors)."""
    for result in runs["own_rows"]:
        assert result["recompute_forgotten"]["grad_rel"] > 0.1


def test_trls_dpo_trainer_after_register_ulysses_trains_each_ranks_own_pairs_as_one_process(runs):
    """TRL's DPOTrainer combined with register_ulysses (DDP, every rank its own pair, one SGD step):
    each rank's loss is TRL's own compute_loss replayed on one process at the starting weights on the
    inputs that rank scored, and the gradients the optimizer steps with are the replays' averaged over
    the ranks, exactly. Companion: with the exchange forced on (as before the gate) every gradient
    moves; the loss does not (log 2 at step 0, the policy equal to its reference), as the issue saw."""
    for result in runs["dpo_trainer"]:
        assert "error" not in result, result.get("traceback")
        plain, forced = result["plain"], result["forced_exchange"]
        assert plain["rows"] == 2 and plain["loss_rel"] == 0.0 and plain["grad_rel"] == 0.0, plain
        assert forced["grad_rel"] > 0.1, forced


def test_a_kv_cache_reaching_accelerates_ulysses_exchange_is_refused_by_name():
    """Under accelerate's or the Trainer's Ulysses (attention tiled over heads, so that our forward runs
    in DeepSpeed's place), a decoding step of generate in training mode (keys longer than queries)
    is refused naming generate and what to do, not DeepSpeed's bare shape assertion; in eval mode with
    disable_in_eval, and for calls whose keys are the queries' length, nothing is refused."""
    import types

    import torch

    module = torch.nn.Linear(1, 1)
    ulysses = types.SimpleNamespace(disable_in_eval=True)
    query, cached, whole = torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 7, 4), torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match=r"KV cache .*generate.*model\.eval\(\) before generate"):
        sp._check_no_kv_cache(ulysses, module.train(), query, cached)
    sp._check_no_kv_cache(ulysses, module.eval(), query, cached)
    sp._check_no_kv_cache(ulysses, module.train(), query, whole)
    with pytest.raises(ValueError, match="KV cache"):
        sp._check_no_kv_cache(types.SimpleNamespace(disable_in_eval=False), module.eval(), query, cached)


def test_a_shard_is_recognised_by_value_not_by_the_tensor_object(monkeypatch):
    """The rule's signal (docs/sequence_parallel.md): a forward is the shard adapt yielded when its
    input_ids and position_ids equal that batch's, so a copy (the Trainer moving the batch to a GPU
    makes a new tensor) still counts; a forward with a KV cache, other tokens, other positions or no
    position_ids is a rank's own rows; once adapt's pass ends, nothing is a shard."""
    import torch

    monkeypatch.setattr(sp, "_SHARD", {})
    ids, positions = torch.arange(8).view(2, 4), torch.arange(4, 8).repeat(2, 1)
    sp.arm_shard({"input_ids": ids, "position_ids": positions, "shift_labels": ids})
    assert sp._is_shard(ids.clone(), positions.clone(), None)
    assert not sp._is_shard(ids, positions, object())  # generate's cache
    assert not sp._is_shard(ids + 1, positions, None)
    assert not sp._is_shard(ids, positions - 4, None)  # the same tokens as a rank's own whole rows
    assert not sp._is_shard(ids, None, None)
    sp.disarm_shard()
    assert not sp._is_shard(ids, positions, None)


def test_trls_grpo_trainer_after_register_ulysses_trains_each_ranks_own_completions_as_one_process(runs):
    """TRL's GRPOTrainer combined with register_ulysses (DDP, every rank its own prompt, 2 generations
    each through transformers' generate, one SGD step): each rank's loss and the gradients the optimizer
    steps with equal TRL's own compute_loss replayed on one process at the starting weights on the
    completions, advantages and old log-probabilities that rank scored, averaged over the ranks.
    Companion: the exchange forced on for the grad-enabled (loss) forward, as before the gate, moves
    the gradients (the loss is ~0 either way: DAPO with old log-probs equal to the new, as the issue saw)."""
    for result in runs["grpo_trainer"]:
        assert "error" not in result, result.get("traceback")
        plain, forced = result["plain"], result["forced_exchange"]
        assert any(abs(a) > 0.1 for a in plain["advantages"]), plain  # a gradient to compare
        assert plain["loss_rel"] == 0.0 and plain["grad_rel"] == 0.0, plain
        assert forced["grad_rel"] > 0.1, forced
