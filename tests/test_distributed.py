"""Distributed training launched the way users launch it: `torchrun --standalone --nproc-per-node 2`
(invoked as `python -m torch.distributed.run`), two CPU processes, gloo.

One launch of tests/distributed_worker.py runs every scenario (DDP, FSDP1, FSDP2, accelerate's
DDP wrapper) and writes what each rank saw to a JSON file; the tests below assert on it. DeepSpeed
ZeRO-3 gets a launch of its own, only where deepspeed is installed. Each
scenario compares an offloaded model with an identical plain one in the same processes, so
both go through the same collectives. The examples are launched separately, as their
docstrings say.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from transformers.utils import is_kernels_available

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
NPROC = 2
TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(script: Path, *args: str, timeout: int = TIMEOUT, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a single node; the rendezvous binds a free port itself
        "--nproc-per-node",
        str(NPROC),
        str(script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def launch(script: str, out: Path, *args: str, env: dict | None = None) -> dict[str, list[dict]]:
    """Run a worker script under torchrun; what it wrote: {scenario: [rank 0's result, rank 1's]}."""
    result = torchrun(TESTS / script, "--out", str(out), *args, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == NPROC
    by_scenario: dict[str, list[dict]] = {}
    for rank in sorted(data["ranks"], key=lambda r: r["rank"]):
        for name, scenario in rank["results"].items():
            by_scenario.setdefault(name, []).append(scenario)
    return by_scenario


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """{scenario: [rank 0's result, rank 1's result]}"""
    return launch("distributed_worker.py", tmp_path_factory.mktemp("distributed") / "results.json")


def assert_parity_and_engaged(ranks: list[dict]) -> None:
    assert len(ranks) == NPROC
    for rank, result in enumerate(ranks):
        assert "error" not in result, result.get("traceback", result.get("error"))
        assert result["losses_equal"], f"rank {rank}: losses {result['losses']} != {result['plain_losses']}"
        assert result["same_grad_names"] and result["grad_names"], f"rank {rank}: no or different gradients"
        assert not result["grads_differing"], f"rank {rank}: gradients differ for {result['grads_differing'][:5]}"
        assert result["weights_equal"], f"rank {rank}: final weights differ"
        stats = result["stats"]
        assert stats["mode"] == "cpu-simulation"
        assert stats["offloaded_tensors"] > 0 and stats["restored_tensors"] >= stats["offloaded_tensors"]
        assert stats["host_bytes_held"] == 0 and stats["live_host_copies"] == 0
        watch = result["watch"]
        assert watch["sources"] > 0, f"rank {rank}: the engine copied nothing to the host"
        assert watch["violations"] == [], f"rank {rank}: parameters offloaded: {watch['violations'][:3]}"
    # The ranks trained on different data, and the collectives made their gradients agree.
    assert ranks[0]["losses"] != ranks[1]["losses"]
    assert ranks[0]["grad_checksum"] == ranks[1]["grad_checksum"]


@pytest.mark.parametrize("scenario", ["ddp", "ddp_enable_after_wrap"])
def test_ddp_parity(runs, scenario):
    """DDP, offloading enabled before wrapping or on `ddp.module` after: loss, all-reduced
    gradients and weights after 2 SGD steps bit-identical to DDP without offloading."""
    ranks = runs[scenario]
    assert_parity_and_engaged(ranks)
    for result in ranks:
        # Exactly what a single process offloads from this model: DDP changes nothing saved.
        assert result["stats"]["offloaded_tensors"] == 36
        assert result["stats"]["kept_tensors"]["parameter"] == 27  # 9 per layer, the kept last one included


@pytest.mark.parametrize("scenario", ["fsdp2", "fsdp2_checkpointing"])
def test_fsdp2_parity_and_parameters_never_offloaded(runs, scenario):
    """FSDP2 (fully_shard on each decoder layer, then the root), offloading enabled before
    sharding, with and without gradient checkpointing: loss and full gradients identical to FSDP2
    without offloading; no copy to the host ever came from a live parameter storage, sharded or
    unsharded; the layers' parameters were unsharded inside every layer call and sharded at rest."""
    ranks = runs[scenario]
    assert_parity_and_engaged(ranks)
    for result in ranks:
        assert result["fsdp_class"] == "FSDPLlamaDecoderLayer"
        assert result["sharded_at_rest"]
        watch = result["watch"]
        assert watch["plain_params_in_layer"] > 0 and watch["sharded_params_in_layer"] == 0
        if scenario == "fsdp2_checkpointing":
            # Only the checkpointed layers' inputs: 2 offloaded layers per step.
            assert result["stats"]["offloaded_tensors"] == 2
            assert result["stats"]["kept_tensors"]["parameter"] == 0


def test_fsdp2_and_ddp_agree(runs):
    """FSDP2 and DDP train the same model on the same data: the same losses and gradients."""
    for fsdp2, ddp in zip(runs["fsdp2"], runs["ddp"], strict=True):
        assert fsdp2["losses"] == ddp["losses"]
        assert fsdp2["grad_checksum"] == ddp["grad_checksum"]


def test_fsdp2_offloads_as_much_as_ddp(runs):
    """Sharding changes nothing a layer saves, so FSDP2 must offload exactly what DDP offloads
    (summed over both ranks and both steps, so that a single reuse of freed memory shows)."""
    fsdp2 = sum(result["watch"]["sources"] for result in runs["fsdp2"])
    ddp = sum(result["watch"]["sources"] for result in runs["ddp"])
    assert fsdp2 == ddp
    for result in runs["fsdp2"]:
        assert result["stats"]["kept_tensors"]["parameter"] == 27  # 9 per layer, the kept last one included


def test_fsdp2_enable_after_fully_shard(runs):
    """Enabling offloading after fully_shard should work like enabling it before."""
    assert_parity_and_engaged(runs["fsdp2_enable_after_shard"])


@pytest.mark.parametrize("scenario", ["fsdp1", "fsdp1_orig_params", "fsdp1_enable_after_wrap"])
def test_fsdp1_parity_and_parameters_never_offloaded(runs, scenario):
    """FSDP1 (FullyShardedDataParallel with one unit per decoder layer, use_orig_params False and
    True), offloading enabled before wrapping, or after (the layers are then found inside the
    FSDP1 units and wrapped there, where their parameters are gathered): loss, all-gathered gradients and final weights
    identical to FSDP1 without offloading and to DDP; exactly what DDP offloads, and no copy to the
    host from a gathered flat parameter, which FSDP1 frees with resize_(0) after each unit."""
    ranks = runs[scenario]
    assert_parity_and_engaged(ranks)
    for result, ddp in zip(ranks, runs["ddp"], strict=True):
        assert result["fsdp_class"] == "FullyShardedDataParallel"
        assert result["losses"] == ddp["losses"] and result["grad_checksum"] == ddp["grad_checksum"]
        assert result["stats"]["offloaded_tensors"] == ddp["stats"]["offloaded_tensors"]
        assert result["stats"]["kept_tensors"]["parameter"] == ddp["stats"]["kept_tensors"]["parameter"]


def test_fsdp1_with_checkpoint_wrappers_applied_after_enabling(runs):
    """accelerate's FSDP plugin order: offloading enabled, then FSDP1 units, then non-reentrant
    checkpoint_wrapper around each decoder layer inside its unit. The first step runs as
    checkpointing alone; from the second hf_offload wraps the CheckpointWrappers and offloads
    only the checkpoint inputs (one per offloaded layer), with the same results as DDP."""
    ranks = runs["fsdp1_checkpoint_wrappers"]
    assert_parity_and_engaged(ranks)
    for result, ddp in zip(ranks, runs["ddp"], strict=True):
        assert result["wrapped_layer_class"] == "CheckpointWrapper"
        assert result["losses"] == ddp["losses"] and result["grad_checksum"] == ddp["grad_checksum"]
        # The second (last) step: the 2 checkpointed inputs of the 2 offloaded layers, nothing else.
        assert result["stats"]["offloaded_tensors"] == 2
        assert result["stats"]["kept_tensors"]["parameter"] == 0


@pytest.mark.parametrize("scenario", ["fsdp1_unprotected", "fsdp2_unprotected"])
def test_parameter_watch_catches_offloaded_parameters(runs, scenario):
    """Companion of the "no violations" checks: with an engine that no longer recognises
    parameter storages, the watch reports copies of FSDP's gathered parameters on every rank."""
    for result in runs[scenario]:
        assert result["watch"]["violations"], "the watch missed offloaded parameters"


def test_accelerate_prepare_in_two_processes(runs):
    """Accelerator(cpu=True, gradient_accumulation_steps=2) under torchrun: prepare wraps the model
    in DDP; accumulate (no_sync on the first micro-batch) and accelerator.backward give losses,
    gradients and weights bit-identical to the same loop without offloading."""
    ranks = runs["accelerate"]
    assert_parity_and_engaged(ranks)
    for result in ranks:
        assert result["wrapper"] == "DistributedDataParallel"
        assert result["distributed_type"] == "DistributedType.MULTI_CPU"
        assert result["sync_steps"] == 2 and len(result["losses"]) == 4


@pytest.fixture(scope="module")
def zero3(tmp_path_factory) -> list[dict]:
    """DeepSpeed ZeRO-3 on two CPU processes (DeepSpeed's CPU accelerator falls back to gloo
    without oneCCL). deepspeed is not a test dependency: skipped where it is not installed."""
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("zero3") / "results.json"
    return launch("distributed_worker.py", out, "--scenarios", "zero3,zero3_tiling", env={"DS_ACCELERATOR": "cpu"})


def test_deepspeed_zero3_parity(zero3):
    """ZeRO-3 (model built under deepspeed.zero.Init, every parameter partitioned): loss, full
    gradients (safe_get_full_grad) and gathered final weights identical to ZeRO-3 without
    offloading; no copy to the host came from a parameter's data or partition."""
    assert_parity_and_engaged(zero3["zero3"])


def test_sequence_tiling_under_deepspeed_zero3(zero3):
    """Sequence tiling under ZeRO-3 (every part and the loss head, 3 slices): lm_head's slices run
    inside a call of it, so ZeRO-3 gathers its weight; the MLP's slices call its projections,
    which gather theirs; each partitioned parameter's gradient is reduced once, after its last
    slice (DeepSpeed's ds_grad_is_ready protocol). Close to untiled, offloading on top
    bit-identical, and no gathered weight left alive between forward and backward."""
    ranks = zero3["zero3_tiling"]
    assert_parity_and_engaged(ranks)
    for result in ranks:
        assert result["tiled"] and result["close_to_untiled"], (result["losses"], result["untiled_losses"])
        assert result["gathered_alive_plain"] == result["gathered_alive_offloaded"] == [0, 0]


def test_zero3_gathers_a_tiled_modules_weights_once_each_way_as_untiled(zero3):
    """Under ZeRO-3 a tiled per-token module's slices run inside one call of it in forward; its
    backward is no call of it, so its hooks run once per step and ZeRO-3 gathers its weights for
    backward through the hooks it put on the module's output, as for an untiled module: one gather
    each way (a backward calling it once per slice gathered 1 + 3 times with 3 slices, 126 gathers
    per step in the layers; one driven call of it gathered twice in backward). The MLP's
    projections are called by its forward, once per slice each way; lm_head's calls are the
    model's, the loss's forward and its backward (its output, deferred logits, is in no graph). The
    final norm carries ZeRO-3's hooks, so it is not chained into the loss head: it runs as a tiled
    module of its own."""
    slices = 3
    for result in zero3["zero3_tiling"]:
        # With transformers' hub kernels on (transformers >= 5.25), kernelize took the wrapper off the
        # tiled norms, which still run tiled under ZeRO-3: tiling put it back.
        assert all(result["kernelize_took_off"]) or not is_kernels_available()
        calls, fetches = result["calls_per_step"], result["fetches_per_step"]
        assert set(calls) == set(result["untiled_calls_per_step"]) == set(fetches)
        assert set(result["untiled_calls_per_step"].values()) == {1}
        assert {tuple(each) for each in result["untiled_fetches_per_step"].values()} == {(1, 1)}
        for name, count in calls.items():
            if ".mlp." in name:
                assert count == 2 * slices, (name, count)
                assert fetches[name] == [2 * slices, slices], (name, fetches[name])
            elif name == "lm_head":
                assert count == 3
                assert fetches[name] == [3, 0], fetches[name]
            else:  # the tiled norms and attention projections of the layers, and the final norm
                assert count == 1, (name, count)
                assert fetches[name] == [1, 1], (name, fetches[name])


def test_deepspeed_zero3_gathered_weights_are_released(zero3):
    """Between forward and backward, as many gathered weights are alive as without offloading (none)."""
    for result in zero3["zero3"]:
        assert result["gathered_per_step"] > 0
        assert result["gathered_alive_plain"] == [0, 0]
        assert result["gathered_alive_offloaded"] == result["gathered_alive_plain"]


def test_fsdp2_example_runs():
    result = torchrun(ROOT / "examples" / "fsdp2_torchrun.py", "--steps", "2", "--seq-len", "16")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "step 1: loss" in result.stdout
    assert "mode: cpu-simulation" in result.stdout
    offloaded = [line for line in result.stdout.splitlines() if line.startswith("step 1:")][0]
    assert " offloaded 0 " not in offloaded, offloaded


def test_accelerate_example_under_accelerate_launch():
    """`accelerate launch --multi_gpu --num_processes 2` on a machine without GPUs: the example
    asks for Accelerator(cpu=True), so the two processes train with gloo."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(NPROC),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(ROOT / "examples" / "accelerate_loop.py"),
        "--steps",
        "2",
        "--seq-len",
        "16",
        "--compare",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "processes: 2" in result.stdout
    assert "bit-identical: losses yes, final weights yes" in result.stdout


@pytest.mark.parametrize(
    "scenario",
    [
        "ddp_tiling",
        "ddp_tiling_checkpointing",
        "fsdp2_tiling",
        "fsdp2_tiling_checkpointing",
        "fsdp2_lm_head_tiling",
        "fsdp1_tiling",
        "fsdp1_orig_params_tiling",
    ],
)
def test_sequence_tiling_under_ddp_and_fsdp(runs, scenario):
    """Sequence tiling (3 slices) under DDP, FSDP2 (with lm_head in the root unit, and as a unit of
    its own, unsharded only in its own calls) and FSDP1 (flat parameters, whose modules hold
    views of them instead of parameters; and use_orig_params), with and without checkpointing:
    with offloading bit-identical to tiling alone, close to untiled training (the all-reduced or
    reduce-scattered gradients included); under DDP every trainable parameter's gradient is
    accumulated exactly once per step, which is what its reducer hooks onto."""
    ranks = runs[scenario]
    assert_parity_and_engaged(ranks)
    for result in ranks:
        assert result["tiled"]
        assert result["close_to_untiled"], (result["losses"], result["untiled_losses"])
        if scenario.startswith("ddp"):
            assert result["arrivals_per_step"] == [[1]] * 2
            assert result["parameters_arrived"] == [result["trainable"]] * 2


def test_a_tiling_that_accumulated_per_slice_would_be_refused_by_ddp(runs):
    """Companion: accumulating each slice's gradients into .grad as it goes, DDP's reducer sees a
    parameter ready more than once and raises."""
    for result in runs["ddp_tiling_accumulated_per_slice"]:
        assert "error" in result and "mark a variable ready only once" in result["error"], result.get("error")


def test_a_tiling_blind_to_fsdp1_flat_parameter_views_would_drop_their_gradients(runs):
    """Companion: looking only at registered parameters, the tiled modules inside FSDP1 units with
    flat parameters pass none to the tiled Function, and their weights get no gradient."""
    for result in runs["fsdp1_tiling_parameters_only"]:
        assert "error" not in result, result.get("error")
        assert not result["close_to_untiled"]
