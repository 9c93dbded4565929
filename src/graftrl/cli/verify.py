"""``graftrl verify``: a config's verifier on responses you give it, or on its data, before any
training (no model is loaded).

``--responses FILE`` (JSONL of ``{"id" or "problem", "response"}``) scores each response against
its problem row of ``data.train`` or a local validation file and prints reward and reason per
line, then the mean reward, the successes (``reward.success_threshold``) and the failures by
class. ``--problems`` checks the data itself: every row parses and passes the verifier's
``check_problem``, and each row's ``canonical_solution`` (when given) scores 1.0.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from graftrl.cli.common import app, console
from graftrl.errors import UserError

CANONICAL = "canonical_solution"
"""The row field (``Problem.extra``) holding a known-good response, scored by ``--problems``."""


@dataclass(frozen=True)
class ProblemFile:
    """One data file of the config: where it comes from (``data.train``, ``validation NAME``)."""

    label: str
    path: Path


@dataclass(frozen=True)
class Scored:
    """One response line and the problem row it answers."""

    line: int
    response: str
    problem: Any  # graftrl.storage.data.Problem
    label: str


def problem_files(cfg: Any) -> tuple[list[ProblemFile], list[str]]:
    """``data.train`` and the validation files that are local files; the other validation specs
    (built-in or hub benchmarks) as notes: they are not read here."""
    from graftrl.evaluation.benchmarks import parse_benchmark_spec

    files = [ProblemFile("data.train", Path(cfg.data.train))]
    skipped = []
    for spec in cfg.validation.specs():
        source = parse_benchmark_spec(spec)
        if source.path is not None:
            files.append(ProblemFile(f"validation {source.name}", source.path))
        else:
            skipped.append(f"validation {source.name} ({source.describe()}) is not a local file: not checked")
    return files, skipped


def _text_of(value: Any) -> str | None:
    """A response or problem given as text, or as chat messages (the last message's content)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], Mapping):
        content = value[-1].get("content")
        return content if isinstance(content, str) else None
    return None


class _Index:
    """The config's problems by id and by text, to match response lines against."""

    def __init__(self, files: list[ProblemFile]) -> None:
        from graftrl.storage.data import DataError, load_problems

        self.labels = [f"{f.label} ({f.path})" for f in files]
        self.by_id: dict[str, list[tuple[str, Any]]] = {}
        self.by_text: dict[str, list[tuple[str, Any]]] = {}
        self.count = 0
        for file in files:
            try:
                problems = load_problems(file.path)
            except DataError as exc:
                raise DataError(f"{exc} (`graftrl verify --problems` lists every bad row)") from None
            for problem in problems:
                self.count += 1
                self.by_id.setdefault(problem.id, []).append((file.label, problem))
                self.by_text.setdefault(problem.problem.strip(), []).append((file.label, problem))

    def match(self, where: str, pid: str | None, text: str | None) -> tuple[str, Any]:
        found = self.by_id.get(pid, []) if pid is not None else []
        if len(found) > 1 and text is not None:
            found = [f for f in found if f[1].problem.strip() == text.strip()] or found
        if not found and text is not None:
            found = self.by_text.get(text.strip(), [])
        if not found:
            what = f"id {pid!r}" if pid is not None else "this problem text"
            also = " or this problem text" if pid is not None and text is not None else ""
            raise UserError(
                f"{where}: no problem with {what}{also} in {', '.join(self.labels)}; give the id (or the "
                "exact problem text) of a row of those files"
            )
        rows = {
            (p.id, p.problem, p.answer, json.dumps(dict(p.extra), sort_keys=True, default=str))
            for _, p in found
        }
        if len(rows) > 1:
            raise UserError(
                f"{where}: matches {len(found)} different rows ({', '.join(f'{label} id {p.id!r}' for label, p in found)}); "
                "give an 'id' together with the problem text to pick one"
            )
        return found[0]


def read_responses(path: Path, index: _Index, limit: int | None) -> list[Scored]:
    """The response lines of ``path``, each matched to its problem; one error naming the line."""
    if not path.is_file():
        raise UserError(f"--responses {path}: file not found (expected JSONL of {{id or problem, response}})")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise UserError(f"--responses {path}: not UTF-8 ({exc}); save it as UTF-8") from None
    scored: list[Scored] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if limit is not None and len(scored) >= limit:
            break
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); each line is one object"
            ) from None
        if not isinstance(row, dict):
            raise UserError(
                f"{where}: expected an object with 'id' or 'problem' and 'response', got {type(row).__name__}"
            )
        response = _text_of(row.get("response"))
        if response is None:
            raise UserError(
                f"{where}: field 'response' is missing or not text (give the response as a string, or as "
                "chat messages whose last one holds it)"
            )
        pid = row.get("id")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, str | int)):
            raise UserError(f"{where}: field 'id' must be a string or a number, got {pid!r}")
        text = None
        if row.get("problem", row.get("prompt")) is not None:
            text = _text_of(row.get("problem", row.get("prompt")))
            if text is None:
                raise UserError(f"{where}: field 'problem' must be text (or chat messages)")
        if pid is None and text is None:
            raise UserError(f"{where}: give the problem's 'id' or its 'problem' text beside 'response'")
        label, problem = index.match(where, None if pid is None else str(pid), text)
        scored.append(Scored(number, response, problem, label))
    if not scored:
        raise UserError(f"--responses {path}: holds no response lines")
    return scored


def _started(cfg: Any) -> Any:
    """The config's verifier, started (its self-check: a broken sandbox fails here, in one line);
    its warnings (``reward.sandbox: none``) printed as warning lines."""
    from graftrl.verifiers import registry

    verifier = registry.build_verifier(cfg.reward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            verifier.start()
        except BaseException:
            verifier.close()
            raise
        finally:
            for warning in caught:
                console.print(f"[yellow]warning:[/yellow] {escape(str(warning.message))}", soft_wrap=True)
    return verifier


def _describe(cfg: Any) -> str:
    reward = cfg.reward
    if reward.kind == "code":
        return (
            f"reward.kind code (sandbox {reward.sandbox}, {reward.workers} worker(s), "
            f"{reward.code.test_timeout_s:g} s per test)"
        )
    if reward.kind == "match":
        return f"reward.kind match ({reward.match.mode}, {reward.match.extract})"
    if reward.kind == "function":
        return f"reward.kind function ({reward.function.path})"
    return f"reward.kind math ({reward.extraction})"


def _write_json(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1, default=str) + "\n", encoding="utf-8")
    console.print(f"wrote {len(rows)} rows to {path}")


def verify_responses(cfg: Any, responses: Path, limit: int | None, json_out: Path | None) -> None:
    files, skipped = problem_files(cfg)
    index = _Index(files)
    lines = read_responses(responses, index, limit)
    for note in skipped:
        console.print(f"[yellow]note:[/yellow] {escape(note)}", soft_wrap=True)
    console.print(
        f"verifying {len(lines)} responses of {responses} with {_describe(cfg)} against "
        f"{index.count} problems of {', '.join(index.labels)}",
        soft_wrap=True,
        highlight=False,
    )
    verifier = _started(cfg)
    try:
        verdicts = verifier.verify([s.response for s in lines], [s.problem for s in lines])
    finally:
        verifier.close()
    threshold = cfg.reward.success_threshold
    table = Table("line", "id", "reward", "reason", title="graftrl verify", show_lines=False)
    rows = []
    for item, verdict in zip(lines, verdicts, strict=True):
        success = verdict.reward >= threshold
        style = "green" if success else ("yellow" if verdict.reward > 0 else "red")
        table.add_row(
            str(item.line),
            Text(item.problem.id),
            Text(f"{verdict.reward:.3g}", style=style),
            Text(verdict.reason),
        )
        rows.append(
            {
                "line": item.line,
                "id": item.problem.id,
                "source": item.label,
                "reward": verdict.reward,
                "success": success,
                "failure": verdict.failure,
                "reason": verdict.reason,
            }
        )
    console.print(table)
    rewards = [v.reward for v in verdicts]
    successes = sum(r >= threshold for r in rewards)
    failures = Counter(v.failure for v in verdicts if v.failure is not None)
    classes = ", ".join(f"{name} {count}" for name, count in failures.most_common()) or "none"
    console.print(
        f"{len(rewards)} response{'s' if len(rewards) != 1 else ''}: mean reward {sum(rewards) / len(rewards):.3f}, {successes} of "
        f"{len(rewards)} successes (reward >= {threshold:g}); failures by class: {classes}",
        soft_wrap=True,
        highlight=False,
    )
    if json_out is not None:
        _write_json(json_out, rows)


def verify_problems(cfg: Any, limit: int | None, json_out: Path | None) -> None:
    from graftrl.storage.data import scan_problems
    from graftrl.verifiers import registry

    files, skipped = problem_files(cfg)
    checker = registry.build_verifier(cfg.reward)  # check_problem needs no workers
    bad: list[str] = []
    canonical: list[tuple[ProblemFile, str, Any]] = []
    checked: list[str] = []
    rows: list[dict[str, Any]] = []
    try:
        for file in files:
            good, errors = scan_problems(file.path, checker.check_problem, limit)
            bad += errors
            rows += [{"file": str(file.path), "error": error} for error in errors]
            with_solution = [(file, where, p) for where, p in good if isinstance(p.extra.get(CANONICAL), str)]
            canonical += with_solution
            checked.append(
                f"{file.label} ({file.path}): {len(good) + len(errors)} rows, {len(errors)} bad, "
                f"{len(with_solution)} with a {CANONICAL}"
            )
    finally:
        checker.close()
    failing: list[str] = []
    if canonical:
        verifier = _started(cfg)
        try:
            verdicts = verifier.verify(
                [p.extra[CANONICAL] for _, _, p in canonical], [p for _, _, p in canonical]
            )
        finally:
            verifier.close()
        for (file, where, problem), verdict in zip(canonical, verdicts, strict=True):
            rows.append(
                {
                    "file": str(file.path),
                    "where": where,
                    "id": problem.id,
                    "canonical_reward": verdict.reward,
                    "canonical_reason": verdict.reason,
                }
            )
            if verdict.reward < 1.0:
                failing.append(
                    f"{file.path} {where} (id {problem.id!r}): {CANONICAL} scores {verdict.reward:.3g}: {verdict.reason}"
                )
    for note in skipped:
        console.print(f"[yellow]note:[/yellow] {escape(note)}", soft_wrap=True)
    for line in checked:
        console.print(f"checked {escape(line)}", soft_wrap=True, highlight=False)
    for message in bad:
        console.print(f"[red]bad row:[/red] {escape(message)}", soft_wrap=True, highlight=False)
    for message in failing:
        console.print(
            f"[red]canonical solution fails:[/red] {escape(message)}", soft_wrap=True, highlight=False
        )
    console.print(
        f"{_describe(cfg)}: {len(bad)} bad rows; {len(canonical)} canonical solutions scored, "
        f"{len(failing)} below reward 1.0",
        soft_wrap=True,
        highlight=False,
    )
    if json_out is not None:
        _write_json(json_out, rows)
    if bad or failing:
        raise typer.Exit(2)


@app.command()
def verify(
    config: Annotated[Path, typer.Argument(help="YAML config file (its reward section and data).")],
    responses: Annotated[
        Path | None,
        typer.Option(
            help='JSONL of {"id" or "problem", "response"}: each response is scored against its row '
            "of data.train (or a validation file), matched by id, else by problem text."
        ),
    ] = None,
    problems: Annotated[
        bool,
        typer.Option(
            "--problems",
            help="Check the data instead: every row of data.train and the validation files parses and "
            "suits the verifier, and each row's canonical_solution (when given) scores 1.0. Exit 2 when not.",
        ),
    ] = False,
    limit: Annotated[
        int | None,
        typer.Option(min=1, help="Only the first this many responses (rows of each file with --problems)."),
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field: --set reward.code.test_timeout_s=2")
    ] = None,
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help="Also write the per-response (or per-row) results to this JSON file."),
    ] = None,
) -> None:
    """Score responses with the config's verifier (reward and reason each), or check its data; no
    model is loaded."""
    from graftrl.config import load_config

    if (responses is None) == (not problems):
        raise UserError(
            "graftrl verify: give --responses FILE (score responses) or --problems (check the data), one of them"
        )
    cfg = load_config(config, set_ or [])
    if problems:
        verify_problems(cfg, limit, json_out)
    else:
        assert responses is not None
        verify_responses(cfg, responses, limit, json_out)
