"""A served peer's client: n completions with token log-probs from an OpenAI-compatible endpoint.

The peer is any model behind ``POST {endpoint}/completions`` (vLLM's ``vllm serve``, or a hosted
service that returns log-probs). graftrl sends each prompt already formatted with the peer's own
template, asks for ``n`` completions at the run's temperature and top-p with the sampled token's
log-prob (``logprobs: 0``), and a seed per prompt so a rerun asks the same question.

Why the standard library (``urllib`` + a thread pool) and not ``httpx`` / ``openai``: the calls are
plain JSON POSTs, a handful per step, and neither library is installed by graftrl's dependencies.

Failure handling (docs/served-peer.md):
- one request per prompt, at most ``concurrency`` in flight;
- HTTP 429 and 5xx, refused connections and socket timeouts are retried ``retries`` times with
  exponential backoff (``backoff_s * 2**k``, honouring a ``Retry-After`` header);
- the whole step has ``step_timeout_s``: a prompt not answered by then is *missing*;
- a 4xx other than 429, or a malformed answer, makes that prompt missing at once (no retry);
- the caller decides what missing means (the trainer keeps those groups on the receiver).

The API key is read from the environment by the caller and only ever put in the Authorization
header: it is never logged, stored, or part of an error message.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

from graftrl.config.peers import SERVED_BACKOFF_S, SERVED_CONCURRENCY, SERVED_RETRIES, SERVED_TIMEOUT_S
from graftrl.errors import UserError

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class ServedPeerError(UserError):
    """A served peer that cannot serve the run (refused at start-up, one line)."""


@dataclass(frozen=True)
class ServedCompletion:
    """One completion as the endpoint returned it."""

    text: str
    token_logprobs: tuple[float, ...]
    """Content tokens' log-probs (the terminal EOS excluded, eq. 6)."""
    eos_logprob: float | None
    """The EOS token's log-prob when the completion stopped on it."""
    finished: bool
    """finish_reason "stop" (EOS); False: cut at max_tokens."""

    @property
    def mean_logprob(self) -> float:
        values = self.token_logprobs
        return float(sum(values) / len(values)) if values else 0.0


@dataclass
class RequestStats:
    """What one step's requests cost (logged as ``served_*/<peer>``)."""

    requests: int = 0
    """HTTP requests sent, retries included."""
    retries: int = 0
    prompts: int = 0
    """Prompts asked."""
    missing: int = 0
    """Prompts without an answer after retries, errors or the step's timeout."""
    prompt_tokens: int = 0
    """Tokens requested (the endpoint's usage.prompt_tokens, summed over answered requests)."""
    completion_tokens: int = 0
    """Tokens received (usage.completion_tokens)."""
    latency_s: float = 0.0
    """Wall time from the first request to the last answer (or the timeout)."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Why prompts went missing: each distinct reason and the prompts it left missing, for the
    console (``why``); never holds the key."""

    def merge(self, other: RequestStats) -> None:
        for name in ("requests", "retries", "prompts", "missing", "prompt_tokens", "completion_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.latency_s += other.latency_s
        for reason, count in other.reasons.items():
            self.add_reason(reason, count)

    def add_reason(self, reason: str, prompts: int = 1) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + prompts

    def why(self, shown: int = 3) -> str:
        """Each distinct reason once with the prompts it left missing, most first, e.g. "2 prompts:
        no answer (...) after 3 requests"; beyond ``shown`` reasons, how many more there were."""
        ranked = sorted(self.reasons.items(), key=lambda item: -item[1])  # stable: first seen first on ties
        parts = [f"{count} prompt{'s' if count != 1 else ''}: {reason}" for reason, count in ranked[:shown]]
        if len(ranked) > shown:
            parts.append(f"{len(ranked) - shown} other reason{'s' if len(ranked) - shown != 1 else ''}")
        return "; ".join(parts)


@dataclass(frozen=True)
class SamplingRequest:
    """What the run asks of the peer for each prompt."""

    n: int
    max_tokens: int
    temperature: float
    top_p: float


@dataclass
class _Step:
    """What one step's concurrent requests share: its deadline and its cost, counted under the lock."""

    deadline: float
    """``time.monotonic()`` after which no request starts or retries."""
    stats: RequestStats
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Refused(Exception):
    """An answer that retrying will not fix (4xx, malformed)."""


class _Transient(Exception):
    """A 429 / 5xx / connection problem; ``retry_after`` from the server if it gave one."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def parse_choices(body: dict[str, Any], n: int) -> list[ServedCompletion]:
    """The ``n`` completions of a ``/v1/completions`` answer, ordered by ``index``; raises
    ``ValueError`` (one line) when they are not n or lack token log-probs."""
    choices = body.get("choices")
    if not isinstance(choices, list):
        raise ValueError("the answer has no `choices` list")
    if len(choices) != n:
        raise ValueError(f"returned {len(choices)} completions for n = {n}")
    out = []
    for choice in sorted(choices, key=lambda c: int(c.get("index", 0))):
        logprobs = choice.get("logprobs") or {}
        values = logprobs.get("token_logprobs")
        if values is None:
            raise ValueError("returned no token log-probs (`choices[].logprobs.token_logprobs` is empty)")
        values = [float(v) for v in values]
        finished = choice.get("finish_reason") == "stop"
        # vLLM puts the EOS token's log-prob last when a completion stopped on EOS (stop_reason
        # None); a stop string (stop_reason set) is not a token of the completion.
        has_eos = finished and choice.get("stop_reason") is None and bool(values)
        if any(not math.isfinite(v) for v in values):
            raise ValueError("returned a non-finite token log-prob")
        out.append(
            ServedCompletion(
                text=str(choice.get("text", "")),
                token_logprobs=tuple(values[:-1] if has_eos else values),
                eos_logprob=values[-1] if has_eos else None,
                finished=finished,
            )
        )
    return out


class ServedPeerClient:
    """Concurrent, bounded, retried ``/v1/completions`` requests to one endpoint and model."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        model: str,
        api_key: str | None = None,
        *,
        concurrency: int = SERVED_CONCURRENCY,
        retries: int = SERVED_RETRIES,
        backoff_s: float = SERVED_BACKOFF_S,
        step_timeout_s: float = SERVED_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.endpoint = endpoint.rstrip("/")
        self.model = model
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.concurrency = concurrency
        self.retries = retries
        self.backoff_s = backoff_s
        self.step_timeout_s = step_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"served-{name}")
        self._closed = threading.Event()

    def __repr__(self) -> str:  # no key in any repr
        return f"ServedPeerClient({self.name!r}, {self.endpoint!r}, {self.model!r})"

    # ----- one request ---------------------------------------------------------------------
    def _post(self, path: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        data = json.dumps(payload).encode()
        request = urllib.request.Request(
            self.endpoint + path, data=data, headers=self._headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=max(timeout, 0.05)) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = _error_message(error)
            if error.code in RETRY_STATUSES:
                retry_after = error.headers.get("Retry-After") if error.headers else None
                raise _Transient(f"HTTP {error.code}{detail}", _seconds(retry_after)) from None
            raise _Refused(f"HTTP {error.code}{detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise _Transient(f"no answer ({reason})") from None
        except json.JSONDecodeError:
            raise _Refused("the answer is not JSON") from None

    def _payload(self, prompt: str, sampling: SamplingRequest, seed: int | None) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "n": sampling.n,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,  # the sampled token's log-prob only
        }
        if seed is not None:
            payload["seed"] = seed
        return payload

    def _send(self, prompt: str, sampling: SamplingRequest, seed: int | None, step: _Step) -> dict[str, Any]:
        """One prompt's answer body, retried on transient failures (``_Transient`` once spent)."""
        attempt = 0
        while True:
            with step.lock:
                step.stats.requests += 1
            try:
                return self._post(
                    "/completions", self._payload(prompt, sampling, seed), step.deadline - time.monotonic()
                )
            except _Transient as error:
                wait_s = error.retry_after if error.retry_after is not None else self.backoff_s * 2**attempt
                if (
                    attempt >= self.retries
                    or time.monotonic() + wait_s >= step.deadline
                    or self._closed.is_set()
                ):
                    raise _Transient(f"{error} after {attempt + 1} requests") from None
                attempt += 1
                with step.lock:
                    step.stats.retries += 1
                time.sleep(wait_s)

    def _ask(
        self, prompt: str, sampling: SamplingRequest, seed: int | None, step: _Step
    ) -> list[ServedCompletion]:
        """One prompt's n completions (``_Refused`` when there are none to use)."""
        try:
            body = self._send(prompt, sampling, seed, step)
            completions = parse_choices(body, sampling.n)
        except (_Transient, ValueError) as error:
            raise _Refused(str(error)) from None
        usage = body.get("usage") or {}
        with step.lock:
            step.stats.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            step.stats.completion_tokens += int(usage.get("completion_tokens") or 0)
        return completions

    # ----- a step ---------------------------------------------------------------------------
    def complete(
        self, prompts: Sequence[str], sampling: SamplingRequest, seeds: Sequence[int | None] | None = None
    ) -> tuple[list[list[ServedCompletion] | None], RequestStats]:
        """Each prompt's n completions, None where missing (after retries, an error or the step's
        timeout), and what the requests cost."""
        stats = RequestStats(prompts=len(prompts))
        if not prompts:
            return [], stats
        seeds = list(seeds) if seeds is not None else [None] * len(prompts)
        start = time.monotonic()
        step = _Step(start + self.step_timeout_s, stats)
        futures: dict[Future[list[ServedCompletion]], int] = {
            self._pool.submit(self._ask, prompt, sampling, seed, step): i
            for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True))
        }
        answers: list[list[ServedCompletion] | None] = [None] * len(prompts)
        pending = set(futures)
        while pending:
            done, pending = wait(
                pending, timeout=max(step.deadline - time.monotonic(), 0), return_when=FIRST_COMPLETED
            )
            if not done:  # the step's timeout: what is still in flight is missing
                for future in pending:
                    future.cancel()
                stats.add_reason(f"unanswered after step_timeout_s {self.step_timeout_s:g}", len(pending))
                break
            for future in done:
                try:
                    answers[futures[future]] = future.result()
                except _Refused as error:
                    stats.add_reason(str(error))
        with step.lock:  # a request still in flight after the timeout must not change what is reported
            stats.latency_s = time.monotonic() - start
            stats.missing = sum(answer is None for answer in answers)
            return answers, replace(stats, reasons=dict(stats.reasons))

    # ----- start-up -------------------------------------------------------------------------
    def probe(
        self, prompt: str, sampling: SamplingRequest, where: str
    ) -> tuple[list[ServedCompletion], RequestStats]:
        """One request as the run will send it; ServedPeerError (one line, naming ``where``) when the
        endpoint is unreachable, does not know the model, or answers without n completions with
        token log-probs."""
        stats = RequestStats(prompts=1)
        start = time.monotonic()
        try:
            body = self._send(prompt, sampling, 0, _Step(start + self.step_timeout_s, stats))
        except _Transient as error:
            raise ServedPeerError(
                f"{where}: endpoint {self.endpoint} gives {error}; start the server (docs/served-peer.md) or fix "
                "`endpoint`"
            ) from None
        except _Refused as error:
            text = str(error)
            if "HTTP 404" in text and self.model not in text:  # no such path: not a model's answer
                raise ServedPeerError(
                    f"{where}: {self.endpoint}/completions does not exist ({text}); set `endpoint` to the "
                    "OpenAI-compatible base URL, which ends in /v1 (e.g. http://127.0.0.1:8000/v1)"
                ) from None
            if "HTTP 404" in text or ("HTTP 400" in text and "model" in text.lower()):
                raise ServedPeerError(
                    f"{where}: endpoint {self.endpoint} does not serve model {self.model!r} ({text}); set "
                    f"`model` to a name of {self.endpoint}/models{self._model_names()}"
                ) from None
            if "HTTP 401" in text or "HTTP 403" in text:
                raise ServedPeerError(
                    f"{where}: endpoint {self.endpoint} refuses the request ({text}); set the key in the "
                    "environment variable named by `api_key_env`"
                ) from None
            raise ServedPeerError(
                f"{where}: endpoint {self.endpoint} refuses the probe request ({text})"
            ) from None
        try:
            completions = parse_choices(body, sampling.n)
        except ValueError as error:
            raise ServedPeerError(
                f"{where}: model {self.model!r} at {self.endpoint} {error}; a served peer needs n completions "
                "per request with each token's log-prob (/v1/completions with `n` and `logprobs`, as vLLM serves)"
            ) from None
        if str(body.get("model", self.model)) not in (self.model, ""):
            raise ServedPeerError(
                f"{where}: endpoint {self.endpoint} answered with model {body.get('model')!r}, not {self.model!r}; "
                "set `model` to the served name"
            )
        usage = body.get("usage") or {}
        stats.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        stats.completion_tokens = int(usage.get("completion_tokens") or 0)
        stats.latency_s = time.monotonic() - start
        return completions, stats

    def _model_names(self) -> str:
        """`` (it serves: a, b)`` from GET /models, or nothing when that fails too."""
        request = urllib.request.Request(self.endpoint + "/models", headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                names = [str(m.get("id")) for m in json.loads(response.read()).get("data", [])]
        except Exception:
            return ""
        return f" (it serves: {', '.join(names)})" if names else ""

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


def wait_until_serving(endpoint: str, within_s: float, running: Callable[[], bool] = lambda: True) -> bool:
    """Poll ``{endpoint}/models`` about once a second until it answers (True), or ``running()`` turns
    false or ``within_s`` pass (False): a server being started (``vllm serve`` takes 25-40 s on CPU)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and running():
        try:
            with urllib.request.urlopen(f"{endpoint.rstrip('/')}/models", timeout=2):
                return True
        except OSError:
            time.sleep(1)
    return False


def _error_message(error: urllib.error.HTTPError) -> str:
    """``: <the server's message>`` from an OpenAI-style error body, shortened to one line."""
    try:
        body = json.loads(error.read() or b"{}")
    except Exception:
        return ""
    message = (
        body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message")
    )
    return f": {' '.join(str(message).split())[:200]}" if message else ""


def _seconds(value: str | None) -> float | None:
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None
