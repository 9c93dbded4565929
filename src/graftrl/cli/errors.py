"""The CLI's messages for errors: one line naming what went wrong and the usual fix."""

from __future__ import annotations

import errno

USER_ERROR_EXIT_CODE = 2
"""Exit code of an anticipated error (bad config, data, model folder, store, checkpoint)."""


def one_line(error: BaseException) -> str:
    """The error's message on one line (multi-part messages joined with '; ')."""
    parts = [part.strip() for part in str(error).splitlines() if part.strip()]
    return " ".join(part if part.endswith(":") else part + ";" for part in parts).rstrip(";")


def raised_by_graftrl(error: BaseException) -> bool:
    """A FileNotFoundError graftrl raised itself with a message (no errno): a check of ours."""
    return isinstance(error, FileNotFoundError) and error.errno is None


TRACEBACK_ENV = "GRAFTRL_TRACEBACK"
"""Set to 1 to see the traceback of an environment error the CLI reports in one line."""

_ERRNO_FIXES = {
    errno.ENOSPC: "free disk space, then rerun (a training run: --resume)",
    errno.EDQUOT: "free space within your disk quota, then rerun (a training run: --resume)",
    errno.EACCES: "check the path's permissions, or choose another path",
    errno.EPERM: "check the path's permissions, or choose another path",
    errno.EROFS: "the file system is read-only: choose a writable path",
    errno.ENOENT: "check the path (it does not exist, or was removed while graftrl ran)",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
    errno.EISDIR: "the path is a folder where a file was expected: check the path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) or lower reward.workers",
}


def environment_error(error: OSError | MemoryError) -> str:
    """One line for an error the machine raised: what, where, and the usual fix."""
    if isinstance(error, MemoryError):
        return (
            "out of memory; lower train.micro_batch_size / micro_batch_tokens or rollout.max_batch_size, "
            f"or check `graftrl estimate-memory` (set {TRACEBACK_ENV}=1 for the traceback)"
        )
    where = f" ({error.filename})" if error.filename else ""
    what = error.strerror or one_line(error) or type(error).__name__
    fix = _ERRNO_FIXES.get(error.errno or -1, "check the file or resource it names")
    return f"{what}{where}: {fix} (set {TRACEBACK_ENV}=1 for the traceback)"
