"""A process forked while the engine holds a graph (issue 31, item 4): the child shares the disk
tier's open file and has none of its threads. Nothing the child does may reach the parent's file
or memory, and nothing it tries may hang: the parent's backward stays bit for bit, the child's
reads of the parent's file fail at once with a clear error, and a child that trains gets a file of
its own. Each child is forked from the test process and killed if it has not ended in time, so a
hang fails the test instead of blocking the run."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch
from conftest import assert_bit_identical, batch, collect, train_step
from test_disk_tier import assert_all_given_back, disk_pair, same_step
from test_pool import FakeCudart

from hf_offload.engine import forks
from hf_offload.engine.disk import DiskTierError
from hf_offload.engine.offloader import ActivationOffloader
from hf_offload.engine.pool import ALIGNMENT, HostBudget
from hf_offload.engine.streams import registered_host_empty

HANG = "hang"


def in_child(body, timeout: float = 120.0) -> str:
    """What `body()` returns (or the exception it raises, as 'Type: message') in a child forked
    from this process; HANG if the child has not ended after `timeout` seconds (it is killed)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            # GNU OpenMP hangs a forked child in its first parallel region once the parent has
            # used its threads (torch's own DataLoader workers do the same).
            torch.set_num_threads(1)
            try:
                message = str(body())
            except BaseException as error:  # noqa: BLE001 - reported to the parent
                message = f"{type(error).__name__}: {error}"
            os.write(write, message.encode()[:16384])
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return HANG
            time.sleep(0.01)
        return os.read(read, 16384).decode()
    finally:
        os.close(read)


def graph_on_disk(tmp_path):
    """A model whose second step's forward has run: its graph alive, tensors in the file, every
    write done (the bytes are in the file)."""
    plain, model = disk_pair(tmp_path)
    same_step(plain, model, 0)
    for each in (plain, model):
        each.zero_grad(set_to_none=True)
    ids = batch(seed=1)
    graph = {"loss": model(input_ids=ids, labels=ids).loss}
    store = model._hf_offload.engine.disk
    store.reap()
    for job in list(store._pending):
        store.wait(job)
    assert store.held_bytes > 0 and os.fstat(store._file.fd).st_size > 0
    return plain, model, graph, store, ids


def parent_backward_is_exact(plain, model, graph, ids) -> None:
    graph.pop("loss").backward()
    plain(input_ids=ids, labels=ids).loss.backward()
    assert_bit_identical(
        {n: p.grad for n, p in plain.named_parameters()}, {n: p.grad for n, p in model.named_parameters()}
    )


def drop_everything(model, graph, store) -> str:
    """What a child may do with what it inherited: read the statistics (which settle finished
    jobs), drop the graph, close the store, disable offloading, and exit (the store's finalizer)."""
    model.activation_offloading_stats()
    store.reap()
    graph.clear()
    gc.collect()
    store.close()
    model.disable_activation_offloading()
    store._closer()  # what the interpreter's exit runs
    return "ok"


def test_a_child_dropping_what_it_inherited_leaves_the_parents_file_alone(tmp_path):
    plain, model, graph, store, ids = graph_on_disk(tmp_path)
    size = os.fstat(store._file.fd).st_size
    assert in_child(lambda: drop_everything(model, graph, store)) == "ok"
    assert os.fstat(store._file.fd).st_size == size  # not truncated
    parent_backward_is_exact(plain, model, graph, ids)
    same_step(plain, model, 2)
    assert_all_given_back(model, tmp_path)


def test_the_fork_check_catches_a_child_that_truncates_the_parents_file(tmp_path, monkeypatch):
    """Companion: without the owner check, the child's dying copies give the extents back and the
    file is truncated under the parent, whose backward then has nothing to read."""
    plain, model, graph, store, ids = graph_on_disk(tmp_path)
    monkeypatch.setattr(forks, "made_here", lambda owner: True)
    assert in_child(lambda: drop_everything(model, graph, store)) == "ok"
    assert os.fstat(store._file.fd).st_size == 0
    with pytest.raises(DiskTierError, match="could not be read back"):
        graph.pop("loss").backward()


def test_a_child_cannot_read_the_parents_file_and_trains_with_its_own(tmp_path):
    """The child's backward of the graph it inherited raises at once (no thread would ever read
    for it, and the parent may have reused the space); a step of its own works, bit for bit, with a
    file of its own in the same directory. The parent is untouched."""
    plain, model, graph, store, ids = graph_on_disk(tmp_path)
    inherited_file = os.fstat(store._file.fd).st_ino

    def child() -> str:
        try:
            graph["loss"].backward()
        except DiskTierError as error:
            said = str(error)
        else:
            return "the inherited graph's backward ran"
        graph.clear()
        collect()
        expected_loss, expected = train_step(plain, batch(seed=3))
        loss, actual = train_step(model, batch(seed=3))
        assert torch.equal(expected_loss, loss)
        assert_bit_identical(expected, actual)
        stats = model.activation_offloading_stats()
        own = model._hf_offload.engine.disk
        assert own is not store and os.fstat(own._file.fd).st_ino != inherited_file
        assert stats.disk_offloaded_tensors > 0 and stats.disk_bytes_read > 0
        return said

    said = in_child(child)
    assert "forked" in said and "Run the backward in the process that ran the forward" in said, said
    parent_backward_is_exact(plain, model, graph, ids)
    assert_all_given_back(model, tmp_path)


def registered_then_dropped_in_a_child():
    cudart = FakeCudart()
    memory = registered_host_empty(2 * ALIGNMENT, cudart=cudart)

    def child() -> str:
        nonlocal memory
        memory = None
        gc.collect()
        return ",".join(call[0] for call in cudart.calls)

    in_the_child = in_child(child)  # (not in the return expression, which would hold `memory` meanwhile)
    return cudart, memory, in_the_child


def test_a_child_never_unregisters_the_parents_host_memory():
    """The pool's slabs on CUDA: registered by the parent, unregistered when the parent's last view
    goes; a child dropping its copy of them must not undo the parent's registration."""
    cudart, memory, in_the_child = registered_then_dropped_in_a_child()
    assert in_the_child == "register"
    del memory
    gc.collect()
    assert [call[0] for call in cudart.calls] == ["register", "unregister"]


def test_the_fork_check_catches_a_child_that_unregisters(monkeypatch):
    """Companion: without the owner check the child unregisters the parent's memory."""
    monkeypatch.setattr(forks, "made_here", lambda owner: True)
    _cudart, _memory, in_the_child = registered_then_dropped_in_a_child()
    assert in_the_child == "register,unregister"


# -- what the engine keeps in a fork: every field decided -------------------------------------------


def undecided_fields(engine: ActivationOffloader) -> set[str]:
    """The engine's attributes that are neither kept in a fork (`KEPT_IN_A_FORK`) nor made anew
    there (`_make_process_state`)."""
    made_anew = object.__new__(ActivationOffloader)
    made_anew._make_process_state(HostBudget(), disk=None)
    return set(vars(engine)) - ActivationOffloader.KEPT_IN_A_FORK - set(vars(made_anew))


def trained_engine(tmp_path) -> ActivationOffloader:
    """The engine of a model that trained a step with the disk tier: every field it sets in use."""
    plain, model = disk_pair(tmp_path)
    same_step(plain, model, 0)
    return model._hf_offload.engine


def test_every_field_of_the_engine_is_kept_in_a_fork_or_made_anew(tmp_path):
    """engine/offloader.py's _after_fork reset about fifteen fields by hand, and a field added later
    was inherited from the parent unless someone remembered it (issue 37). Now every field is kept by
    a forked child (options, measurements, counters) or made anew there, and a child's fields of the
    second kind are its own objects, not the parent's."""
    engine = trained_engine(tmp_path)
    assert undecided_fields(engine) == set()
    assert set(vars(engine)) >= ActivationOffloader.KEPT_IN_A_FORK
    before = dict(vars(engine))
    engine._after_fork()
    assert set(vars(engine)) == set(before)
    renewed = {
        name for name, value in before.items() if not isinstance(value, (bool, int, float, str, tuple, type(None)))
    } - ActivationOffloader.KEPT_IN_A_FORK
    assert renewed >= {"_lock", "ledger", "budget", "disk", "_devices", "_in_flight", "_step_groups"}
    assert [name for name in sorted(renewed) if vars(engine)[name] is before[name]] == []
    assert engine.max_host_bytes == before["budget"].limit and engine.disk.directory == before["disk"].directory
    engine.close()


def test_a_field_added_to_the_engine_and_not_decided_on_is_caught(tmp_path, monkeypatch):
    """Companion: a field set in __init__ and listed nowhere is named."""
    init = ActivationOffloader.__init__

    def with_a_new_field(self, **options):
        init(self, **options)
        self._added_later = {}

    monkeypatch.setattr(ActivationOffloader, "__init__", with_a_new_field)
    engine = trained_engine(tmp_path)
    assert undecided_fields(engine) == {"_added_later"}
