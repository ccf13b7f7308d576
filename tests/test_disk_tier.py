"""The disk tier (issue 25): what does not fit the host budget goes to an unlinked file in
disk_dir, the earliest layers first, and comes back bit for bit; every fault leaves training
going; nothing is left on disk, even after kill -9. Tiny models and KiB-sized files."""

from __future__ import annotations

import copy
import errno
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_bit_identical, batch, collect, enable_sim, tiny_model, train_step, twin

import hf_offload
from hf_offload.engine import disk as disk_module
from hf_offload.engine.disk import DiskTierError
from hf_offload.engine.planner import place_tiers
from hf_offload.engine.pool import ALIGNMENT, HostPool
from hf_offload.engine.streams import SimulatedStreams, simulated_schedule

LAYERS = 6  # five offloaded, the last kept
CHECKPOINTING = {"none": None, "non_reentrant": {"use_reentrant": False}, "reentrant": {"use_reentrant": True}}


@functools.cache  # the same tiny model's step: measured once per run
def host_bytes_of_full_offloading(checkpointing: str = "none", **overrides) -> int:
    model = tiny_model(num_hidden_layers=LAYERS, **overrides)
    if CHECKPOINTING[checkpointing] is not None:
        model.activation_checkpointing_enable(CHECKPOINTING[checkpointing])
    enable_sim(model)
    train_step(model, batch())
    return model.activation_offloading_stats().pool_bytes


def disk_pair(directory: Path, checkpointing: str = "none", host_share: float = 0.7, **options):
    """A plain model and its twin offloading with a host budget of `host_share` of what full
    offloading takes, the rest to disk."""
    budget = int(host_bytes_of_full_offloading(checkpointing) * host_share)
    plain = tiny_model(num_hidden_layers=LAYERS)
    model = twin(plain)
    for each in (plain, model):
        if CHECKPOINTING[checkpointing] is not None:
            each.activation_checkpointing_enable(CHECKPOINTING[checkpointing])
    enable_sim(model, disk_dir=directory, max_host_bytes=budget, **options)
    return plain, model


def same_step(plain, model, seed: int):
    expected_loss, expected = train_step(plain, batch(seed=seed))
    loss, actual = train_step(model, batch(seed=seed))
    assert torch.equal(expected_loss, loss)
    assert_bit_identical(expected, actual)
    return model.activation_offloading_stats()


def assert_all_given_back(model, directory: Path) -> None:
    collect()
    stats = model.activation_offloading_stats()
    assert (stats.host_bytes_held, stats.live_host_copies, stats.disk_bytes_held) == (0, 0, 0)
    assert os.listdir(directory) == []


@pytest.mark.parametrize("checkpointing", sorted(CHECKPOINTING))
def test_gradients_through_the_disk_tier_are_bit_identical(tmp_path, checkpointing):
    plain, model = disk_pair(tmp_path, checkpointing)
    for seed in range(4):
        stats = same_step(plain, model, seed)
        assert stats.disk_offloaded_tensors > 0, "nothing went to disk"
        assert stats.offloaded_tensors > stats.disk_offloaded_tensors, "nothing stayed in host memory"
        assert stats.disk_bytes_written >= stats.disk_offloaded_bytes
        assert stats.disk_bytes_read > 0 or seed == 0
        assert stats.host_bytes_held == 0
    assert stats.planned_disk_layers == stats.layers_on_disk > 0
    assert "disk tier" in stats.summary()
    assert_all_given_back(model, tmp_path)


@pytest.mark.parametrize("schedule", ["lazy", "random"])
def test_disk_tier_under_the_race_checker(tmp_path, schedule):
    """Copies out run late or at random: the writer must wait for the copy into its staging buffer,
    and a read must not overwrite a buffer a queued copy back still reads."""
    with simulated_schedule(schedule, seed=3):
        plain, model = disk_pair(tmp_path)
        for seed in range(3):
            stats = same_step(plain, model, seed)
        streams = model._hf_offload.engine.device_context("cpu").streams
    assert stats.disk_offloaded_tensors > 0 and not streams.violations


def test_with_sequence_tiling_bit_identical_to_tiling_alone(tmp_path):
    plain, model = disk_pair(tmp_path, "non_reentrant")
    for each in (plain, model):
        hf_offload.enable_sequence_tiling(each, tile_tokens=4)
    for seed in range(3):
        stats = same_step(plain, model, seed)
    assert stats.disk_offloaded_tensors > 0
    assert_all_given_back(model, tmp_path)


def test_the_earliest_layers_go_to_disk(tmp_path):
    """From the second step on (the first measures), the layers on disk are the leading ones."""
    plain, model = disk_pair(tmp_path, "non_reentrant")
    engine = model._hf_offload.engine
    for seed in range(3):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=batch(seed=seed), labels=batch(seed=seed)).loss
        groups = sorted(engine._step_groups, key=lambda group: group.position)
        on_disk = [group.position for group in groups if group.disk_copies]
        in_host = [group.position for group in groups if group.copies and not group.disk_copies]
        del groups  # the groups hold their copies: kept past backward, they would hold host memory
        loss.backward()
    assert on_disk and in_host
    assert on_disk == list(range(len(on_disk))) and min(in_host) == len(on_disk)
    assert model.activation_offloading_stats().planned_disk_layers == len(on_disk)


def test_place_tiers_takes_the_fewest_leading_layers_that_leave_the_host_budget_met():
    layers = [10, 10, 10, 10, 10, 10]
    plan = place_tiers(layers, offloaded_layers=5, host_bytes=1000, disk_bytes=1000, staging_layers=2)
    assert (plan.disk_layers, plan.host_bytes, plan.staging_bytes, plan.fits) == (0, 50, 0, True)
    plan = place_tiers(layers, offloaded_layers=5, host_bytes=40, disk_bytes=1000, staging_layers=2)
    assert (plan.disk_layers, plan.host_bytes, plan.disk_bytes, plan.fits) == (3, 40, 30, True)
    # The staging buffers are for the largest disk layer.
    plan = place_tiers([30, 10, 10, 10, 10], offloaded_layers=5, host_bytes=65, disk_bytes=1000, staging_layers=2)
    assert (plan.disk_layers, plan.staging_bytes, plan.host_short) == (5, 60, False)
    for host_bytes in range(0, 80, 7):  # the rule, against every choice
        plan = place_tiers(layers, offloaded_layers=5, host_bytes=host_bytes, disk_bytes=1000, staging_layers=2)
        fitting = [d for d in range(6) if sum(layers[d:5]) + (20 if d else 0) <= host_bytes]
        assert plan.disk_layers == (fitting[0] if fitting else 5)
        assert plan.host_short == (not fitting)
    short = place_tiers(layers, offloaded_layers=5, host_bytes=40, disk_bytes=20, staging_layers=2)
    assert short.disk_layers == 3 and not short.fits and not short.host_short


def test_a_full_disk_mid_training_keeps_tensors_in_host_memory(tmp_path, monkeypatch, caplog):
    plain, model = disk_pair(tmp_path)
    same_step(plain, model, 0)

    def disk_full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_module, "_pwrite", disk_full)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for seed in range(1, 4):
            stats = same_step(plain, model, seed)
            assert stats.disk_bytes_written == 0 and stats.offloaded_tensors > 0
    warnings = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]
    monkeypatch.undo()  # space again: the disk is used again from the next step
    same_step(plain, model, 5)
    stats = same_step(plain, model, 6)
    assert stats.disk_bytes_written > 0
    assert_all_given_back(model, tmp_path)


def test_an_io_error_on_one_write_loses_nothing(tmp_path, monkeypatch):
    plain, model = disk_pair(tmp_path)
    same_step(plain, model, 0)
    writes = {"count": 0}
    real = disk_module._pwrite

    def fail_every_third(fd, data, offset):
        writes["count"] += 1
        if writes["count"] % 3 == 0:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, data, offset)

    monkeypatch.setattr(disk_module, "_pwrite", fail_every_third)
    for seed in range(1, 4):
        same_step(plain, model, seed)
    assert writes["count"] >= 3
    assert_all_given_back(model, tmp_path)


def test_short_reads_are_continued(tmp_path, monkeypatch):
    plain, model = disk_pair(tmp_path)
    same_step(plain, model, 0)
    calls = {"short": 0}
    real = disk_module._preadv

    def at_most_one_block(fd, buffers, offset):
        (into,) = buffers
        if len(into) > 512:
            calls["short"] += 1
            return real(fd, [into[:512]], offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk_module, "_preadv", at_most_one_block)
    # Without O_DIRECT: a 512-byte piece is not block-aligned.
    model._hf_offload.engine.disk._file.direct = False
    import fcntl

    fd = model._hf_offload.engine.disk._file.fd
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    for seed in range(1, 3):
        stats = same_step(plain, model, seed)
    assert calls["short"] > 0 and stats.disk_bytes_read > 0


@pytest.mark.parametrize("transfer", ["_pwrite", "_preadv"], ids=["writes", "reads"])
def test_o_direct_refused_in_transfers_falls_back_to_plain_io(tmp_path, monkeypatch, transfer):
    """A file system that takes O_DIRECT at open but refuses it in a transfer (EINVAL: a device
    whose logical block is larger than 4 KiB, some network and FUSE file systems): the enable
    check and the tier go on with plain I/O, for reads as for writes, bit for bit."""
    import fcntl

    real = getattr(disk_module, transfer)
    refused = []

    def refuse_direct(fd, *arguments):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, *arguments)

    monkeypatch.setattr(disk_module, transfer, refuse_direct)
    plain, model = disk_pair(tmp_path)
    for seed in range(2):
        stats = same_step(plain, model, seed)
    assert refused and stats.disk_io == "buffered"
    assert stats.disk_offloaded_tensors > 0 and stats.disk_bytes_read > 0
    assert_all_given_back(model, tmp_path)


def fake_mount_table(path: Path, *mounts: tuple[str, str]) -> Path:
    lines = [f"{i} 1 0:{i} / {point} rw,relatime shared:{i} - {kind} none rw" for i, (point, kind) in enumerate(mounts)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_memory_file_systems_are_found_by_the_deepest_mount(tmp_path, monkeypatch):
    table = fake_mount_table(
        tmp_path / "mountinfo",
        ("/", "ext4"),
        ("/dev/shm", "tmpfs"),
        ("/scratch", "tmpfs"),
        ("/scratch/nvme", "xfs"),
        ("/ram\\040disk", "ramfs"),  # mountinfo escapes a space as \040
    )
    monkeypatch.setattr(disk_module, "_MOUNTINFO", str(table))
    found = disk_module.memory_file_system
    assert found("/dev/shm") == found("/dev/shm/offload") == "tmpfs"
    assert found("/scratch/run") == "tmpfs" and found("/scratch/nvme/run") is None
    assert found("/ram disk/x") == "ramfs"
    assert found("/home") is None and found("/dev/shmem") is None  # a prefix of the name is not a mount
    monkeypatch.setattr(disk_module, "_MOUNTINFO", str(tmp_path / "missing"))
    assert found("/dev/shm") is None  # no mount table (not Linux): nothing said


def test_a_disk_dir_in_memory_is_said_once(tmp_path, caplog):
    """/dev/shm (tmpfs) takes the file and works, but its bytes are RAM: one warning naming the
    path, that it is memory, and what to pass instead; none for a directory on a disk."""
    in_memory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        with caplog.at_level(logging.WARNING, logger="hf_offload"):
            for directory in (in_memory, in_memory, tmp_path):
                enable_sim(tiny_model(), disk_dir=directory)
        said = [r.getMessage() for r in caplog.records if "file system in memory" in r.getMessage()]
        assert len(said) == 1, said
        assert repr(in_memory) in said[0] and "tmpfs" in said[0] and "RAM" in said[0]
        assert "local disk" in said[0] and "disk_dir=None" in said[0] and "max_host_bytes" in said[0]
    finally:
        shutil.rmtree(in_memory)


def test_out_of_file_descriptors_says_so_at_enable_time(tmp_path, monkeypatch):
    def too_many(directory, direct):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(disk_module, "_open_unlinked", too_many)
    with pytest.raises(ValueError, match="Too many open files.*as many files open as it may.*ulimit -n") as raised:
        enable_sim(tiny_model(), disk_dir=tmp_path)
    assert repr(str(tmp_path)) in str(raised.value)


class _Copy:
    """What the store needs of a copy: its staging buffer and where its bytes are on disk."""

    __slots__ = ("host_block", "host_size", "disk_offset", "job", "read_error", "__weakref__")

    def __init__(self, host_block) -> None:
        self.host_block, self.host_size = host_block, host_block.size
        self.disk_offset = self.job = self.read_error = None


class _Context:
    def __init__(self) -> None:
        self.streams = SimulatedStreams()
        self.pool = HostPool(self.streams)

    def copied_out(self):
        return self.streams.record(self.streams.copy_stream)


def test_shutting_the_store_down_drops_the_transfers_still_queued(tmp_path, monkeypatch):
    """At exit (or when the store is collected) with writes still queued (a KeyboardInterrupt in
    the middle of a long forward), the transfers no one will read are dropped rather than run: the
    exit is not held up by gigabytes of writes to a file about to vanish."""
    started, gate, calls = threading.Event(), threading.Event(), []
    real = disk_module._pwrite

    def slow(fd, data, offset):
        calls.append(offset)
        started.set()
        gate.wait(10)
        return real(fd, data, offset)

    monkeypatch.setattr(disk_module, "_pwrite", slow)
    context, store = _Context(), disk_module.DiskStore(str(tmp_path), 2**30, io_threads=1)
    copies = [_Copy(context.pool.acquire(ALIGNMENT)) for _ in range(20)]
    for each in copies:
        store.write(each, context, context.copied_out())
    assert started.wait(10)  # the one thread is inside the first write
    threading.Timer(0.2, gate.set).start()
    store._closer()  # what the interpreter's exit runs
    assert len(calls) == 1 and store.closed
    assert not store._threads[0].is_alive()


def test_a_thread_still_in_a_transfer_keeps_the_descriptor_open(tmp_path, monkeypatch):
    """A thread that does not stop in time (a hung disk) is still inside a call on the file's
    descriptor: closing it then would let that call land in whatever file reuses the number."""
    started, gate = threading.Event(), threading.Event()
    real = disk_module._pwrite

    def hung(fd, data, offset):
        started.set()
        gate.wait(10)
        return real(fd, data, offset)

    monkeypatch.setattr(disk_module, "_pwrite", hung)
    monkeypatch.setattr(disk_module, "JOIN_SECONDS", 0.1)
    context, store = _Context(), disk_module.DiskStore(str(tmp_path), 2**30, io_threads=1)
    store.write(_Copy(context.pool.acquire(ALIGNMENT)), context, context.copied_out())
    assert started.wait(10)
    store._closer()
    fd = store._file.fd
    os.fstat(fd)  # still open
    gate.set()
    store._threads[0].join(10)
    os.close(fd)


def test_a_thread_that_cannot_start_leaves_nothing_open(tmp_path, monkeypatch):
    start = threading.Thread.start
    started = []

    def third_fails(thread):
        if thread.name.startswith("hf_offload-disk") and len(started) == 2:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", third_fails)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        disk_module.DiskStore(str(tmp_path), 2**30)
    for thread in started:
        thread.join(10)
        assert not thread.is_alive()
    opened = [os.readlink(fd) for fd in Path("/proc/self/fd").iterdir() if os.path.exists(fd)]
    assert not [path for path in opened if path.startswith(str(tmp_path))], opened


def test_the_directory_deleted_under_training_changes_nothing(tmp_path):
    """The file has no name: removing the directory (a cleaner, a user's rm -rf) cannot take it."""
    directory = tmp_path / "offload"
    directory.mkdir()
    plain, model = disk_pair(directory)
    same_step(plain, model, 0)
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    ids = batch(seed=1)
    losses = [m(input_ids=ids, labels=ids).loss for m in (plain, model)]
    shutil.rmtree(directory)  # between forward and backward, with the step's tensors on disk
    for loss in losses:
        loss.backward()
    assert_bit_identical(
        {n: p.grad for n, p in plain.named_parameters()}, {n: p.grad for n, p in model.named_parameters()}
    )
    assert model.activation_offloading_stats().disk_bytes_read > 0


def test_bytes_gone_from_the_file_fail_that_backward_clearly_and_the_next_step_runs(tmp_path):
    """The one fault nothing survives: the file truncated (or an I/O error on read) after the bytes
    were written. They exist nowhere else, so that backward raises, naming the cause; training
    goes on with the next step."""
    plain, model = disk_pair(tmp_path)
    same_step(plain, model, 0)
    store = model._hf_offload.engine.disk
    loss = model(input_ids=batch(seed=1), labels=batch(seed=1)).loss
    store.reap()
    for job in list(store._pending):
        store.wait(job)
    os.ftruncate(store._file.fd, 0)
    with pytest.raises(DiskTierError, match="could not be read back"):
        loss.backward()
    del loss
    collect()
    same_step(plain, model, 2)
    stats = same_step(plain, model, 3)
    assert stats.disk_bytes_read > 0
    assert_all_given_back(model, tmp_path)


def test_no_host_memory_to_read_back_into_is_a_clear_error_and_the_next_step_runs(tmp_path, monkeypatch):
    """Host memory gone between forward and backward (another process took it): reads ahead wait
    for a later layer, and the read backward needs now raises DiskTierError saying so (not the
    allocator's error from inside autograd)."""
    plain, model = disk_pair(tmp_path)
    same_step(plain, model, 0)
    loss = model(input_ids=batch(seed=1), labels=batch(seed=1)).loss

    def no_memory(self, size):
        raise MemoryError(f"cannot allocate {size} bytes")

    monkeypatch.setattr(HostPool, "acquire", no_memory)
    with pytest.raises(DiskTierError, match="could not get .* bytes of host memory .*cannot allocate"):
        loss.backward()
    monkeypatch.undo()
    del loss
    collect()
    same_step(plain, model, 2)
    stats = same_step(plain, model, 3)
    assert stats.disk_bytes_read > 0
    assert_all_given_back(model, tmp_path)


def test_a_disk_budget_too_small_keeps_the_rest_on_the_device(tmp_path, caplog):
    plain, model = disk_pair(tmp_path, max_disk_bytes=2 * ALIGNMENT)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for seed in range(3):
            stats = same_step(plain, model, seed)
            assert stats.disk_offloaded_bytes <= 2 * ALIGNMENT
            assert stats.kept_tensors["over_budget"] > 0
    assert any("max_disk_bytes" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "missing", "no such directory"),
        (lambda root: root / "a-file", "is not a directory"),
        (lambda root: root / "a-file" / "below", "no such directory|cannot create a file there"),
    ],
    ids=["missing", "a regular file", "under a regular file"],
)
def test_unusable_directories_are_errors_at_enable_time(tmp_path, make, message):
    (tmp_path / "a-file").write_bytes(b"x")
    model = tiny_model()
    with pytest.raises(ValueError, match=message) as raised:
        enable_sim(model, disk_dir=make(tmp_path))
    assert str(make(tmp_path)) in str(raised.value)
    assert not model.is_activation_offloading  # nothing was changed


@pytest.mark.parametrize(
    ("code", "message"),
    [(errno.EROFS, "Read-only file system"), (errno.ENOSPC, "the file system is full")],
    ids=["read-only", "full"],
)
def test_a_directory_that_refuses_writes_is_an_error_at_enable_time(tmp_path, monkeypatch, code, message):
    """As root, permissions do not stop a write: a read-only mount and a full disk are stood in for
    by the write call failing as they make it fail."""

    def refuse(fd, data, offset):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk_module, "_pwrite", refuse)
    with pytest.raises(ValueError, match=message):
        enable_sim(tiny_model(), disk_dir=tmp_path)
    assert os.listdir(tmp_path) == []


def test_bad_disk_options_name_the_value_and_what_is_valid(tmp_path):
    model = tiny_model()
    with pytest.raises(TypeError, match="disk_dir must be a path"):
        enable_sim(model, disk_dir=3)
    with pytest.raises(ValueError, match="max_disk_bytes=8192 needs disk_dir"):
        enable_sim(model, max_disk_bytes=8192)
    with pytest.raises(ValueError, match="max_disk_bytes must be an int >= 4096"):
        enable_sim(model, disk_dir=tmp_path, max_disk_bytes=10)
    with pytest.raises(ValueError, match="is more than the .* bytes free"):
        enable_sim(model, disk_dir=tmp_path, max_disk_bytes=2**62)


def test_disable_frees_everything_even_with_a_graph_alive(tmp_path):
    plain, model = disk_pair(tmp_path)
    same_step(plain, model, 0)
    store = model._hf_offload.engine.disk
    ids = batch(seed=1)
    plain.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    losses = [m(input_ids=ids, labels=ids).loss for m in (plain, model)]
    model.disable_activation_offloading()  # the graph still needs what is on disk
    assert not store.closed and store.held_bytes > 0
    for loss in losses:
        loss.backward()
    assert_bit_identical(
        {n: p.grad for n, p in plain.named_parameters()}, {n: p.grad for n, p in model.named_parameters()}
    )
    del losses, loss
    collect()
    assert store.closed and store.held_bytes == 0
    assert not any(thread.is_alive() for thread in store._threads)
    assert os.listdir(tmp_path) == []


def test_enabling_again_and_deep_copies_get_their_own_file(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    plain, model = disk_pair(first)
    same_step(plain, model, 0)
    old = model._hf_offload.engine.disk
    budget = model._hf_offload.engine.max_host_bytes
    enable_sim(model, disk_dir=second, max_host_bytes=budget)
    assert old.closed and model._hf_offload.engine.disk.directory == str(second)
    same_step(plain, model, 1)
    clone = copy.deepcopy(model)
    assert clone._hf_offload.engine.disk is not model._hf_offload.engine.disk
    stats = same_step(plain, clone, 2)
    assert stats.disk_offloaded_tensors > 0


def test_enabling_again_with_the_same_directory_keeps_the_tier(tmp_path):
    """Reconfiguring with the same disk_dir (the same options, or another max_disk_bytes) keeps the
    same store, file and threads, with a graph alive across it, and stays bit for bit."""
    plain, model = disk_pair(tmp_path)
    same_step(plain, model, 0)
    engine = model._hf_offload.engine
    store, budget = engine.disk, engine.max_host_bytes
    inode = os.fstat(store._file.fd).st_ino
    for each in (plain, model):
        each.zero_grad(set_to_none=True)
    ids = batch(seed=1)
    losses = [each(input_ids=ids, labels=ids).loss for each in (plain, model)]
    assert store.held_bytes > 0
    enable_sim(model, disk_dir=tmp_path, max_host_bytes=budget)
    enable_sim(model, disk_dir=str(tmp_path), max_host_bytes=budget, max_disk_bytes=2**20)
    assert engine.disk is store and not store.closed and store.max_bytes == 2**20
    assert os.fstat(store._file.fd).st_ino == inode and all(thread.is_alive() for thread in store._threads)
    for loss in losses:
        loss.backward()
    assert_bit_identical(
        {n: p.grad for n, p in plain.named_parameters()}, {n: p.grad for n, p in model.named_parameters()}
    )
    del losses, loss
    stats = same_step(plain, model, 2)
    assert stats.disk_offloaded_tensors > 0 and engine.disk is store
    assert_all_given_back(model, tmp_path)


CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    from conftest import batch, enable_sim, tiny_model, train_step
    from hf_offload.engine import disk

    if {keep_name!r} == "yes":  # the companion: a file that keeps its name
        def named(directory, direct):
            return os.open(os.path.join(directory, "left-behind"), os.O_RDWR | os.O_CREAT, 0o600)
        disk._open_unlinked = named
    model = tiny_model(num_hidden_layers=6)
    enable_sim(model, disk_dir={directory!r}, max_host_bytes={budget})
    train_step(model, batch())
    first = model.model.layers[-1]

    def hold(module, grad_input, grad_output):  # mid-step: in backward, with tensors on disk
        print("in backward", model.activation_offloading_stats().disk_bytes_held, flush=True)
        time.sleep(600)

    first.register_full_backward_hook(hold)
    train_step(model, batch(seed=2))
    """
)


def run_and_kill(directory: Path, keep_name: bool) -> tuple[list[str], list[str]]:
    """A training child killed with SIGKILL in the middle of a backward. Returns the files it had
    open in `directory` (from /proc, just before the kill) and what `directory` holds after."""
    budget = int(host_bytes_of_full_offloading() * 0.7)
    tests = str(Path(__file__).resolve().parent)
    script = CHILD.format(tests=tests, keep_name="yes" if keep_name else "no", directory=str(directory), budget=budget)
    env = {**os.environ, "PYTHONPATH": str(Path(tests).parent)}
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.startswith("in backward"), line
        assert int(line.split()[-1]) > 0, "no bytes on disk at the kill"
        fds = Path(f"/proc/{child.pid}/fd")
        opened = [os.readlink(fd) for fd in fds.iterdir() if os.readlink(fd).startswith(str(directory))]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    time.sleep(0.1)
    return opened, os.listdir(directory)


def test_nothing_left_on_disk_after_kill_9_mid_step(tmp_path):
    opened, left = run_and_kill(tmp_path, keep_name=False)
    assert opened and all(path.endswith("(deleted)") for path in opened), opened  # it had its file open
    assert left == []


def test_the_kill_check_sees_a_file_left_behind(tmp_path):
    """Companion: a file that keeps its name is found after the kill, so the check above can fail."""
    opened, left = run_and_kill(tmp_path, keep_name=True)
    assert left == ["left-behind"]


def test_time_waited_on_a_slow_disk_is_counted_and_reads_start_further_ahead(tmp_path, monkeypatch):
    plain, model = disk_pair(tmp_path)
    same_step(plain, model, 0)
    engine = model._hf_offload.engine
    real = disk_module._preadv

    def slow(fd, buffers, offset):
        time.sleep(0.02)
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk_module, "_preadv", slow)
    ahead = engine.disk_readahead_layers()
    stats = same_step(plain, model, 1)
    assert stats.disk_wait_seconds > 0 and stats.disk_read_gbps is not None
    same_step(plain, model, 2)
    assert engine.disk_readahead_layers() > ahead  # (a wait in step 0 may have added one already)
