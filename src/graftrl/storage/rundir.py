"""The run folder: every path in it and its JSONL logs (their declared keys: graftrl.storage.log_keys).

This module is the one owner of a run folder's layout; every other module asks :class:`RunDir`
for a path instead of naming a file. Layout of ``graftrl train --out RUN``::

    RUN/
      config.yaml                      the resolved config (rewritten at every start)
      metrics.jsonl                    one row per (step, policy): the keys of METRIC_KEYS
      samples.jsonl                    example responses per step (logging.log_samples)
      compatibility.jsonl              every compatibility score s of a step's transferred responses
      rescues.jsonl                    every response of a rescue round (method: hint) with its hint
      validation.jsonl                 one row per (validation, policy): VALIDATION_KEYS
      <log>.discarded.jsonl            rows a resume cut from <log> (later steps, torn lines)
      checkpoints/step_000003/         after 3 completed steps (graftrl.storage.checkpoint):
        <policy>/  method_state.json  trainer_state.json  manifest.json (written last)
      checkpoints/damaged/             checkpoints a resume found damaged (never deleted)
      best/<policy>/  best/best.json   the validation-selected checkpoints (validation.every)
      store/                           the trajectory store (store.record; graftrl.storage.store)
      tensorboard/                     TensorBoard events (logging.tensorboard)
      analysis/                        `graftrl analyze` output
      eval/  eval-best/                `graftrl eval RUN [--best]` output
      run.lock                         the OS lock of the process training into RUN
      errors.log                       full reports of policy workers (Ray actors, ranks) that died
      done.json                        `graftrl compare`: the cell finished (config digest, scores)
      cell.json                        `graftrl compare`: what the cell was trained from, by content

``graftrl compare --out OUT`` (and ``graftrl demo``) write ``OUT/data/{train,heldout}.jsonl``,
``OUT/runs/<variant>-seed<seed>/`` (a run folder each), ``results.json``, ``results.csv`` and
``report.md`` (:class:`ExperimentDir`).

The JSONL logs are append-only; a kill may leave a torn last line, which readers skip. On resume
``RunDir.truncate_logs`` cuts them back to the resumed step (rows moved to ``*.discarded.jsonl``,
never lost). Storage layer: imports only ``graftrl.errors`` and ``graftrl.files``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftrl.errors import UserError
from graftrl.files import atomic_write, remove_stale_temps

# ----- names inside a checkpoint folder (their format: graftrl.storage.checkpoint) -----------------
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
METHOD_STATE = "method_state.json"
DAMAGED = "damaged"
"""Sub-folder of ``checkpoints/`` where resume sets aside damaged checkpoints (never deleted)."""
STAGING_SUFFIX = ".tmp"
_CHECKPOINT_FOLDER = re.compile(r"^step_(\d{6,})$")


def checkpoint_name(completed_steps: int) -> str:
    return f"step_{completed_steps:06d}"


def checkpoint_step(folder: Path) -> int | None:
    """Completed steps from a checkpoint folder's name; None for anything else (staging, damaged/)."""
    match = _CHECKPOINT_FOLDER.match(folder.name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Folder:
    """An output folder's paths, built from its root (nothing is created or read by constructing it)."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))


class RunDir(Folder):
    """The paths of one run folder (nothing is created or read by constructing it)."""

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def samples(self) -> Path:
        return self.root / "samples.jsonl"

    @property
    def compatibility(self) -> Path:
        return self.root / "compatibility.jsonl"

    @property
    def validation(self) -> Path:
        return self.root / "validation.jsonl"

    @property
    def rescues(self) -> Path:
        return self.root / "rescues.jsonl"

    @property
    def logs(self) -> tuple[Path, ...]:
        """The derived JSONL logs, cut back together on resume."""
        return (self.metrics, self.samples, self.compatibility, self.validation, self.rescues)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, completed_steps: int) -> Path:
        """The checkpoint folder after ``completed_steps`` training steps."""
        return self.checkpoints / checkpoint_name(completed_steps)

    @property
    def best(self) -> Path:
        """``best/<policy>/``: each policy's validation-selected checkpoint."""
        return self.root / "best"

    @property
    def best_index(self) -> Path:
        """``best/best.json``: {policy: {"step", "completed_steps", "aggregate"}}."""
        return self.best / "best.json"

    @property
    def store(self) -> Path:
        """The trajectory store's default place (``store.path`` overrides it)."""
        return self.root / "store"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def analysis(self) -> Path:
        """Default output folder of ``graftrl analyze``."""
        return self.root / "analysis"

    def evaluation(self, best: bool) -> Path:
        """Default output folder of ``graftrl eval RUN`` (``--best``: of the best checkpoints)."""
        return self.root / ("eval-best" if best else "eval")

    @property
    def lock(self) -> Path:
        return self.root / "run.lock"

    @property
    def errors_log(self) -> Path:
        """Full reports (tracebacks) of policy workers that died or failed (Ray actors, ranks):
        the terminal gets one paragraph naming this file (``graftrl.training.failures``)."""
        return self.root / "errors.log"

    def bulky(self) -> tuple[Path, ...]:
        """What a finished run's results do not need: weights, trajectories and the lock (a
        finished compare cell copied to another folder leaves them out)."""
        return (self.checkpoints, self.best, self.store, self.tensorboard, self.lock)

    @property
    def done(self) -> Path:
        """``graftrl compare``'s record that this (variant, seed) cell finished, with its scores."""
        return self.root / "done.json"

    @property
    def cell_inputs(self) -> Path:
        """``graftrl compare``'s record of what a cell was trained from, by content, written when
        it starts (``reporting.cell_inputs``)."""
        return self.root / "cell.json"

    def is_compare_cell(self) -> bool:
        """A `graftrl compare` cell (it records ``cell.json``): continued or retrained by rerunning
        its compare, which has no ``--resume`` or ``--force`` (error messages say so)."""
        return self.cell_inputs.is_file()

    def resume_remedy(self) -> str:
        """How an error message tells a user to continue this run from its last checkpoint."""
        if self.is_compare_cell():
            return "rerun the same `graftrl compare` (it continues the cell from its last checkpoint)"
        return "--resume"

    def holds_run(self) -> bool:
        """A run has logged at least one step here (``graftrl train`` refuses it without --resume)."""
        return self.metrics.exists()

    def is_run(self) -> bool:
        """A run folder (its resolved config is there), as opposed to a checkpoint folder."""
        return self.config.is_file()

    def truncate_logs(self, step: int) -> dict[Path, int]:
        """Cut every derived log back to rows of steps <= ``step`` (on resume).

        Leftover temp files of interrupted atomic writes go first. Returns the logs that held
        unreadable lines (a torn write) with their count; those lines moved aside too.
        """
        remove_stale_temps(self.root)
        torn = {}
        for path in self.logs:
            _, bad = truncate_jsonl(path, step)
            if bad:
                torn[path] = bad
        return torn


class BaseConfigDir(Folder):
    """A base config with its problems, as ``graftrl embedded`` writes it (``compare`` without
    ``--base``: in ``OUT/data``)."""

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def train(self) -> Path:
        return self.root / "train.jsonl"

    @property
    def heldout(self) -> Path:
        return self.root / "heldout.jsonl"


class ExperimentDir(Folder):
    """The output folder of ``graftrl compare`` / ``graftrl demo``: a run folder per (variant, seed)."""

    @property
    def base(self) -> BaseConfigDir:
        """The embedded base config a compare without ``--base`` writes and trains on."""
        return BaseConfigDir(self.root / "data")

    @property
    def train_data(self) -> Path:
        return self.base.train

    @property
    def heldout_data(self) -> Path:
        return self.base.heldout

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def run(self, name: str, seed: int | None = None) -> RunDir:
        """``runs/<name>-seed<seed>`` (``runs/<name>`` without a seed, e.g. the warm-start cell)."""
        return RunDir(self.runs / (name if seed is None else f"{name}-seed{seed}"))

    @property
    def results(self) -> Path:
        return self.root / "results.json"

    @property
    def results_csv(self) -> Path:
        return self.root / "results.csv"

    @property
    def report(self) -> Path:
        return self.root / "report.md"


def ensure_writable(folder: Path, what: str) -> Path:
    """Create ``folder`` (with its parents) and prove a file can be written there, before a command
    does its work: an output that cannot be written is refused in one line up front, not after an
    hour of evaluation. ``what`` names the option (``--out``); returns the folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".graftrl-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise UserError(
            f"{what} {folder}: cannot write there ({error.strerror or type(error).__name__}"
            f"{f': {error.filename}' if error.filename and str(error.filename) != str(folder) else ''}); "
            "choose a writable folder"
        ) from None
    return folder


class ProbeDir(Folder):
    """The output folder of ``graftrl probe`` (its files' rows: graftrl.experiments.probe)."""

    @property
    def samples(self) -> Path:
        """Every sampled response: step, model, prompt, reward, advantage, tokens, text."""
        return self.root / "samples.jsonl"

    @property
    def candidates(self) -> Path:
        """Every response of every candidate peer group, scored on its receiver: s, w, admitted."""
        return self.root / "candidates.jsonl"

    @property
    def compatibility(self) -> Path:
        """The method's own exchange, as a run's compatibility.jsonl would log it."""
        return self.root / "compatibility.jsonl"

    @property
    def moved_groups(self) -> Path:
        """Each peer group the method's plan moves, with its contrast sums."""
        return self.root / "moved_groups.jsonl"

    @property
    def steps(self) -> Path:
        """One row per (step, policy): a training step's metrics less the update's, and timings."""
        return self.root / "steps.jsonl"

    @property
    def logs(self) -> tuple[Path, ...]:
        return (self.samples, self.candidates, self.compatibility, self.moved_groups, self.steps)

    @property
    def json(self) -> Path:
        return self.root / "probe.json"

    @property
    def report(self) -> Path:
        return self.root / "probe.md"

    def plot(self, name: str) -> Path:
        return self.root / f"{name}.png"

    def plots(self) -> list[Path]:
        """The plots in the folder (an earlier probe's, before a new one writes)."""
        return sorted(self.root.glob("*.png"))


# ----- JSONL logs ----------------------------------------------------------------------------------


class RunLogError(UserError, json.JSONDecodeError):
    """A line of a run log that is not a JSON object (other than a torn last line).

    A ``json.JSONDecodeError`` too, so callers that catch decoding errors keep working.
    """

    def __init__(self, message: str, line: str, position: int = 0) -> None:
        json.JSONDecodeError.__init__(self, message, line, position)
        self.args = (message,)


def append_jsonl(path: Path, rows: dict[str, Any] | Iterable[dict[str, Any]]) -> None:
    """Append one row (or several, in one open) to a JSONL log, one JSON object per line."""
    batch = [rows] if isinstance(rows, dict) else list(rows)
    with path.open("a") as handle:
        for row in batch:
            handle.write(json.dumps(row) + "\n")


def read_jsonl(
    path: Path,
    on_torn: Callable[[str], None] | None = None,
    *,
    check: Callable[[dict[str, Any]], str | None] | None = None,
    on_bad: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """The rows of a JSONL log. A torn last line (a run killed mid-append) is skipped, with a note
    to ``on_torn``. Any other line that is not UTF-8 text holding a JSON object, or that ``check``
    rejects (``check(row)`` returns what is wrong, None when nothing is), raises RunLogError naming
    the file and line, or with ``on_bad`` is skipped and reported to it (``file:line: what``)."""
    lines = path.read_bytes().splitlines()
    last = max((number for number, line in enumerate(lines, start=1) if line.strip()), default=0)
    rows = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        problem, row = _parse_line(raw)
        if problem is None and check is not None:
            problem = check(row)
        if problem is None:
            rows.append(row)
            continue
        if problem.startswith("not valid JSON") and number == last:
            if on_torn is not None:
                on_torn(f"{path.name} line {number}: incomplete last line skipped (interrupted write)")
            continue
        if on_bad is None:
            fix = "repair or delete the line"
            raise RunLogError(f"{path} line {number}: {problem}; {fix}", raw.decode("utf-8", "replace"))
        on_bad(f"{path}:{number}: {problem}; line skipped")
    return rows


def _parse_line(raw: bytes) -> tuple[str | None, Any]:
    """(what is wrong with a log line, or None; the row)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"not UTF-8 text (byte {error.start})", None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        return f"not valid JSON ({error.msg})", None
    if not isinstance(row, dict):
        return "expected a JSON object", None
    return None, row


def read_metrics(run_dir: str | Path, on_bad: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``; a torn last line is skipped (for reports that check
    each row's keys and skip damaged lines: ``graftrl.reporting.run_logs``)."""
    return read_jsonl(RunDir(run_dir).metrics, on_bad=on_bad)


def discarded_path(path: Path) -> Path:
    """Where ``truncate_jsonl`` keeps the lines it removes (``metrics.discarded.jsonl``)."""
    return path.with_name(f"{path.stem}.discarded{path.suffix}")


def truncate_jsonl(path: Path, step: int) -> tuple[int, int]:
    """Keep the rows of steps <= ``step`` in a JSONL log (on resume); returns (rows moved, bad lines).

    Later rows, and lines that are not JSON objects (a torn last line left by a kill), move to
    ``<name>.discarded.jsonl`` rather than being lost. Rows without a step are kept. The log is
    rewritten atomically, so a kill during the truncation leaves the old or the new file.
    """
    if not path.exists():
        return 0, 0
    raw = path.read_bytes()
    kept, discarded, bad = [], [], 0
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            bad += 1
            discarded.append(line)
        elif isinstance(row.get("step", -1), int | float) and row.get("step", -1) <= step:
            kept.append(line)
        else:
            discarded.append(line)
    if discarded:
        with discarded_path(path).open("a") as handle:
            handle.write("\n".join(discarded) + "\n")
    if discarded or (raw and not raw.endswith(b"\n")):
        atomic_write(path, "".join(line + "\n" for line in kept).encode())
    return len(discarded) - bad, bad
