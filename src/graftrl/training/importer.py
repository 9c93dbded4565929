"""Import trajectories logged elsewhere (JSONL) as a peer's trajectory store.

``graftrl import-trajectories`` calls ``import_jsonl``: it checks the whole file first (one line
naming the file, line and field per problem), computes GRPO advantages for groups that lack them
(eq. 1), scores responses that lack the source's log-probs with the source model (eq. 6: mean over
content tokens, terminal EOS excluded), then writes one step file per step, merging with steps
already in the store, as one unit (``graftrl.storage.store_import``): an import killed half way
leaves a store every reader refuses, and rerunning the same command finishes it, byte for byte as
an uninterrupted import. Everything that can be refused (the file, the store, the lines' fit in
the source model's context) is checked before the model's weights load. It sits above the model
layer because scoring loads a model; the store itself (``graftrl.storage.store``) never does.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from graftrl.core import grpo_advantages
from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED
from graftrl.errors import ModelError
from graftrl.files import sha256_bytes, sha256_file
from graftrl.models.model_loading import load_tokenizer, model_context
from graftrl.models.policy import Policy
from graftrl.models.prompts import encode_formatted, format_prompt
from graftrl.models.rollout import content_mean_logprob
from graftrl.storage.store import (
    FINISH_REASONS,
    MEAN_TOLERANCE,
    StoredTrajectory,
    StoreError,
    tokenizer_id,
)
from graftrl.storage.store_import import StoreImport


@dataclass(frozen=True)
class ImportSummary:
    """What ``import_jsonl`` wrote, for the CLI's report."""

    rows: int
    groups: int
    steps: list[int]
    sources: list[str]
    scored: int
    """Rows whose log-probs were computed with the source model."""
    computed_advantages: int
    """Groups whose GRPO advantages were computed here."""
    unequal_groups: str | None = None
    """A one-line note when one source's groups differ in size (None: all equal)."""


@dataclass
class _Line:
    """One checked line of the file; ``_score_lines`` fills the log-prob fields it lacks."""

    where: str
    prompt_id: str
    response: str
    reward: float
    step: int
    source: str
    prompt_text: str | None
    finished: bool
    advantage: float | None
    index: int | None
    token_logprobs: list[float] | None
    mean_logprob: float | None
    num_tokens: int | None
    eos_logprob: float | None
    tokenizer_id: str | None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _parse_line(obj: Any, where: str, default_source: str) -> _Line:
    def bad(field_name: str, what: str) -> StoreError:
        return StoreError(f"{where}: field {field_name!r} {what}")

    if not isinstance(obj, dict):
        raise StoreError(f"{where}: expected a JSON object per line")
    for required in ("prompt_id", "response", "reward"):
        if required not in obj:
            raise bad(required, "is missing (required: prompt_id, response, reward)")
    prompt_id = obj["prompt_id"]
    if isinstance(prompt_id, bool) or not isinstance(prompt_id, str | int):
        raise bad("prompt_id", f"must be a string or integer, got {prompt_id!r}")
    if not isinstance(obj["response"], str):
        raise bad("response", "must be a string")
    reward = obj["reward"]
    if isinstance(reward, bool):
        reward = float(reward)
    if not _number(reward) or not math.isfinite(float(reward)):
        raise bad(
            "reward",
            f"must be a finite number (a verifier's reward: 0/1, or a fraction of tests passed), got {reward!r}",
        )
    step = obj.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise bad("step", f"must be an integer >= 0, got {step!r}")
    source = obj.get("source", default_source)
    if not isinstance(source, str) or not source:
        raise bad("source", f"must be a non-empty string, got {source!r}")
    prompt_text = obj.get("prompt")
    if prompt_text is not None and not isinstance(prompt_text, str):
        raise bad("prompt", "must be a string")
    finish = obj.get("finish_reason", "stop")
    if finish not in FINISH_REASONS:
        raise bad("finish_reason", f"must be one of {FINISH_REASONS}, got {finish!r}")
    advantage = obj.get("advantage")
    if advantage is not None and (not _number(advantage) or not math.isfinite(advantage)):
        raise bad("advantage", f"must be a finite number, got {advantage!r}")
    index = obj.get("index")
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
        raise bad("index", f"must be an integer >= 0, got {index!r}")
    lps = obj.get("token_logprobs")
    if lps is not None and (
        not isinstance(lps, list) or not all(_number(v) and math.isfinite(v) and v <= 1e-6 for v in lps)
    ):
        raise bad("token_logprobs", "must be a list of finite log-probs <= 0 (content tokens, EOS excluded)")
    mean = obj.get("mean_logprob")
    if mean is not None and (not _number(mean) or not math.isfinite(mean) or mean > 1e-6):
        raise bad("mean_logprob", f"must be a finite log-prob <= 0, got {mean!r}")
    num_tokens = obj.get("num_tokens")
    if num_tokens is not None and (
        isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0
    ):
        raise bad("num_tokens", f"must be an integer >= 0, got {num_tokens!r}")
    if lps is not None:
        if num_tokens is not None and num_tokens != len(lps):
            raise bad(
                "num_tokens", f"is {num_tokens} but 'token_logprobs' has {len(lps)} values (EOS excluded)"
            )
        computed = sum(lps) / len(lps) if lps else 0.0
        if mean is not None and abs(computed - mean) > MEAN_TOLERANCE * max(1.0, abs(mean)):
            raise bad("mean_logprob", f"is {mean} but the mean of 'token_logprobs' is {computed:.6f}")
        mean, num_tokens = computed, len(lps)
    elif mean is not None and num_tokens is None:
        raise bad("num_tokens", "is missing: 'mean_logprob' needs the source token count next to it")
    eos = obj.get("eos_logprob")
    if eos is not None and (not _number(eos) or finish != "stop" or eos > 1e-6):
        raise bad("eos_logprob", "must be a log-prob <= 0, and only on a response with finish_reason 'stop'")
    tok = obj.get("tokenizer_id")
    if tok is not None and not isinstance(tok, str):
        raise bad("tokenizer_id", "must be a string")
    return _Line(
        where=where,
        prompt_id=str(prompt_id),
        response=obj["response"],
        reward=float(reward),
        step=step,
        source=source,
        prompt_text=prompt_text,
        finished=finish == "stop",
        advantage=None if advantage is None else float(advantage),
        index=index,
        token_logprobs=None if lps is None else [float(v) for v in lps],
        mean_logprob=None if mean is None else float(mean),
        num_tokens=num_tokens,
        eos_logprob=None if eos is None else float(eos),
        tokenizer_id=tok,
    )


def import_jsonl(
    path: str | Path,
    store_root: str | Path,
    model_path: str | Path | None = None,
    template: str = "{problem}",
    *,
    source: str | None = None,
    chat_template: bool = False,
    temperature: float = 1.0,
    device: str = "auto",
    dtype: str = "float32",
    source_tokenizer_id: str | None = None,
    adv_eps: float = ADV_EPS,
    adv_std_unbiased: bool = ADV_STD_UNBIASED,
) -> ImportSummary:
    """Import trajectories logged elsewhere (one JSON object per line) as a peer's store.

    Fields per line: ``prompt_id``, ``response``, ``reward`` (the verifier's: 0/1, or a fraction of
    tests passed) required; optional ``step``
    (default 0), ``source`` (default: ``source`` argument, else the model folder's name, else
    the file's stem), ``prompt`` (the text the template is applied to), ``finish_reason``
    ("stop" default | "length"), ``index``, ``advantage``, ``token_logprobs`` (content tokens,
    terminal EOS excluded) or ``mean_logprob`` + ``num_tokens``, ``eos_logprob``,
    ``tokenizer_id``. Unknown fields are ignored.

    Groups are (step, source, prompt_id). A group without advantages gets GRPO advantages
    (eq. 1, ``adv_eps``, ``adv_std_unbiased``); a group must give all or none. Rows without
    log-probs are scored with the source model at ``model_path`` (its ``template`` or chat
    template, ``Policy.encode_response``, ``Policy.score`` at ``temperature``, mean over content
    tokens with the terminal EOS excluded); without ``model_path`` the import is refused.
    ``source_tokenizer_id`` names the source tokenizer for lines without ``tokenizer_id``
    (default: computed from the model, else "unknown"). Steps already in the store are merged
    with, unless they hold the same source. The whole file is checked before anything is
    scored or written.
    """
    path = Path(path)
    if not path.exists():
        raise StoreError(f"{path}: no such file")
    if not path.is_file():
        raise StoreError(f"{path}: is a folder, not a JSONL file; give the trajectories file itself")
    default_source = source or (Path(model_path).name if model_path else path.stem)
    lines: list[_Line] = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path} line {number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise StoreError(
                    f"{where}: not UTF-8 text (byte {error.start} of the line); save the file as UTF-8"
                ) from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as error:
                raise StoreError(f"{where}: not valid JSON ({error.msg})") from None
            lines.append(_parse_line(obj, where, default_source))
    if not lines:
        raise StoreError(f"{path}: no trajectories (the file is empty)")

    groups: dict[tuple[int, str, str], list[_Line]] = defaultdict(list)
    for line in lines:
        groups[(line.step, line.source, line.prompt_id)].append(line)
    for (_, _, prompt_id), members in groups.items():
        _check_group(members, prompt_id)
    unequal_groups = _unequal_group_sizes(groups)

    needs_score = [line for line in lines if line.mean_logprob is None]
    if needs_score and model_path is None:
        first = needs_score[0]
        raise StoreError(
            f"{first.where}: missing field 'token_logprobs' (or 'mean_logprob' + 'num_tokens'), the "
            f"source's log-probs the compatibility score needs ({len(needs_score)} line(s) lack them); "
            "pass --model PATH (the source model) to compute them"
        )
    # The store next: one that cannot be written, a foreign one, another command's unfinished
    # import or a step already holding these sources is refused before the model is loaded.
    root = Path(store_root)
    options = {
        "model": None if model_path is None else str(Path(model_path).expanduser().resolve()),
        "template": template,
        "source": source,
        "chat_template": chat_template,
        "temperature": temperature,
        "device": device,
        "dtype": dtype,
        "source_tokenizer_id": source_tokenizer_id,
        "adv_eps": adv_eps,
        "adv_std_unbiased": adv_std_unbiased,
    }
    key = sha256_bytes(json.dumps([sha256_file(path)[0], options], sort_keys=True).encode())
    command = f"graftrl import-trajectories {path} --store {root}" + (
        f" --model {model_path} (and the same options)"
        if model_path is not None
        else " (and the same options)"
    )
    store_import = StoreImport(root, key, command)
    sources_by_step: dict[int, set[str]] = defaultdict(set)
    for line in lines:
        sources_by_step[line.step].add(line.source)
    store_import.check_sources(sources_by_step)

    default_tokenizer = source_tokenizer_id
    if model_path is not None:
        default_tokenizer = _score_lines(
            needs_score, str(model_path), template, chat_template, temperature, device, dtype
        )
        default_tokenizer = source_tokenizer_id or default_tokenizer

    computed = 0
    rows_by_step: dict[int, list[StoredTrajectory]] = defaultdict(list)
    group_counter: dict[tuple[int, str], int] = defaultdict(int)
    for (step, src, prompt_id), members in groups.items():
        advantages = _group_advantages(members, adv_eps, adv_std_unbiased)
        computed += int(members[0].advantage is None)
        indices = [m.index for m in members] if members[0].index is not None else range(len(members))
        group_index = group_counter[(step, src)]
        group_counter[(step, src)] += 1
        prompt_text = next((m.prompt_text for m in members if m.prompt_text is not None), "")
        for line, advantage, index in zip(members, advantages, indices, strict=True):
            assert line.mean_logprob is not None and line.num_tokens is not None
            rows_by_step[step].append(
                StoredTrajectory(
                    prompt_id=prompt_id,
                    step=step,
                    source=src,
                    index=int(index),
                    response=line.response,
                    reward=line.reward,
                    advantage=advantage,
                    mean_logprob=line.mean_logprob,
                    num_tokens=line.num_tokens,
                    num_bytes=len(line.response.encode("utf-8")),
                    finished=line.finished,
                    prompt_text=prompt_text,
                    tokenizer_id=line.tokenizer_id or default_tokenizer or "unknown",
                    n=len(members),
                    group_index=group_index,
                    token_logprobs=None if line.token_logprobs is None else tuple(line.token_logprobs),
                    eos_logprob=line.eos_logprob,
                )
            )

    store_import.commit(rows_by_step)
    return ImportSummary(
        rows=len(lines),
        groups=len(groups),
        steps=sorted(rows_by_step),
        sources=sorted({line.source for line in lines}),
        scored=len(needs_score),
        computed_advantages=computed,
        unequal_groups=unequal_groups,
    )


def _check_group(members: Sequence[_Line], prompt_id: str) -> None:
    """All-or-none advantages and indices, one prompt text: before any expensive scoring."""
    what = f"the group of prompt {prompt_id!r} (step {members[0].step}, source {members[0].source!r})"
    for name in ("advantage", "index"):
        given = [getattr(m, name) is not None for m in members]
        if any(given) and not all(given):
            line = members[given.index(False)]
            raise StoreError(
                f"{line.where}: field {name!r} is missing while other lines of {what} have it; "
                "give it on every line of the group or on none"
            )
    indices = [m.index for m in members if m.index is not None]  # all or none (above)
    if indices and sorted(indices) != list(range(len(members))):
        raise StoreError(
            f"{members[-1].where}: field 'index': {what} has indices {indices}; "
            f"give 0..{len(members) - 1} once each (the group has {len(members)} lines), or leave them out"
        )
    texts = {m.prompt_text for m in members if m.prompt_text is not None}
    if len(texts) > 1:
        raise StoreError(f"{members[-1].where}: field 'prompt' differs between lines of {what}")


def _unequal_group_sizes(groups: Mapping[tuple[int, str, str], Sequence[_Line]]) -> str | None:
    """A note naming a group whose size differs from the rest of its source's, else None.

    The store keeps each group's own n, so such a file imports; a run replaying it refuses, at the
    step that needs it, every group whose size is not its ``rollout.n``.
    """
    sizes: dict[str, dict[int, tuple[str, int, str]]] = defaultdict(dict)
    for (step, src, prompt_id), members in groups.items():
        sizes[src].setdefault(len(members), (prompt_id, step, members[-1].where))
    for src, by_size in sizes.items():
        if len(by_size) > 1:
            common = max(by_size, key=lambda n: sum(len(m) == n for k, m in groups.items() if k[1] == src))
            odd = next(n for n in by_size if n != common)
            prompt_id, step, where = by_size[odd]
            return (
                f"{where}: the group of prompt {prompt_id!r} (step {step}, source {src!r}) has {odd} responses "
                f"while other groups of {src!r} have {common}; a run replaying this store as a peer refuses "
                "groups whose size is not its rollout.n"
            )
    return None


def _group_advantages(members: Sequence[_Line], eps: float, unbiased: bool) -> list[float]:
    if members[0].advantage is not None:
        return [float(cast(float, m.advantage)) for m in members]  # all or none (_check_group)
    rewards = torch.tensor([[m.reward for m in members]], dtype=torch.float32)
    return [float(a) for a in grpo_advantages(rewards, eps, unbiased).view(-1).tolist()]


def _score_lines(
    lines: Sequence[_Line],
    model_path: str,
    template: str,
    chat_template: bool,
    temperature: float,
    device: str,
    dtype: str,
) -> str:
    """Fill mean_logprob / token_logprobs / num_tokens from the source model; returns its tokenizer id."""
    if lines:
        _check_fit(lines, model_path, template, chat_template)
    try:
        policy = Policy.from_pretrained(
            "source",
            model_path,
            dtype=dtype,
            device=device,
            template=template,
            chat_template=chat_template,
            temperature=temperature,
        )
    except (OSError, ValueError) as error:
        raise StoreError(f"--model {model_path}: cannot load the source model ({error})") from None
    source_id = tokenizer_id(policy.tokenizer)
    if not lines:
        return source_id
    try:  # every line has its prompt text (``_check_fit``)
        prompts = policy.encode_prompts([line.prompt_text or "" for line in lines])
    except (KeyError, IndexError, ValueError) as error:
        raise StoreError(
            f"--template {template!r}: cannot format a prompt ({error}); use '{{problem}}'"
        ) from None
    responses = [policy.encode_response(line.response, line.finished) for line in lines]
    scores = policy.score(prompts, responses)
    for line, logprobs in zip(lines, scores, strict=True):
        logprobs = logprobs.float()
        content = logprobs[:-1] if line.finished and len(logprobs) else logprobs
        line.token_logprobs = content.tolist()
        line.num_tokens = len(content)
        line.mean_logprob = content_mean_logprob(logprobs, line.finished)
        line.eos_logprob = float(logprobs[-1]) if line.finished and len(logprobs) else None
    return source_id


def _check_fit(lines: Sequence[_Line], model_path: str, template: str, chat_template: bool) -> None:
    """Refuse, before the model's weights load, a line whose prompt and response do not fit the
    source model's context (scoring it would fail inside the forward pass, or first allocate its
    quadratic attention); from the folder's tokenizer and config alone."""
    missing_prompt = [line for line in lines if line.prompt_text is None]
    if missing_prompt:
        raise StoreError(
            f"{missing_prompt[0].where}: field 'prompt' is missing; scoring a response with --model needs the "
            "prompt text it answered (the text the --template is applied to)"
        )
    try:
        tokenizer = load_tokenizer("source", model_path)
        context = model_context("source", model_path)
    except ModelError as error:
        raise StoreError(f"--model {model_path}: cannot load the source model ({error})") from None
    if context is None:
        return
    for line in lines:
        try:
            prompt = format_prompt(tokenizer, template, chat_template, line.prompt_text or "")
        except (KeyError, IndexError, ValueError) as error:
            raise StoreError(
                f"--template {template!r}: cannot format a prompt ({error}); use '{{problem}}'"
            ) from None
        if len(prompt.encode("utf-8")) + len(line.response.encode("utf-8")) + 16 <= context:
            continue  # a token covers at least one byte: no need to tokenize
        length = len(encode_formatted(tokenizer, chat_template, [prompt])[0])
        length += len(tokenizer(line.response, add_special_tokens=False)["input_ids"]) + int(line.finished)
        if length > context:
            raise StoreError(
                f"{line.where}: prompt and response are {length} tokens of the source model, more than its "
                f"context of {context} (max_position_embeddings); shorten or drop the line, or score it "
                "elsewhere and give its 'token_logprobs'"
            )
