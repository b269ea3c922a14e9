"""Domain exceptions and the one table that maps them to errno.

Invariants:
- Lower layers (journal, staging, namespace, fs, tiers) raise the exceptions defined here
  (or let an ``OSError`` from the local filesystem through). They never pick an errno.
- ``errno_for`` is the only place that decides which errno the application sees. The FUSE
  adapter calls it; nothing else does.
- ``UserError`` is the "quiet" error: the CLI prints its message as one line and exits with
  its ``exit_code``, without a traceback.
"""

from __future__ import annotations

import errno


class CkptfsError(Exception):
    """Base of every ckptfs domain exception."""


class UserError(CkptfsError):
    """A mistake the user can fix (bad config, bad mountpoint, ...): one line, no traceback."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class FsError(CkptfsError):
    """An error an application sees as a failed filesystem call."""


class NotFound(FsError):
    """ENOENT (errno table below)."""


class AlreadyExists(FsError):
    """EEXIST (errno table below)."""


class NotEmpty(FsError):
    """ENOTEMPTY (errno table below)."""


class NotADirectory(FsError):
    """ENOTDIR (errno table below)."""


class IsADirectory(FsError):
    """EISDIR (errno table below)."""


class NameTooLong(FsError):
    """ENAMETOOLONG (errno table below)."""


class InvalidArgument(FsError):
    """EINVAL (errno table below)."""


class NotPermitted(FsError):
    """The operation is refused whatever the caller's rights (hard links, read-only xattrs)."""


class NoSuchAttribute(FsError):
    """ENODATA (errno table below)."""


class Unsupported(FsError):
    """EOPNOTSUPP (errno table below)."""


class BadHandle(FsError):
    """A file handle that is unknown or not open in the needed mode."""


class FileTooLarge(FsError):
    """EFBIG (errno table below): a size the staging directory could never hold."""


class StagingFull(FsError):
    """The staging directory has no room and none could be freed in time."""


class CrossDevice(FsError):
    """EXDEV (errno table below)."""


class StoreUnavailable(CkptfsError):
    """A tier could not be reached; transient unless said otherwise."""


class ChecksumMismatch(CkptfsError):
    """Bytes read back from a tier do not match the checksum recorded at upload."""


class ObjectGone(CkptfsError):
    """The object behind a file was deleted or replaced in the store (ESTALE, as NFS says)."""


class NeedsRestore(CkptfsError):
    """The file is only in an archive storage class: ``ckptfs restore`` must bring it back."""


class StoreRefused(CkptfsError):
    """A permanent store error (bad credentials, missing bucket, invalid key): not retried
    by readers either (EIO)."""


class JournalCorrupt(CkptfsError):
    """The journal cannot be opened or does not match what this version expects."""


# The single exception -> errno table. Order matters only for subclasses (first match wins).
_ERRNO_TABLE: tuple[tuple[type[BaseException], int], ...] = (
    (NotFound, errno.ENOENT),
    (AlreadyExists, errno.EEXIST),
    (NotEmpty, errno.ENOTEMPTY),
    (NotADirectory, errno.ENOTDIR),
    (IsADirectory, errno.EISDIR),
    (NameTooLong, errno.ENAMETOOLONG),
    (InvalidArgument, errno.EINVAL),
    (NotPermitted, errno.EPERM),
    (NoSuchAttribute, errno.ENODATA),
    (Unsupported, errno.EOPNOTSUPP),
    (BadHandle, errno.EBADF),
    (FileTooLarge, errno.EFBIG),
    (StagingFull, errno.ENOSPC),
    (CrossDevice, errno.EXDEV),
    (StoreUnavailable, errno.EIO),
    (ChecksumMismatch, errno.EIO),
    (ObjectGone, errno.ESTALE),
    (StoreRefused, errno.EIO),
    # "Try again later": the restore has been requested and takes hours in a real store.
    (NeedsRestore, errno.EAGAIN),
    (JournalCorrupt, errno.EIO),
)


def errno_for(exc: BaseException) -> int | None:
    """The errno an application sees for ``exc``; None if it is unexpected (a bug: EIO + log)."""
    for kind, code in _ERRNO_TABLE:
        if isinstance(exc, kind):
            return code
    if isinstance(exc, OSError) and exc.errno:
        # The staging filesystem already chose an errno (ENOSPC, EFBIG, EDQUOT, ...).
        return exc.errno
    return None
