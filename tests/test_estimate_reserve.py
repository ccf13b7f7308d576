"""`hf-offload estimate`'s reserve (what a real run allocates beside the simulated step, left free
by the answer) and its host memory (the device preset's machine's, per GPU, by default)."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_CONFIGS
from test_cli_arguments import error_of, nothing_loaded  # noqa: F401 (nothing_loaded: a fixture, used by name)
from test_estimate import estimate_json, restore_logging  # noqa: F401 (restore_logging: an autouse fixture)

from hf_offload.tools import estimate as estimate_module
from hf_offload.tools import reserve as reserve_module
from hf_offload.tools.cli import main
from hf_offload.tools.devices import DEVICES
from hf_offload.tools.reserve import device_reserve

GIB = 2**30
MIB = 2**20


@pytest.fixture
def model_dir(tmp_path):
    config = {
        **TINY_CONFIGS["llama"],
        **dict(model_type="llama", hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=4096),
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def items(reserve) -> dict[str, int]:
    return {item.name: item.bytes for item in reserve.items}


def check_zero3_items(module) -> None:
    """The ZeRO-3 items as DeepSpeed's installed config makes them: one reduce bucket of its
    default element count in the communication dtype (bf16: 2 bytes), and a prefetch that
    gathers parameters in order until its default bucket is reached (the last one past it)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    config = DeepSpeedZeroConfig()  # DeepSpeed's own defaults, as a user's config without these keys gets them
    layer = [10, 10, 10]  # parameters of a unit, in elements
    found = module.device_reserve(usable_bytes=GIB, dtype_bytes=2, offload_params=True, units=[layer])
    assert items(found)["reduce_bucket"] == config.reduce_bucket_size * 2
    assert config.contiguous_gradients  # the bucket is a buffer of its own only then (stage3.py)
    bucket = config.prefetch_bucket_size
    assert module.prefetch_elements([bucket - 1, 7, 5], bucket) == bucket + 6  # one past the bucket, no more
    assert module.prefetch_elements([bucket // 2] * 3, bucket) == bucket
    big = [bucket // 2, bucket // 2, bucket // 2]
    found = module.device_reserve(usable_bytes=GIB, dtype_bytes=2, offload_params=True, units=[big])
    assert items(found)["prefetch"] == 0  # the simulated step already holds the whole unit
    assert found.bytes == sum(items(found).values())


def test_zero3_items_are_deepspeeds_installed_defaults():
    check_zero3_items(reserve_module)


def test_companion_a_stale_copy_of_deepspeeds_default_is_caught(monkeypatch):
    """Were the reserve to use a number copied from DeepSpeed once (here one that differs from
    the installed default), the check above fails."""
    real = reserve_module.zero_config_default
    monkeypatch.setattr(reserve_module, "zero_config_default",
                        lambda field: 2 * 10**8 if field == "reduce_bucket_size" else real(field))  # fmt: skip
    with pytest.raises(AssertionError):
        check_zero3_items(reserve_module)


def test_each_item_only_where_the_run_has_it():
    one_gpu = items(device_reserve(usable_bytes=80 * GIB, dtype_bytes=2))
    assert set(one_gpu) == {"allocator"}
    ranks = items(device_reserve(usable_bytes=80 * GIB, dtype_bytes=2, sp_size=8))
    assert set(ranks) == {"allocator", "nccl"}
    # NCCL's default buffer per connection and channel, 4 MiB (cited): more peers, more connections.
    assert ranks["nccl"] % (4 * MIB) == 0
    assert ranks["nccl"] > items(device_reserve(usable_bytes=80 * GIB, dtype_bytes=2, sp_size=2))["nccl"]
    zero3 = items(device_reserve(usable_bytes=80 * GIB, dtype_bytes=2, offload_params=True))
    assert set(zero3) == {"allocator", "reduce_bucket", "prefetch"}
    frozen = items(device_reserve(usable_bytes=80 * GIB, dtype_bytes=2, offload_params=True, trainable=False))
    assert "reduce_bucket" not in frozen  # nothing to reduce


def test_items_are_changed_by_name_and_refused_where_absent():
    given = device_reserve(usable_bytes=GIB, dtype_bytes=2, sp_size=2, overrides={"nccl": 0, "extra": 5 * MIB})
    assert items(given)["nccl"] == 0 and items(given)["extra"] == 5 * MIB
    assert [item.given for item in given.items if item.name in ("nccl", "extra")] == [True, True]
    with pytest.raises(ValueError, match=r"reserve item 'nccl': this run has none \(only with more than one rank"):
        device_reserve(usable_bytes=GIB, dtype_bytes=2, overrides={"nccl": 0})
    with pytest.raises(ValueError, match="unknown reserve item 'buckets'; valid: reduce_bucket, prefetch"):
        device_reserve(usable_bytes=GIB, dtype_bytes=2, overrides={"buckets": 0})


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--device", "h100-80gb", "--reserve", "buckets=1"], "unknown item 'buckets'; names: reduce_bucket"),
        (["--device", "h100-80gb", "--reserve", "allocator"], "'allocator' is not NAME=GIB"),
        (["--device", "h100-80gb", "--reserve", "allocator=lots"], "'lots' is not a number of GiB"),
        (["--device", "h100-80gb", "--reserve", "allocator=-1"], "GiB must be a finite number >= 0"),
        (["--device", "h100-80gb", "--reserve", "nccl=1"], "this run has no nccl (it comes only with more than one"),
        (["--device", "h100-80gb", "--reserve", "reduce_bucket=1"], "no reduce_bucket (it comes only with --offload"),
        (["--reserve", "extra=1"], "give --device or --device-memory"),
        (["--host-memory", "64", "--unlimited-host"], "--unlimited-host: not with --host-memory 64"),
        (["--device", "h100-80gb", "--unlimited-host", "--disk-memory", "10"], "needs --host-memory GIB or --device"),
    ],
)
@pytest.mark.usefixtures("nothing_loaded")
def test_bad_reserve_and_host_arguments_are_named_first(capsys, args, fragment):
    assert fragment in error_of(capsys, *args)


EXTRA_GIB = 0.05
MEMORY_GIB = 0.25


def check_leaves_free(result: dict) -> None:
    """The answer's step peaks within the device's memory less the reserve, and the next length
    simulated does not fit there."""
    reserve = result["reserve"]
    room = reserve["device_bytes"] - reserve["bytes"]
    assert reserve["step_bytes"] == room
    assert reserve["bytes"] >= int(EXTRA_GIB * GIB)
    (figures,) = result["modes"].values()
    search = figures["max_seq"]
    assert search["peak_bytes"] <= room
    probes = {p["seq_len"]: p["peak_bytes"] for p in search["probes"]}
    assert probes[figures["max_seq_len"] + search["granularity"]] > room


def leaving_free(capsys, model_dir) -> dict:
    return estimate_json(capsys, "--model", str(model_dir), "--modes", "checkpointing", "--device-memory",
                         str(MEMORY_GIB), "--reserve", f"extra={EXTRA_GIB}")  # fmt: skip


def test_the_answer_leaves_the_reserve_free(capsys, model_dir):
    result = leaving_free(capsys, model_dir)
    check_leaves_free(result)
    names = [item["name"] for item in result["reserve"]["items"]]
    assert names == ["allocator", "extra"]  # one GPU, no ZeRO-3: no buckets, no NCCL


def test_companion_a_search_over_the_whole_memory_is_caught(capsys, model_dir, monkeypatch):
    """Were the search to use the whole memory while the reserve is printed, the check fails."""
    search = estimate_module.longest_sequence

    def whole_memory(run, *, memory_bytes, **kwargs):
        return search(run, memory_bytes=memory_bytes + int(EXTRA_GIB * GIB), **kwargs)

    monkeypatch.setattr(estimate_module, "longest_sequence", whole_memory)
    with pytest.raises(AssertionError):
        check_leaves_free(leaving_free(capsys, model_dir))


def test_the_host_is_the_preset_machines_unless_unlimited_is_asked(capsys, model_dir):
    base = ["--model", str(model_dir), "--modes", "checkpointing+hf_offload", "--device", "h100-80gb",
            "--device-memory", str(MEMORY_GIB), "--granularity", "4096"]  # fmt: skip
    machine = estimate_json(capsys, *base)
    device = DEVICES["h100-80gb"]
    assert machine["setup"]["host_memory_bytes"] == int(device.host_memory_gib * GIB)
    assert machine["host"]["node_ram_bytes"] == int(device.host_memory_gib * device.gpus_per_node * GIB)
    assert "DGX H100" in machine["host"]["source"]
    assert main(["estimate", *base]) == 0
    out = capsys.readouterr().out
    assert "host memory per rank: 256.00 GiB (the h100-80gb preset's machine, per GPU (NVIDIA DGX H100" in out
    assert "left free for what a real run allocates beside the step" in out and "    allocator: " in out
    unlimited = estimate_json(capsys, *base, "--unlimited-host")
    assert unlimited["setup"]["host_memory_bytes"] is None
    assert unlimited["host"] is None or unlimited["host"]["source"] == "unlimited"


def test_zero3s_host_copy_comes_out_of_the_ranks_host_and_the_node_total_adds_it(capsys, model_dir):
    host_gib = 1.0
    result = estimate_json(capsys, "--model", str(model_dir), "--modes", "checkpointing+hf_offload", "--sp", "2",
                           "--offload-params", "--device-memory", str(MEMORY_GIB), "--host-memory", str(host_gib),
                           "--granularity", "4096", "--reserve", "reduce_bucket=0.01", "nccl=0.01")  # fmt: skip
    (figures,) = result["modes"].values()
    assert figures["max_seq_len"]  # (DeepSpeed's default bucket alone is more than this small device's memory)
    zero3 = figures["params_host_bytes"]
    host = result["host"]
    assert host["zero3_per_rank_bytes"] == -(-zero3 // 2)
    assert result["setup"]["host_memory_bytes"] == int(host_gib * GIB) - host["zero3_per_rank_bytes"]
    assert host["ranks_per_node"] == 2
    assert host["per_node_bytes"] == 2 * host["hf_offload_per_rank_bytes"] + zero3
    assert host["hf_offload_per_rank_bytes"] <= host["hf_offload_budget_bytes"]


def test_a_host_too_small_for_zero3s_copy_is_refused_naming_both(capsys, model_dir):
    err = error_of(capsys, "--model", str(model_dir), "--modes", "checkpointing", "--offload-params",
                   "--device-memory", str(MEMORY_GIB), "--host-memory", "0.001")  # fmt: skip
    assert "ZeRO-3's offload keeps" in err and "more than the 1.0 MiB of host memory per rank (given)" in err
