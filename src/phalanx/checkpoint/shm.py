"""Shared-memory slots of the flash checkpoint (torch-free: the checkpoint host imports this).

Every training rank owns two *slots*, each a file named ``phx-<job>-r<rank>-s<slot>`` in the user's private
directory of the shared-memory root, ``/dev/shm/phalanx-<uid>/`` (see :func:`private_dir`).
A save always writes the slot that does not hold the newest complete snapshot (and is not pinned by the
persister), so a crash during a save never destroys the last good snapshot.

A slot starts with a fixed 4 KiB header, then the JSON metadata (skeleton and tensor table), then the
raw tensor bytes at a page-aligned offset::

    0      header (struct _HEADER, little endian; see SlotHeader)
    4096   meta JSON (meta_len bytes)
    data_off = align(4096 + meta_len, 4096): tensor bytes, each tensor 64-byte aligned

The header works like a seqlock: a writer first stores ``state=WRITING`` with ``seq+1``, copies, then
stores ``state=COMPLETE``. A reader (the persister, a restarted process) accepts a slot only when it is
COMPLETE and its ``seq`` is the same before and after reading; a process SIGKILLed mid-save leaves
``WRITING`` behind and the slot is ignored.

Local trust: the shared-memory root is world-writable (sticky), so another user of the node could plant a
symlink or a file where a slot will be, and read or change a snapshot. Slots therefore live in a 0700
directory of the user's own, checked before use (:func:`check_private_dir`); slot files are created with
``O_EXCL|O_NOFOLLOW`` and opened with ``O_NOFOLLOW``, and a file that is not the user's own regular,
owner-only file is refused (:func:`open_owned`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import mmap
import os
import re
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

MAGIC = b"PHXCKPT1"
HEADER_SIZE = 4096
PAGE = 4096
TENSOR_ALIGN = 64
SLOTS = 2

STATE_EMPTY = 0
STATE_WRITING = 1
STATE_COMPLETE = 2

# magic, state, seq, step, meta_len, data_off, data_len, crc, crc_seq, rank, world_size, pin
_HEADER = struct.Struct("<8sIQqQQQIQiiI")
_STATE_OFFSET = 8
_CRC_OFFSET = _HEADER.size - 4 - 4 - 4 - 8 - 4  # crc, crc_seq, rank, world_size, pin come last
_PIN_OFFSET = _HEADER.size - 4
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; allocates and maps pages without touching the contents
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

_JOB_RE = re.compile(r"[^A-Za-z0-9_.-]")
MAX_JOB_NAME = 120
"""Longest job part of a file name: a file name has at most 255 bytes, and a job id made of a namespace,
a job name and a Pod name can be longer; a longer one keeps its start and gets a hash of the whole."""


class UnsafePathError(OSError):
    """A checkpoint directory or file that another user could have planted or could change: owned by
    someone else, writable by others, or a symlink."""


def align(value: int, to: int) -> int:
    """Rounds ``value`` up to a multiple of ``to``."""
    return (value + to - 1) // to * to


def sanitize_job(job_id: str) -> str:
    """Makes a job id safe for a file name (distinct ids give distinct names, however long)."""
    safe = _JOB_RE.sub("_", job_id) or "job"
    if len(safe) <= MAX_JOB_NAME:
        return safe
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:16]
    return f"{safe[: MAX_JOB_NAME - 17]}-{digest}"


def private_dir(root: Path) -> Path:
    """This user's directory of checkpoint files under ``root`` (a shared-memory root such as /dev/shm, or
    the temporary directory for sockets): ``root/phalanx-<uid>``. Not created or checked here: see
    :func:`check_private_dir`."""
    return Path(root) / f"phalanx-{os.geteuid()}"


def check_private_dir(path: Path, *, create: bool = True) -> Path:
    """Makes sure ``path`` is a directory only this user can enter: created 0700 when missing (``create``),
    else a real directory (not a symlink) owned by this user, with no permission for anyone else. Raises
    :class:`UnsafePathError`, naming the owner and mode, for one another user could have planted."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    st = os.lstat(path)  # never follow: a symlink here is refused, not resolved
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise UnsafePathError(errno.EPERM, f"refusing the checkpoint directory {path}: it is {kind}")
    if st.st_uid != uid:
        raise UnsafePathError(
            errno.EPERM,
            f"refusing the checkpoint directory {path}: it belongs to uid {st.st_uid}, not to this user "
            f"(uid {uid}); another user may have created it to read or change this user's checkpoints; "
            "remove it, or give another shared-memory directory",
        )
    if st.st_mode & 0o022:
        raise UnsafePathError(
            errno.EPERM,
            f"refusing the checkpoint directory {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users "
            "write to it (it must be 0700)",
        )
    if st.st_mode & 0o077:  # ours and not writable by others: only readable, so it is safe to tighten
        os.chmod(path, 0o700, follow_symlinks=False)
    return path


def check_owned(fd: int, path: Path) -> os.stat_result:
    """Refuses an open file that is not this user's own regular file, or that others may read or write."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(errno.EPERM, f"refusing {path}: not a regular file")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(
            errno.EPERM,
            f"refusing {path}: it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})",
        )
    if st.st_mode & 0o077:
        raise UnsafePathError(
            errno.EPERM, f"refusing {path}: mode {stat.S_IMODE(st.st_mode):04o} is not owner-only (0600)"
        )
    return st


def open_owned(path: Path, flags: int = os.O_RDWR) -> int:
    """Opens an existing checkpoint file without following a symlink (ELOOP) and checks its owner."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        check_owned(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def slot_path(shm_dir: Path, job_id: str, rank: int, slot: int) -> Path:
    """The file of one slot of one rank (``shm_dir`` is the shared-memory root, e.g. /dev/shm)."""
    return private_dir(shm_dir) / f"phx-{sanitize_job(job_id)}-r{rank}-s{slot}"


def job_prefix(job_id: str) -> str:
    """The file-name prefix shared by every segment of a job."""
    return f"phx-{sanitize_job(job_id)}-"


def job_files(shm_dir: Path, job_id: str) -> list[Path]:
    """Every file of a job in this user's directory of the shared-memory root ``shm_dir``."""
    prefix = job_prefix(job_id)
    try:
        return sorted(p for p in private_dir(shm_dir).iterdir() if p.name.startswith(prefix))
    except (FileNotFoundError, NotADirectoryError):
        return []


def list_job_slots(shm_dir: Path, job_id: str) -> dict[int, list[Path]]:
    """Existing slot files of a job, by rank (used by a host that adopts segments after a restart)."""
    found: dict[int, list[Path]] = {}
    pattern = re.compile(re.escape(job_prefix(job_id)) + r"r(\d+)-s(\d+)$")
    for entry in job_files(shm_dir, job_id):
        match = pattern.match(entry.name)
        if match:
            found.setdefault(int(match.group(1)), []).append(entry)
    return found


@dataclasses.dataclass(frozen=True)
class SlotHeader:
    """The decoded header of a slot."""

    state: int = STATE_EMPTY
    seq: int = 0
    step: int = -1
    meta_len: int = 0
    data_off: int = 0
    data_len: int = 0
    crc: int = 0
    crc_seq: int = 0  # seq the crc belongs to; 0 when no checksum was computed yet
    rank: int = -1
    world_size: int = 0
    pin: int = 0  # PIN_QUEUED while a persist of it waits, PIN_WRITING while the persister reads it

    @property
    def complete(self) -> bool:
        """Whether the slot holds a whole snapshot."""
        return self.state == STATE_COMPLETE


def pack_header(buf: mmap.mmap | memoryview, header: SlotHeader) -> None:
    """Publishes a header so that a reader in another process never accepts a half-written one.

    ``struct.pack_into`` would zero-fill the header and then write it field by field, showing a concurrent
    reader transient values. The header is packed apart and copied in whole, with a COMPLETE state first
    written as WRITING and then set alone, in one aligned 4-byte store: a reader that sees COMPLETE sees
    every other field of that header too.
    """
    state = STATE_WRITING if header.state == STATE_COMPLETE else header.state
    packed = _HEADER.pack(
        MAGIC,
        state,
        header.seq,
        header.step,
        header.meta_len,
        header.data_off,
        header.data_len,
        header.crc,
        header.crc_seq,
        header.rank,
        header.world_size,
        header.pin,
    )
    buf[: _HEADER.size] = packed
    if header.state != state:
        _store_u32(buf, _STATE_OFFSET, header.state)


def read_header(buf: mmap.mmap | memoryview | bytes) -> SlotHeader:
    """Decodes a header; a slot that was never written reads as EMPTY."""
    fields = _HEADER.unpack_from(buf, 0)
    if fields[0] != MAGIC:
        return SlotHeader()
    return SlotHeader(*fields[1:])


PIN_QUEUED = 1
"""The slot's snapshot waits in the persister's queue: a save takes this slot only when the other one is
being written (the waiting persist is then superseded by the newer save)."""
PIN_WRITING = 2
"""The persister reads the slot now: no save may take it."""


def set_pin(buf: mmap.mmap, value: int) -> None:
    """Sets only the pin field (:data:`PIN_QUEUED`, :data:`PIN_WRITING` or 0), leaving the rest of the
    header alone."""
    _store_u32(buf, _PIN_OFFSET, value)


def set_crc(buf: mmap.mmap, *, crc: int, seq: int) -> None:
    """Records the checksum of the data of generation ``seq``."""
    buf[_CRC_OFFSET : _CRC_OFFSET + 12] = struct.pack("<IQ", crc, seq)


def _store_u32(buf: mmap.mmap | memoryview, offset: int, value: int) -> None:
    # One 4-byte store (a memoryview item is copied with a fixed-size memcpy): never torn, never zeroed first.
    with memoryview(buf) as whole, whole[offset : offset + 4].cast("I") as word:
        word[0] = value


class Segment:
    """One slot file mapped into this process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        check_private_dir(path.parent, create=False)  # a planted directory symlink is refused too
        self._fd = open_owned(path)  # never a symlink, never another user's file
        try:
            size = os.fstat(self._fd).st_size
            if size < HEADER_SIZE:
                raise ValueError(f"{path} is too small to be a checkpoint slot ({size} bytes)")
            self.size = size
            self.buf = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self._fd)
            raise

    def header(self) -> SlotHeader:
        """The slot's current header."""
        return read_header(self.buf)

    def address(self) -> int:
        """Address of the mapping in this process."""
        probe = ctypes.c_char.from_buffer(self.buf)
        try:
            return ctypes.addressof(probe)
        finally:
            del probe

    def allocated(self) -> bool:
        """Whether every page of the slot has memory behind it, so that writing it cannot fault."""
        return os.fstat(self._fd).st_blocks * 512 >= self.size

    def populate(self, *, threads: int = 1) -> None:
        """Allocates the slot's pages and fills this process's page tables for them, split over ``threads``.

        Writing into a page that tmpfs cannot allocate kills the writer with SIGBUS; populating first turns a
        full ``/dev/shm`` into an OSError (ENOSPC). One pass of MADV_POPULATE_WRITE both allocates and maps,
        in less time than fallocate takes only to allocate (fallocate leaves the page faults to the first
        copy). ctypes releases the GIL, so callers may run it beside training. Kernels before 5.14
        lack the advice: there the pages are allocated with fallocate and mapped by the first copy.
        """
        base = self.address()
        chunk = align(-(-self.size // max(1, threads)), PAGE)
        spans = [(off, min(chunk, self.size - off)) for off in range(0, self.size, chunk)]
        errors = [0] * len(spans)

        def run(k: int) -> None:
            off, length = spans[k]
            if _LIBC.madvise(ctypes.c_void_p(base + off), ctypes.c_size_t(length), _MADV_POPULATE_WRITE):
                errors[k] = ctypes.get_errno()

        workers = [threading.Thread(target=run, args=(k,)) for k in range(1, len(spans))]
        for worker in workers:
            worker.start()
        run(0)
        for worker in workers:
            worker.join()
        err = next((e for e in errors if e), 0)
        if err == errno.EINVAL:  # no MADV_POPULATE_WRITE on this kernel
            os.posix_fallocate(self._fd, 0, self.size)
        elif err:
            # EFAULT is the advice's word for "a write here would SIGBUS": tmpfs has no memory left.
            err = errno.ENOSPC if err == errno.EFAULT else err
            raise OSError(err, f"{os.strerror(err)} (shared memory for {self.size} bytes)", str(self.path))

    def close(self) -> None:
        """Unmaps the slot (the file stays)."""
        with contextlib.suppress(BufferError, ValueError):
            self.buf.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def create(path: Path, size: int) -> None:
    """Creates or grows a slot file to ``size`` bytes. Only the header page is allocated here (reading a
    header must never fault on a full tmpfs); the rest is allocated by the rank that writes the slot
    (:meth:`Segment.populate`), in parallel and off the host's request loop. Contents are kept.

    A new file is created with ``O_EXCL|O_NOFOLLOW`` (a name someone planted meanwhile fails instead of
    being followed); an existing one must be this user's owner-only regular file (:func:`open_owned`)."""
    check_private_dir(path.parent, create=False)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        fd = open_owned(path)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, HEADER_SIZE)
    finally:
        os.close(fd)


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``directory`` (flock on the directory itself: no lock file to leak),
    so that one host's check-and-release of a job's files and another's adoption of them never interleave."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor drops the lock


def unallocated_bytes(path: Path, size: int) -> int:
    """How many more bytes a slot file needs to hold ``size`` bytes with every page allocated."""
    try:
        return max(0, size - os.stat(path).st_blocks * 512)
    except FileNotFoundError:
        return size


def free_bytes(directory: Path) -> int:
    """Bytes still free in the file system of ``directory`` (for a tmpfs: shared memory left)."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize
