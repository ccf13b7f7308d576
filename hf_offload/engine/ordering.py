"""Every ordering between the compute stream and the copy stream that the engine relies on.

Each is a separate function so that the race checker's companion tests can remove exactly one
and show that the checker then fails.
"""

from __future__ import annotations


def before_offload_copies(streams, compute) -> None:
    """The copy stream reads the saved tensors only after the compute stream produced them."""
    streams.wait(streams.copy_stream, streams.record(compute))


def before_releasing_sources(streams, compute, copied_out) -> None:
    """Device memory read by a copy out goes back to the compute stream's allocator only once
    that copy has finished: later kernels on the compute stream wait for it."""
    streams.wait(compute, copied_out)


def before_restore_copies(streams, compute) -> None:
    """The copy stream writes into freshly allocated device memory only after the compute
    stream has finished with whatever used that memory before."""
    streams.wait(streams.copy_stream, streams.record(compute))


def before_using_restored(streams, compute, copied_in) -> None:
    """Backward reads a restored tensor only after the copy into it has finished."""
    streams.wait(compute, copied_in)


def before_dropping_unused(streams, compute, copied_in) -> None:
    """Memory brought back but never used is freed only after the copy into it has finished."""
    streams.wait(compute, copied_in)


def before_freeing_recomputed(streams, compute, copied_out) -> None:
    """A storage a checkpoint's recompute saved is freed in place (`recompute.park`) only once its
    copy out has finished: the compute stream waits for it before the memory is given back."""
    streams.wait(compute, copied_out)


def before_using_recomputed(streams, compute, copied_in) -> None:
    """A recomputed storage grown back (`recompute.unpark`) is read by the attention's backward only
    after the copy into it has finished; that read is the checkpoint's, not ours, so the wait is here."""
    streams.wait(compute, copied_in)
