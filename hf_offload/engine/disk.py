"""The disk tier: offloaded activations that do not fit the host budget, in a file.

One file per offloader, in the directory the user names (`disk_dir`), opened unlinked
(`O_TMPFILE`, or created and removed at once where the file system lacks it): it has no name
from the start, so a crash or a `kill -9` leaves nothing behind, and nothing else can delete or
rename it under us. Space in it is handed out in `ALIGNMENT`-sized extents and reused; when no
extent is in use the file is truncated to nothing, so between steps it holds no disk space.

A tensor's trip: in forward its copy out lands in a pooled host buffer (the staging buffer), as
for the host tier; a writer thread then writes that buffer to the file and the buffer goes back
to the pool. In backward a reader thread reads it into a staging buffer ahead of need and the copy
back to the device runs from there. The threads do positional I/O (`os.pwrite`/`os.preadv`,
which release the GIL), with `O_DIRECT` where the file system takes it (no page cache: the bytes
are read once, and caching them would only take the host memory this tier exists to spare) and
plain I/O where it does not: at open (tmpfs on older kernels), or from the first read or write it
refuses. Large transfers are split into chunks that several threads run at once, which keeps a fast
NVMe drive's queue busy. The life of a tensor through all this, state by state: docs/design.md.

The threads never touch the engine's state: they move bytes and mark a job done. The threads that
run forward and backward reap finished jobs at layer boundaries (`DiskStore.reap`), or wait for the
one they need (`DiskStore.wait`, counted as time the compute waited on the disk).

Orderings, each done where a job is made:
- a write reads its staging buffer only after the copy into it has finished: the job first waits
  for the copy stream's event of that copy (`host_waiter`);
- a read writes into a staging buffer only after every copy already queued on the copy stream has
  finished (the buffer may have been the source of a copy back that has not run yet);
- a staging buffer returns to the pool only when its job is done.

Faults (issue 25): a missing, unwritable or full directory is an error at enable time
(`check_directory`). A write that fails later (ENOSPC, EIO) leaves the tensor where it is, in its
staging buffer in host memory, with one warning, and the tier stops taking new tensors until the
next step. A short read is continued where it stopped. A read that cannot complete (the file
truncated or an I/O error: the bytes are gone) raises in backward, naming the cause; the step
cannot be computed without them, and the next step runs. A directory on a file system in memory
(tmpfs, ramfs) works and is said once to be RAM. In a process forked from the owner the store is
inert (`forks`). Shutting it down (closed, collected, or at exit) drops the transfers still queued.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import logging
import os
import queue
import re
import secrets
import stat
import threading
import time
import weakref
from dataclasses import dataclass

from . import forks
from .extents import ExtentMap
from .pool import ALIGNMENT, HostBudget, HostBuffer

logger = logging.getLogger("hf_offload")

# A transfer is split into chunks of this many bytes, run by the I/O threads in parallel.
CHUNK_BYTES = 64 * 2**20
IO_THREADS = 4
# How long closing the store waits for each I/O thread to finish the transfer it is in.
JOIN_SECONDS = 60.0

# Module globals, so that the tests can put faults in their place (a full disk, a short read).
_pwrite = os.pwrite
_preadv = os.preadv
# Where the mount table is read (a module global, so that a test can give it another).
_MOUNTINFO = "/proc/self/mountinfo"
# File systems whose files are memory: a disk tier there spares no host memory.
_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs"})
_said_in_memory: set[str] = set()  # directories already warned about, once per process


def _no_copy() -> None:
    return None


class DiskTierError(RuntimeError):
    """The bytes of an offloaded tensor could not be read back from the disk tier."""


@dataclass(frozen=True)
class DirectoryCheck:
    free_bytes: int  # what the file system has free for this user, now
    direct: bool  # O_DIRECT works there


def free_bytes(directory: str) -> int:
    usage = os.statvfs(directory)
    return usage.f_bavail * usage.f_frsize


def _open_unlinked(directory: str, direct: bool) -> int:
    """A new file in `directory` that has no name: O_TMPFILE, or a file created and removed at once
    where the file system lacks O_TMPFILE (then only a crash between the two calls leaves an empty
    file). EINVAL with `direct`: the file system refuses O_DIRECT."""
    flags = os.O_RDWR | (os.O_DIRECT if direct else 0)
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            return os.open(directory, flags | tmpfile, 0o600)
        except OSError as error:
            # EOPNOTSUPP (EISDIR on old kernels): no O_TMPFILE here. Anything else (no such
            # directory, no permission, read-only, O_DIRECT refused) is the directory's own answer.
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR):
                raise
    while True:
        path = os.path.join(directory, f".hf_offload-{os.getpid()}-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        os.unlink(path)
        return fd


def _open_file(directory: str) -> tuple[int, bool]:
    """The unlinked file, with O_DIRECT where the file system takes it."""
    try:
        return _open_unlinked(directory, direct=True), True
    except OSError as error:
        if error.errno != errno.EINVAL:  # EINVAL: O_DIRECT refused (tmpfs); anything else is real
            raise
    return _open_unlinked(directory, direct=False), False


def check_directory(directory: object, max_bytes: int | None) -> DirectoryCheck:
    """What enabling the disk tier checks, with errors naming the directory and the fix: it is a
    directory, a file can be made, written and read back there, and (when `max_bytes` is given)
    the file system has that much free."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"option disk_dir must be a path (str or os.PathLike) or None, got {directory!r} "
            f"({type(directory).__name__})"
        )
    path = os.fspath(directory)
    if not os.path.exists(path):
        raise ValueError(f"option disk_dir={path!r}: no such directory; create it, or pass an existing directory")
    if not stat.S_ISDIR(os.stat(path).st_mode):
        raise ValueError(f"option disk_dir={path!r} is not a directory; pass a directory for the offload file")
    file = _File(*_open_or_say_why(path))
    try:
        # Through `_File`, as the tier's own transfers go: a file system that takes O_DIRECT at
        # open but refuses it in a transfer gets plain I/O here too, not an error.
        probe = _aligned_bytes(ALIGNMENT)
        file.write(memoryview(probe), 0)
        back = _aligned_bytes(ALIGNMENT)
        file.read(memoryview(back), 0)
    except OSError as error:
        reason = "the file system is full" if error.errno == errno.ENOSPC else os.strerror(error.errno or 0)
        raise ValueError(
            f"option disk_dir={path!r}: cannot write and read back a {ALIGNMENT}-byte test block there "
            f"({reason}); pass a directory on a writable local disk with free space"
        ) from error
    finally:
        os.close(file.fd)
    _say_if_in_memory(path)
    free = free_bytes(path)
    if max_bytes is not None and max_bytes > free:
        raise ValueError(
            f"option max_disk_bytes={max_bytes} is more than the {free} bytes free in disk_dir={path!r}; "
            "pass at most that, free space there, or leave max_disk_bytes=None (a share of the free space)"
        )
    return DirectoryCheck(free, file.direct)


def _open_or_say_why(directory: str) -> tuple[int, bool]:
    """`_open_file`, its errors a ValueError naming the directory and the fix."""
    try:
        return _open_file(directory)
    except OSError as error:
        if error.errno == errno.EMFILE:
            import resource

            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            fix = (
                f"this process has as many files open as it may ({limit}, `ulimit -n`); close files it does not "
                "need, or raise the limit (`ulimit -n`, resource.setrlimit(RLIMIT_NOFILE, ...))"
            )
        elif error.errno == errno.ENFILE:
            fix = "the system has as many files open as it may (fs.file-max); close files, or raise that limit"
        else:
            fix = "pass a directory this process can write to, on a local disk with free space"
        raise ValueError(
            f"option disk_dir={directory!r}: cannot create a file there ({os.strerror(error.errno or 0)}); {fix}"
        ) from error


def memory_file_system(directory: str) -> str | None:
    """The type of the file system `directory` is on when its files are memory (tmpfs, ramfs:
    /dev/shm, often /tmp, /run), else None (or when the mount table cannot be read)."""
    try:
        with open(_MOUNTINFO, encoding="utf-8", errors="replace") as table:
            lines = table.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(directory)
    best, kind = "", None
    for line in lines:
        # "id parent major:minor root mount-point options [optional fields] - type source options"
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):  # the deepest mount holding it (the last one if stacked)
            best, kind = mount_point, fields[fields.index("-") + 1]
    return kind if kind in _MEMORY_FILE_SYSTEMS else None


def _say_if_in_memory(directory: str) -> None:
    kind = memory_file_system(directory)
    if kind is None or directory in _said_in_memory:
        return
    _said_in_memory.add(directory)
    logger.warning(
        "hf_offload: disk_dir=%r is on %s, a file system in memory: the disk tier's file there takes host RAM "
        "(or swap) beside max_host_bytes, so it spares none. Pass a directory on a local disk (an NVMe drive) as "
        "disk_dir; or leave disk_dir=None and give that memory to max_host_bytes instead.",
        directory,
        kind,
    )


def _aligned_bytes(nbytes: int) -> ctypes.Array:
    raw = (ctypes.c_char * (nbytes + ALIGNMENT))()
    skip = -ctypes.addressof(raw) % ALIGNMENT
    view = (ctypes.c_char * nbytes).from_buffer(raw, skip)
    view._keep = raw  # type: ignore[attr-defined]
    return view


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = _pwrite(fd, data, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"a write at offset {offset} wrote nothing")
        data, offset = data[written:], offset + written


def _read_all(fd: int, into: memoryview, offset: int) -> None:
    while into:
        count = _preadv(fd, [into], offset)
        if count <= 0:
            raise OSError(
                errno.EIO, f"the file ended at offset {offset} with {len(into)} bytes still to read (truncated?)"
            )
        into, offset = into[count:], offset + count  # a short read goes on where it stopped


def _host_memory(buffer: HostBuffer, nbytes: int) -> memoryview:
    """The first `nbytes` bytes of a pooled host buffer as a memoryview the I/O calls can take."""
    return memoryview((ctypes.c_char * nbytes).from_address(buffer.data_ptr())).cast("B")


class _File:
    """The descriptor the threads use, and whether it is still opened with O_DIRECT. `stopping`:
    the store is shutting down, and the transfers still queued are dropped."""

    __slots__ = ("fd", "direct", "lock", "stopping")

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd, self.direct = fd, direct
        self.lock = threading.Lock()
        self.stopping = False

    def write(self, data: memoryview, offset: int) -> None:
        self._transfer(_write_all, data, offset)

    def read(self, into: memoryview, offset: int) -> None:
        self._transfer(_read_all, into, offset)

    def _transfer(self, transfer, memory: memoryview, offset: int) -> None:
        direct = self.direct  # as issued: another thread may turn it off meanwhile
        try:
            transfer(self.fd, memory, offset)
        except OSError as error:
            if error.errno != errno.EINVAL or not direct:
                raise
            # O_DIRECT refused in a transfer although the open took it (a device whose logical
            # block is larger than ALIGNMENT, a file system that accepts the flag and not the I/O):
            # plain I/O from now on, for reads and writes alike. Positional: the retry starts over.
            self._stop_direct()
            transfer(self.fd, memory, offset)

    def _stop_direct(self) -> None:
        with self.lock:
            if self.direct:
                import fcntl

                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False


class Job:
    """One tensor's write or read: its chunks run on the I/O threads; the training thread reaps it."""

    __slots__ = (
        "kind",
        "copy",
        "buffer",
        "context",
        "offset",
        "length",
        "ready",
        "error",
        "started",
        "seconds",
        "remaining",
        "done",
        "lock",
        "reaped",
    )

    def __init__(self, kind: str, copy, buffer: HostBuffer, context, offset: int, length: int, ready) -> None:
        self.kind = kind
        self.copy = weakref.ref(copy)
        self.buffer = buffer  # owned by the job until it is reaped
        self.context = context  # the DeviceContext whose pool the buffer belongs to
        self.offset, self.length = offset, length
        self.ready = ready  # a wait for the copy stream, run on the I/O thread before the first chunk
        self.error: BaseException | None = None
        self.started = 0.0
        self.seconds = 0.0
        self.remaining = 0
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.reaped = False


def _run_chunk(file: _File, job: Job, start: int, length: int, finished: collections.deque) -> None:
    try:
        if file.stopping and job.error is None:
            job.error = DiskTierError("the disk tier was shut down before this transfer ran")
        if job.error is None:
            memory = _host_memory(job.buffer, job.length)[start : start + length]
            if job.kind == "write":
                file.write(memory, job.offset + start)
            else:
                file.read(memory, job.offset + start)
    except BaseException as error:  # noqa: BLE001 - reported to the training thread, never lost
        job.error = error
    with job.lock:
        job.remaining -= 1
        last = job.remaining == 0
    if last:
        job.seconds = time.perf_counter() - job.started
        finished.append(job)
        job.done.set()


def _worker(file: _File, work: queue.SimpleQueue, finished: collections.deque) -> None:
    while True:
        item = work.get()
        if item is None:
            return
        job, start, length = item
        if start == 0:
            if job.ready is not None:
                try:
                    job.ready()  # the copy stream's event: releases the GIL while it waits
                except BaseException as error:  # noqa: BLE001 - reported to the training thread
                    job.error = error
            job.started = time.perf_counter()
            # Only now the other chunks: none may touch the buffer before the wait above.
            for rest in range(start + length, job.length, CHUNK_BYTES):
                work.put((job, rest, min(CHUNK_BYTES, job.length - rest)))
        _run_chunk(file, job, start, length, finished)


def _shutdown(file: _File, work: queue.SimpleQueue, threads: list[threading.Thread], owner: int) -> None:
    """Stop the threads and close the file (the store is closed, collected, or the process exits).
    Transfers still queued are dropped: nothing will read what they would move (at exit after a
    KeyboardInterrupt mid-forward, gigabytes of writes would otherwise hold the exit up)."""
    file.stopping = True
    if forks.made_here(owner):
        for _ in threads:
            work.put(None)
        current = threading.current_thread()
        for thread in threads:
            if thread is not current:
                thread.join(timeout=JOIN_SECONDS)
        if any(thread.is_alive() and thread is not current for thread in threads):
            # A thread still inside a transfer (a hung disk): closing now would let that transfer
            # land in whatever file reuses the descriptor's number. The descriptor is left open.
            return
    # In a forked child there are no threads, and the descriptor is the child's own copy: closing
    # it lets go of the parent's file without touching it.
    with contextlib.suppress(OSError):
        os.close(file.fd)


class _FileSpace:
    """Space in the file: extents handed out best fit from those given back, else at its end; the
    file ends after the last extent in use (`end`)."""

    __slots__ = ("free", "end", "held")

    def __init__(self) -> None:
        self.free = ExtentMap()  # one region, 0: the file
        self.end = 0
        self.held = 0

    def allocate(self, size: int) -> int:
        self.held += size
        found = self.free.take(size)
        if found is None:
            offset, self.end = self.end, self.end + size
            return offset
        return found[1]

    def release(self, offset: int, size: int) -> None:
        self.held -= size
        start, end = self.free.give(0, offset, size)
        if end == self.end:
            self.free.remove(0, start, end)
            self.end = start  # the tail is free: the file can end here


class DiskStore:
    """The offloader's file, its free space, its I/O threads and its counters.

    It belongs to the process that opened it. In a process forked from that one it is inert
    (`forks`): it takes no tensor, truncates, writes and closes nothing of the file it shares with
    the parent, gives back nothing, and raises `DiskTierError` at once for a read or a wait, which
    no thread there would ever finish."""

    def __init__(self, directory: str, max_bytes: int, *, io_threads: int = IO_THREADS) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._owner = forks.this_process()
        self._file = _File(*_open_or_say_why(directory))
        self._space = _FileSpace()
        self._lock = threading.RLock()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._finished: collections.deque[Job] = collections.deque()
        self._pending: list[Job] = []  # submitted, not reaped, in order
        self._threads: list[threading.Thread] = []
        # Before any thread starts: a thread that cannot start (a process out of threads) leaves
        # neither the descriptor nor the threads started so far behind.
        self._closer = weakref.finalize(self, _shutdown, self._file, self._work, self._threads, self._owner)
        try:
            for i in range(io_threads):
                thread = threading.Thread(
                    target=_worker,
                    args=(self._file, self._work, self._finished),
                    name=f"hf_offload-disk-{i}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self._closer()
            raise
        self._closing = False
        self.failure: str | None = None  # why new tensors are not taken, until the next step
        self._warned = False  # a failed write is said once
        self._file_bytes = 0  # the file's size as last set (it only matters for truncating)
        # Counters, read into each step's statistics.
        self.bytes_written = 0
        self.bytes_read = 0
        self.write_seconds = 0.0
        self.read_seconds = 0.0
        self.wait_seconds = 0.0
        self.reads_waited = 0  # reads backward had to wait for

    @property
    def mode(self) -> str:
        return "O_DIRECT" if self._file.direct else "buffered"

    @property
    def held_bytes(self) -> int:
        return self._space.held

    @property
    def inherited(self) -> bool:
        """This process is a fork of the one that opened the store: it is the parent's."""
        return not forks.made_here(self._owner)

    def accepts(self, nbytes: int) -> bool:
        return (
            self.failure is None
            and not self._closing
            and self._space.held + nbytes <= self.max_bytes
            and not self.inherited
        )

    def new_step(self) -> None:
        """A write that failed stops the tier until the next step, when it is tried again."""
        self.failure = None

    def reopened(self) -> DiskStore:
        """A store of this process's own in the same directory, with the same limit (for a forked
        child, whose inherited store is the parent's)."""
        return DiskStore(self.directory, self.max_bytes, io_threads=len(self._threads) or IO_THREADS)

    # ----- writes (forward)

    def write(self, copy, context, event) -> None:
        """Queue the write of `copy`'s staging buffer (its `host_block`, being filled by the copy
        out that `event` marks on the copy stream) to a new extent of the file. In a forked child
        (a fork in the middle of a layer) the copy stays in host memory, as after a failed write."""
        if self.inherited:
            return
        buffer = copy.host_block
        with self._lock:
            offset = self._space.allocate(buffer.size)
            self._set_end(self._space.end)
        copy.disk_offset = offset
        job = Job("write", copy, buffer, context, offset, buffer.size, context.streams.host_waiter(event))
        copy.job = job
        self._submit(job)

    # ----- reads (backward)

    def read(self, copy, context, *, needed_now: bool) -> bool:
        """Queue the read of `copy` back into a staging buffer. One read ahead of need is not
        started when the host budget has no room for its buffer, or host memory cannot be had now
        (it is tried again at the next layer); one needed now always is, and raises
        `DiskTierError` if no host memory can be had for it."""
        self._refuse_if_inherited()
        size = copy.host_size
        pool = context.pool
        if not needed_now and not pool.budget.has_room(size):
            return False
        try:
            buffer = pool.acquire(size)
        except (RuntimeError, MemoryError) as error:
            if not needed_now:
                return False
            raise DiskTierError(
                f"hf_offload: could not get {size} bytes of host memory to read an activation back from disk_dir="
                f"{self.directory!r} into ({error}); backward needs it now. Lower max_host_bytes, or free host memory."
            ) from error
        streams = context.streams
        # The buffer may have been the source of a copy back still queued on the copy stream.
        fence = streams.host_waiter(streams.record(streams.copy_stream))
        job = Job("read", copy, buffer, context, copy.disk_offset, size, fence)
        copy.job = job
        self._submit(job)
        return True

    def _submit(self, job: Job) -> None:
        job.remaining = -(-job.length // CHUNK_BYTES)
        with self._lock:
            self._pending.append(job)
        self._work.put((job, 0, min(CHUNK_BYTES, job.length)))  # the worker queues the rest

    def _refuse_if_inherited(self) -> None:
        if self.inherited:
            raise DiskTierError(
                f"hf_offload: this process was forked from the one that offloaded this activation to disk_dir="
                f"{self.directory!r}; its bytes are in that process's file, which a forked child never reads (the "
                "parent may have reused the space) and has no threads to read. Run the backward in the process that "
                "ran the forward; forward passes run in the child get a disk tier of their own."
            )

    # ----- the training thread

    def reap(self) -> None:
        """Settle every finished job (never waits)."""
        if self.inherited:
            return  # the jobs and what they hold are the parent's
        while self._finished:
            try:
                job = self._finished.popleft()
            except IndexError:
                return
            self._settle(job)

    def wait(self, job: Job) -> None:
        """Block until `job` is done (time the compute waits on the disk), then settle it."""
        self._refuse_if_inherited()
        if not job.done.is_set():
            if job.kind == "read":
                self.reads_waited += 1
            started = time.perf_counter()
            job.done.wait()
            self.wait_seconds += time.perf_counter() - started
        self.reap()
        self._settle(job)

    def wait_for_room(self, budget: HostBudget, nbytes: int) -> None:
        """Wait for writes in flight, oldest first, until the host budget has `nbytes` free for a
        new staging buffer, or no write is left to wait for."""
        while not budget.has_room(nbytes):
            oldest = next((job for job in self._pending if job.kind == "write"), None)  # settled jobs leave _pending
            if oldest is None:
                return
            self.wait(oldest)

    def _settle(self, job: Job) -> None:
        with self._lock:  # against `orphan`, which a dying copy calls from any thread
            if job.reaped:
                return
            job.reaped = True
            self._pending.remove(job)
            copy = job.copy()
            if copy is not None and copy.job is job:
                copy.job = None
            if job.kind == "write":
                self._settle_write(job, copy)
            else:
                self._settle_read(job, copy)

    def orphan(self, job: Job) -> bool:
        """A copy dies with `job` in flight: True if the job, when settled, gives back its buffer
        and its extent; False if it was settled already (the copy gives back what it holds)."""
        with self._lock:
            if job.reaped:
                return False
            job.copy = _no_copy
            return True

    def _settle_write(self, job: Job, copy) -> None:
        pool, buffer = job.context.pool, job.buffer
        if job.error is not None:
            self._release_extent(job.offset, job.length)
            self._write_failed(job.error)
            if copy is not None:
                copy.disk_offset = None  # it stays in host memory, in its staging buffer
                return
        else:
            self.bytes_written += job.length
            self.write_seconds += job.seconds
            if copy is None:
                self._release_extent(job.offset, job.length)
            else:
                copy.host_block = None
        pool.release(buffer)

    def _settle_read(self, job: Job, copy) -> None:
        pool, buffer = job.context.pool, job.buffer
        if copy is None:
            self._release_extent(job.offset, job.length)
        elif job.error is None:
            self.bytes_read += job.length
            self.read_seconds += job.seconds
            copy.host_block = buffer
            return
        else:
            copy.read_error = job.error
        pool.release(buffer)

    def _write_failed(self, error: BaseException) -> None:
        reason = os.strerror(error.errno) if isinstance(error, OSError) and error.errno else str(error)
        self.failure = reason
        if not self._warned:
            self._warned = True
            logger.warning(
                "hf_offload: writing offloaded activations to disk_dir=%r failed (%s); the tensors in flight stay "
                "in host memory and the rest of this step's go to host memory or stay on the device. Training goes "
                "on; the disk is tried again at the next step.",
                self.directory,
                reason,
            )

    # ----- space

    def release(self, offset: int, size: int) -> None:
        """An extent whose tensor died (its job, if any, already settled)."""
        self._release_extent(offset, size)

    def _release_extent(self, offset: int, size: int) -> None:
        if self.inherited:
            return  # the parent's extent, in the parent's file
        with self._lock:
            self._space.release(offset, size)
            if not self._space.held:
                self._set_end(0)
                if self._closing and not self._pending:
                    self._closer()

    def _set_end(self, end: int) -> None:
        # The file is extended by writes themselves; only giving space back needs a call. Never in
        # a forked child: the file is the parent's, and truncating it would take the parent's bytes.
        if end == 0 and self._file_bytes and not self.inherited:
            with contextlib.suppress(OSError):  # space not given back is no reason to stop training
                os.ftruncate(self._file.fd, 0)
        self._file_bytes = end

    def close(self) -> None:
        """No new tensors; the file and threads go once no tensor is in it (at once if none is).
        In a forked child, nothing: the file and the threads are the parent's."""
        if self.inherited:
            return
        with self._lock:
            self._closing = True
            pending = list(self._pending)
        for job in pending:
            self.wait(job)
        with self._lock:
            if not self._space.held:
                self._closer()

    @property
    def closed(self) -> bool:
        return not self._closer.alive
