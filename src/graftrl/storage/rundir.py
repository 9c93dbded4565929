"""The run folder: every path in it, its JSONL logs, and the declared keys of each log.

This module is the one owner of a run folder's layout; every other module asks :class:`RunDir`
for a path instead of naming a file. Layout of ``graftrl train --out RUN``::

    RUN/
      config.yaml                      the resolved config (rewritten at every start)
      metrics.jsonl                    one row per (step, policy): the keys of METRIC_KEYS
      samples.jsonl                    example responses per step (logging.log_samples)
      compatibility.jsonl              every compatibility score s of a step's transferred responses
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
      done.json                        `graftrl compare`: the cell finished (config digest, scores)

``graftrl compare --out OUT`` (and ``graftrl demo``) write ``OUT/data/{train,heldout}.jsonl``,
``OUT/runs/<variant>-seed<seed>/`` (a run folder each), ``results.json``, ``results.csv`` and
``report.md`` (:class:`ExperimentDir`).

The JSONL logs are append-only; a kill may leave a torn last line, which readers skip. On resume
``RunDir.truncate_logs`` cuts them back to the resumed step (rows moved to ``*.discarded.jsonl``,
never lost). Storage layer: imports only ``graftrl.errors`` and ``graftrl.files``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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
class RunDir:
    """The paths of one run folder (nothing is created or read by constructing it)."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

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
    def logs(self) -> tuple[Path, ...]:
        """The derived JSONL logs, cut back together on resume."""
        return (self.metrics, self.samples, self.compatibility, self.validation)

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

    def bulky(self) -> tuple[Path, ...]:
        """What a finished run's results do not need: weights, trajectories and the lock (a
        finished compare cell copied to another folder leaves them out)."""
        return (self.checkpoints, self.best, self.store, self.tensorboard, self.lock)

    @property
    def done(self) -> Path:
        """``graftrl compare``'s record that this (variant, seed) cell finished, with its scores."""
        return self.root / "done.json"

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


@dataclass(frozen=True)
class ExperimentDir:
    """The output folder of ``graftrl compare`` / ``graftrl demo``: a run folder per (variant, seed)."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def train_data(self) -> Path:
        return self.root / "data" / "train.jsonl"

    @property
    def heldout_data(self) -> Path:
        return self.root / "data" / "heldout.jsonl"

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


def read_jsonl(path: Path, on_torn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The rows of a JSONL log. A torn last line (a run killed mid-append) is skipped, with a note
    to ``on_torn``; any other line that is not a JSON object raises RunLogError naming it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    last = max((number for number, line in enumerate(lines, start=1) if line.strip()), default=0)
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == last:
                if on_torn is not None:
                    on_torn(f"{path.name} line {number}: incomplete last line skipped (interrupted write)")
                continue
            raise RunLogError(
                f"{path} line {number}: not valid JSON ({error.msg}); repair or delete the line",
                line,
                error.pos,
            ) from None
        if not isinstance(row, dict):
            raise RunLogError(f"{path} line {number}: expected a JSON object", line)
        rows.append(row)
    return rows


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``; a torn last line is skipped."""
    return read_jsonl(RunDir(run_dir).metrics)


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


# ----- the declared keys of the logs ----------------------------------------------------------------

Summary = Literal["last", "max", "min", "mean"]


@dataclass(frozen=True)
class LogKey:
    """One key of a run log: a name, or a pattern with one ``<placeholder>`` (``family_reward/<family>``)."""

    name: str
    meaning: str
    unit: str
    group: str
    summary: Summary = "last"
    """The one number per run a dashboard shows (W&B ``define_metric(summary=...)``)."""

    def matches(self, key: str) -> bool:
        """``key`` is this name, or fills its placeholder with a non-empty name."""
        parts = re.split(r"<[a-z_]+>", self.name)
        return re.fullmatch(".+".join(re.escape(part) for part in parts), key) is not None


def _keys(group: str, *entries: tuple[str, str, str] | tuple[str, str, str, Summary]) -> list[LogKey]:
    return [LogKey(e[0], e[1], e[2], group, *e[3:]) for e in entries]


FRACTION = "fraction (0-1)"
REWARD = "mean reward (0-1)"

METRIC_KEYS: tuple[LogKey, ...] = tuple(
    _keys(
        "identity",
        ("step", "training step, 0-based (checkpoint step_N holds the weights after step N - 1)", "step"),
        ("model", "the policy (its `policies[].name`)", "name"),
        ("method", "the run's method", "name"),
        (
            "resume_changed_inputs",
            "inputs (`data.train`, `peers.<name>`) whose content changed since the checkpoint a "
            "`--resume --force` loaded; on the first resumed step only",
            "names",
        ),
    )
    + _keys(
        "outcomes",
        (
            "reward_mean",
            "mean verifier reward of the policy's own groups it trains on this step",
            REWARD,
            "max",
        ),
        ("all_fail_frac", "share of the policy's prompts where every response failed", FRACTION),
        ("all_pass_frac", "share of the policy's prompts where every response passed", FRACTION),
        (
            "complementarity/<peer>",
            "share of the policy's all-fail prompts that <peer> solves at least once (paper Figure 1)",
            FRACTION,
        ),
        ("family_reward/<family>", "mean reward on the step's problems of <family>", REWARD, "max"),
        (
            "family_all_fail/<family>",
            "share of the step's <family> prompts where every response failed",
            FRACTION,
        ),
        (
            "stored_reward_changes/<peer>",
            "stored <peer> groups whose re-verified rewards differ from the stored ones (advantages recomputed)",
            "groups",
        ),
        ("response_length", "mean response length without the EOS token", "tokens"),
        (
            "verifier_timeouts",
            "responses the verifier gave up on (timeout or deadline; reward 0)",
            "responses",
        ),
        ("verifier_restarts", "verifier worker processes restarted", "count"),
    )
    + _keys(
        "dynamic sampling (rollout.dynamic_sampling)",
        ("sampling_rounds", "sampling rounds run to fill the batch with informative groups", "count"),
        ("prompts_sampled", "prompts sampled over all rounds", "prompts"),
        ("groups_kept", "groups kept for training (rewards not all equal)", "groups"),
        ("shared_reward_mean", "mean reward of the first round (the batch shared with peers)", REWARD),
        ("shared_all_fail_frac", "share of first-round prompts where every response failed", FRACTION),
        ("shared_all_pass_frac", "share of first-round prompts where every response passed", FRACTION),
    )
    + _keys(
        "exchange",
        (
            "candidates/<source>",
            "prompts the policy failed entirely on which <source>'s group is mixed (GRAFT eq. 4)",
            "prompts",
        ),
        ("selected/<source>", "candidates selected for transfer from <source> (GRAFT eq. 5)", "prompts"),
        (
            "transferred/<source>",
            "responses of <source> planned into the policy's batch (GRAFT)",
            "responses",
        ),
        ("eligible/<source>", "prompts the policy failed entirely that <source> solved (SGT)", "prompts"),
        (
            "nll_responses/<source>",
            "correct <source> responses trained on with the NLL term (SGT)",
            "responses",
        ),
        (
            "omega/<source>",
            "capability ratio on <source>'s term, clip(P_hat(self) / P_hat(source)) (HACPO)",
            "ratio",
        ),
        ("capability", "P_hat: the policy's mean reward over the capability window (HACPO)", REWARD),
        (
            "baseline_fallbacks",
            "prompts whose capability baseline fell back to the own group mean (HACPO)",
            "prompts",
        ),
        ("pooled_prompts", "prompts trained on as pooled groups of all policies (pooling)", "prompts"),
        ("pooled/<source>", "prompts on which <source>'s group joined the pool (pooling)", "prompts"),
        ("mixed_pools", "pools whose rewards are not all equal (pooling)", "prompts"),
        ("pool_rescued", "prompts with a uniform own group but a mixed pool (pooling)", "prompts"),
        ("peer_responses", "peer responses in the policy's training batch", "responses"),
        ("peer_admitted", "peer responses the compatibility gate admitted (w > 0)", "responses"),
        ("admit_rate", "peer_admitted / peer_responses", FRACTION),
        ("s_mean", "mean compatibility score s of the step's peer responses (eq. 7)", "ratio"),
        ("s_median", "median compatibility score s (eq. 7)", "ratio"),
        ("s_min", "smallest compatibility score s (eq. 7)", "ratio"),
        (
            "contrast_groups",
            "moved peer groups whose contrast was measured (both outcomes; core.contrast)",
            "groups",
        ),
        (
            "contrast_overlap",
            "mean share of a moved wrong response's tokens inside its LCS with the closest correct "
            "response of its group, on the receiver's tokenization (1 = the same tokens)",
            FRACTION,
        ),
        (
            "contrast_divergence",
            "mean position where a moved wrong response first departs from the closest correct one, "
            "as a share of its length (0 = at once)",
            FRACTION,
        ),
        (
            "contrast_lesson",
            "where the lesson is: the share of the receiver's surprise (-log pi_R) on the moved correct "
            "responses' tokens that lies on tokens no wrong response of the group shares (0 = the wrong "
            "responses hold the receiver's hard tokens too, so the push on them cancels)",
            FRACTION,
        ),
        (
            "contrast_mass_correct_shared",
            "per moved group: sum of w·A over the correct responses' tokens that a wrong response shares",
            "advantage",
        ),
        (
            "contrast_mass_correct_distinct",
            "per moved group: sum of w·A over the correct responses' tokens no wrong response shares",
            "advantage",
        ),
        (
            "contrast_mass_wrong_shared",
            "per moved group: sum of w·A over the wrong responses' tokens that a correct response shares",
            "advantage",
        ),
        (
            "contrast_mass_wrong_distinct",
            "per moved group: sum of w·A over the wrong responses' tokens no correct response shares",
            "advantage",
        ),
        ("s_max", "largest compatibility score s (eq. 7)", "ratio"),
        ("w_mean", "mean weight w of the step's peer responses (eq. 8)", "weight (0-1)"),
    )
    + _keys(
        "update",
        ("loss", "mean minibatch loss over the step's optimizer steps (-J, eq. 10)", "loss"),
        ("grad_norm", "mean gradient L2 norm before clipping over the step's optimizer steps", "norm"),
        ("optimizer_steps", "optimizer steps taken", "count"),
        (
            "nonfinite_skips",
            "minibatches whose loss or gradient norm was NaN/inf (no optimizer step)",
            "count",
        ),
        ("train_tokens", "response tokens trained on, own and peer, over all epochs", "tokens"),
        ("train_rows", "rows (responses) trained on, own, peer and NLL, over all epochs", "responses"),
        ("tis_weight_mean", "mean truncated importance weight of own tokens (rollout.tis_cap)", "ratio"),
        ("tis_truncated_frac", "share of own tokens whose importance weight hit rollout.tis_cap", FRACTION),
        (
            "memory_peak_mb",
            "peak memory: the CUDA allocator's, or the process's peak RSS on CPU",
            "MiB",
            "max",
        ),
    )
    + _keys(
        "time",
        ("time_rollout", "sampling the responses", "seconds", "mean"),
        ("time_reward", "verifying the responses and computing advantages", "seconds", "mean"),
        ("time_old_logprob", "the trainer's own old log-probs (rollout.tis_cap)", "seconds", "mean"),
        ("time_peer_logprob", "scoring peer responses under the policy (eq. 7, eq. 9)", "seconds", "mean"),
        ("time_update", "the optimizer steps", "seconds", "mean"),
        ("time_weight_sync", "copying the new weights to the rollout engine", "seconds", "mean"),
        (
            "time_step",
            "the sum of the step's phases above (validation and checkpoints excluded)",
            "seconds",
            "mean",
        ),
    )
)
"""The trainer's keys of a ``metrics.jsonl`` row (also the TensorBoard / W&B scalars, as
``<model>/<key>``); each method's loss adds its own (``graftrl.training.log_schema.metric_keys``)."""

VALIDATION_KEYS: tuple[LogKey, ...] = tuple(
    _keys(
        "validation.jsonl",
        ("step", "training step just completed, 0-based (as in metrics.jsonl)", "step"),
        ("model", "the policy", "name"),
        ("aggregate", "unweighted mean of the benchmarks' pass@1 (selects best/)", FRACTION, "max"),
        (
            "pass_at_1/<benchmark>",
            "pass@1 on <benchmark> (validation.samples samples per problem)",
            FRACTION,
            "max",
        ),
        ("best", "the aggregate is the policy's best so far (its weights went to best/<policy>/)", "bool"),
        ("time_validation", "seconds the policy's validation took", "seconds"),
    )
)
"""Every key of a ``validation.jsonl`` row (a resumed run may repeat a step: the last row wins)."""

COMPATIBILITY_KEYS: tuple[LogKey, ...] = tuple(
    _keys(
        "compatibility.jsonl",
        ("step", "training step, 0-based", "step"),
        ("receiver", "the policy that scored the responses", "name"),
        ("source", "per response: the policy (or stored peer) that sampled it", "names"),
        ("s", "per response: compatibility score s (eq. 7), 5 decimals", "ratio"),
        ("reward", "per response: its verifier reward", "reward"),
        ("w", "per response: the weight applied to it (eq. 8 or the method's rule), 5 decimals", "weight"),
        (
            "admitted",
            "per response: it entered the loss (w > 0), whatever the rule (gate, random, none)",
            "bools",
        ),
        (
            "advantage",
            "per response: the advantage it was trained with (the source's), 5 decimals",
            "advantage",
        ),
        ("prompt_id", "per response: its prompt's id", "ids"),
        ("response", "per response: its text (only with `logging.log_transfers`)", "texts"),
    )
)
"""Every key of a ``compatibility.jsonl`` row: one row per (step, receiver) with peer responses."""

SAMPLE_KEYS: tuple[LogKey, ...] = tuple(
    _keys(
        "samples.jsonl",
        ("step", "training step, 0-based", "step"),
        ("model", "the policy that sampled the response", "name"),
        ("prompt_id", "the problem's id", "id"),
        ("answer", "the problem's reference answer", "text"),
        ("response", "the first response of the prompt's group", "text"),
        ("reward", "its verifier reward", "reward"),
    )
)
"""Every key of a ``samples.jsonl`` row (``logging.log_samples`` prompts per policy and step)."""

LOGS: dict[str, tuple[LogKey, ...]] = {
    "metrics.jsonl": METRIC_KEYS,
    "validation.jsonl": VALIDATION_KEYS,
    "compatibility.jsonl": COMPATIBILITY_KEYS,
    "samples.jsonl": SAMPLE_KEYS,
}
"""The declared keys of each log, by its file name in the run folder."""


def find_key(key: str, declared: Sequence[LogKey] = METRIC_KEYS) -> LogKey | None:
    """The declaration of a logged key (exact names before patterns), or None."""
    for entry in declared:
        if entry.name == key:
            return entry
    return next((entry for entry in declared if entry.matches(key)), None)


def undeclared_keys(rows: Iterable[Mapping[str, Any]], declared: Sequence[LogKey] = METRIC_KEYS) -> list[str]:
    """Keys of ``rows`` that no declaration covers, sorted (what a new metric forgot to declare)."""
    return sorted({key for row in rows for key in row if find_key(key, declared) is None})


def _code_placeholders(text: str) -> str:
    """``<peer>`` -> `` `<peer>` ``: Markdown would read a bare ``<peer>`` as an HTML tag."""
    return re.sub(r"(<[a-z_]+>)", r"`\1`", text)


def logs(metric_keys: Sequence[LogKey] = METRIC_KEYS) -> dict[str, tuple[LogKey, ...]]:
    """``LOGS`` with ``metric_keys`` as metrics.jsonl's keys (``training.log_schema`` adds each
    method's loss metrics to the trainer's)."""
    return {**LOGS, "metrics.jsonl": tuple(metric_keys)}


def keys_markdown(metric_keys: Sequence[LogKey] = METRIC_KEYS) -> str:
    """The declared keys of every log as Markdown tables (``docs/metrics.md``, `graftrl metrics-reference`);
    ``metric_keys``: those of metrics.jsonl (``training.log_schema.metric_keys`` adds the methods')."""
    out = [
        "# Run-folder logs and their keys",
        "",
        "Generated from `graftrl.storage.rundir` by `graftrl metrics-reference --markdown`; a test checks",
        "that it is up to date and that every key a run logs is declared. `<name>` stands for a",
        "policy, a stored peer, a problem family or a benchmark. TensorBoard and W&B get the",
        "`metrics.jsonl` scalars as `<model>/<key>`.",
    ]
    for log, keys in logs(metric_keys).items():
        out += ["", f"## `{log}`", "", "| key | meaning | unit | group |", "|---|---|---|---|"]
        out += [f"| `{k.name}` | {_code_placeholders(k.meaning)} | {k.unit} | {k.group} |" for k in keys]
    return "\n".join(out) + "\n"
