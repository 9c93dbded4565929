"""The errors a user can fix: bad config, data, model folders, trajectory files, checkpoints.

Every anticipated failure raises a subclass of :class:`UserError` whose message names the thing
(field, file, line) and the fix. The CLI prints such a message on one line and exits with code 2;
any other exception is a bug and keeps its traceback. This module imports nothing from graftrl, so
every layer may raise these.
"""

from __future__ import annotations


class UserError(ValueError):
    """An anticipated failure: one line naming what is wrong and how to fix it (CLI exit 2)."""


class CheckpointError(UserError):
    """A checkpoint is missing, damaged or does not belong to this run."""


class RunLockError(UserError):
    """Another live process holds the run folder."""


class ModelError(UserError):
    """A model folder is missing, incomplete (no tokenizer) or cannot hold the configured lengths."""


class TrainingDivergedError(UserError):
    """The loss or gradient norm stayed NaN/inf for too many optimizer steps in a row."""


def is_out_of_memory(error: BaseException) -> bool:
    """Host or device memory ran out (not the input's fault: the CLI says so in its own line). By
    class name, so torch's ``OutOfMemoryError`` counts without importing torch, as does one a
    worker process raised and a remote backend rebuilt."""
    return isinstance(error, MemoryError) or any(
        c.__name__ == "OutOfMemoryError" for c in type(error).__mro__
    )
