"""The declared keys of a run folder's logs: one :class:`LogKey` per key, with its meaning, unit and group.

Every key a run writes to ``metrics.jsonl``, ``validation.jsonl``, ``compatibility.jsonl`` or
``samples.jsonl`` is declared once: the trainer's here, each method's (its plan's diagnostics and
its loss metrics) in its own module, joined by ``graftrl.training.log_schema``; ``docs/metrics.md``
and ``graftrl metrics-reference`` are generated from these declarations, and a test checks that
every key a run logs is declared. The run folder's
paths (file names included) and its JSONL readers and writers are :mod:`graftrl.storage.rundir`'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from graftrl.storage.rundir import RunDir

_RUN = RunDir(Path("."))
"""Only for the logs' file names, which live in RunDir."""

SERVED_COST_KEYS = (
    "prompts",
    "missing",
    "requests",
    "retries",
    "prompt_tokens",
    "completion_tokens",
    "latency_s",
)
"""Per-step cost of a served peer, logged as ``served_<key>/<peer>`` (declared below)."""

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
            "all_fail_signal_frac",
            "share of the policy's prompts where every response failed but their rewards differ "
            "(partial credit: GRPO's advantages there are not zero)",
            FRACTION,
        ),
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
        (
            "served_prompts/<peer>",
            "prompts sent to served <peer> (those some policy failed entirely)",
            "prompts",
        ),
        (
            "served_missing/<peer>",
            "prompts served <peer> left unanswered (retries spent, an error, or the step's timeout): their "
            "groups stayed on the receiver",
            "prompts",
        ),
        ("served_requests/<peer>", "HTTP requests sent to served <peer>, retries included", "requests"),
        (
            "served_retries/<peer>",
            "requests to served <peer> retried after a 429 / 5xx / no answer",
            "requests",
        ),
        ("served_prompt_tokens/<peer>", "prompt tokens requested from served <peer> (its usage)", "tokens"),
        (
            "served_completion_tokens/<peer>",
            "completion tokens received from served <peer> (its usage)",
            "tokens",
        ),
        ("served_latency_s/<peer>", "wall time of the step's requests to served <peer>", "s"),
        ("response_length", "mean response length without the EOS token", "tokens"),
        (
            "verifier_timeouts",
            "responses the verifier gave up on (timeout or deadline; reward 0)",
            "responses",
        ),
        ("verifier_restarts", "verifier worker processes restarted", "count"),
        (
            "failures/<class>",
            "the policy's own responses the verifier failed as <class> (wrong, no_answer, tests_failed, "
            "no_code, syntax_error, timeout, memory, crash, error; docs/verifiers.md)",
            "responses",
        ),
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
``<model>/<key>``); each method's plan and loss add their own (``graftrl.training.log_schema.metric_keys``)."""

VALIDATION_KEYS: tuple[LogKey, ...] = tuple(
    _keys(
        _RUN.validation.name,
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
        _RUN.compatibility.name,
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
        _RUN.samples.name,
        ("step", "training step, 0-based", "step"),
        ("model", "the policy that sampled the response", "name"),
        ("prompt_id", "the problem's id", "id"),
        ("answer", "the problem's reference answer", "text"),
        ("response", "the first response of the prompt's group", "text"),
        ("reward", "its verifier reward", "reward"),
    )
)
"""Every key of a ``samples.jsonl`` row (``logging.log_samples`` prompts per policy and step)."""

RESCUE_KEYS: tuple[LogKey, ...] = tuple(
    _keys(
        _RUN.rescues.name,
        ("step", "training step, 0-based", "step"),
        ("receiver", "the policy that sampled the response with a peer's hint", "name"),
        ("source", "the peer (policy or stored peer) whose successful response gave the hint", "name"),
        ("prompt_id", "the problem's id", "id"),
        ("index", "the response's position in the rescued group", "index"),
        ("reward", "its verifier reward", "reward"),
        ("hinted", "the problem text it was sampled from, the hint in it (cut to the context)", "text"),
        ("response", "its text (only with `logging.log_transfers`)", "text"),
    )
)
"""Every key of a ``rescues.jsonl`` row: one per response of a rescue round (``method: hint``)."""

LOGS: dict[str, tuple[LogKey, ...]] = {
    _RUN.metrics.name: METRIC_KEYS,
    _RUN.validation.name: VALIDATION_KEYS,
    _RUN.compatibility.name: COMPATIBILITY_KEYS,
    _RUN.samples.name: SAMPLE_KEYS,
    _RUN.rescues.name: RESCUE_KEYS,
}
"""The declared keys of each log, by its file name in the run folder."""


TEXT_UNITS = frozenset({"name", "names", "id", "text"})
"""Units of keys that hold text (the rest hold numbers, or null where nothing was measured)."""
LIST_UNITS = {"names": str, "ids": str, "texts": str, "bools": bool}
"""In a per-response log (compatibility.jsonl): list units whose elements are not numbers."""
IDENTITY = ("step", "model", "receiver")
"""Keys a row must hold, valid, when its log declares them: what every reader groups rows by."""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def row_checker(
    declared: Sequence[LogKey], per_response: bool = False
) -> Callable[[Mapping[str, Any]], str | None]:
    """``row_problem`` for one log, with each key's declaration looked up once."""
    found: dict[str, LogKey | None] = {}

    def lookup(key: str) -> LogKey | None:
        if key not in found:
            found[key] = find_key(key, declared)
        return found[key]

    return lambda row: row_problem(row, declared, per_response, lookup)


def row_problem(
    row: Mapping[str, Any],
    declared: Sequence[LogKey],
    per_response: bool = False,
    lookup: Callable[[str], LogKey | None] | None = None,
) -> str | None:
    """What is wrong with a log row against its log's declared keys (None when nothing): a missing
    or invalid step/model/receiver, or a value of the wrong kind (a string where a number belongs).
    ``per_response``: the log holds one list per key, a value per response (compatibility.jsonl).
    Keys no declaration covers are not checked (readers do not use them)."""
    names = {entry.name for entry in declared}
    for key in IDENTITY:
        if key in names and key not in row:
            return f"field {key!r} is missing"
    for key, value in row.items():
        entry = lookup(key) if lookup is not None else find_key(key, declared)
        if entry is None:
            continue
        if entry.unit == "step":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return f"field {key!r} must be a step number >= 0, got {value!r}"[:200]
        elif key in IDENTITY or entry.unit == "name":
            if not isinstance(value, str) or not value:
                return f"field {key!r} must be a non-empty name, got {value!r}"[:200]
        elif per_response:
            kind = LIST_UNITS.get(entry.unit)
            if not isinstance(value, list) or not all(
                (isinstance(v, kind) if kind is not None else _number(v) or v is None) for v in value
            ):
                return f"field {key!r} must be a list of {kind.__name__ if kind else 'numbers'}"
        elif entry.unit in TEXT_UNITS:
            if not isinstance(value, str):
                return f"field {key!r} must be text, got {value!r}"[:200]
        elif entry.unit == "bool":
            if not isinstance(value, bool):
                return f"field {key!r} must be true or false, got {value!r}"[:200]
        elif value is not None and not _number(value):
            return f"field {key!r} must be a number, got {value!r}"[:200]
    return None


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
    return {**LOGS, _RUN.metrics.name: tuple(metric_keys)}


def keys_markdown(metric_keys: Sequence[LogKey] = METRIC_KEYS) -> str:
    """The declared keys of every log as Markdown tables (``docs/metrics.md``, `graftrl metrics-reference`);
    ``metric_keys``: those of metrics.jsonl (``training.log_schema.metric_keys`` adds the methods')."""
    out = [
        "# Run-folder logs and their keys",
        "",
        "Generated from `graftrl.storage.log_keys` by `graftrl metrics-reference --markdown`; a test checks",
        "that it is up to date and that every key a run logs is declared. `<name>` stands for a",
        "policy, a stored peer, a problem family or a benchmark. TensorBoard and W&B get the",
        "`metrics.jsonl` scalars as `<model>/<key>`.",
    ]
    for log, keys in logs(metric_keys).items():
        out += ["", f"## `{log}`", "", "| key | meaning | unit | group |", "|---|---|---|---|"]
        out += [f"| `{k.name}` | {_code_placeholders(k.meaning)} | {k.unit} | {k.group} |" for k in keys]
    return "\n".join(out) + "\n"
