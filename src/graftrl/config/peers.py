"""The `peers` section of the run configuration: one entry per peer, stored or served.

A stored peer replays trajectories an earlier run recorded (``graftrl.storage.peers``); a served
peer is a model behind an OpenAI-compatible endpoint that answers the receivers' all-fail prompts
(docs/served-peer.md). An entry is one of a tagged union on ``source``: ``StoredPeerConfig``
(``source: stored``, the default, or implied by a ``path``) or ``ServedPeerConfig`` (``source:
served``, implied by an ``endpoint``), each checked for the fields of its kind. A new kind of peer
registers its settings class here (``register_peer_settings``) and its source in
``graftrl.training.peer_sources``. ``RunConfig`` checks the names against the policies'.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, SerializeAsAny, model_validator

from graftrl.methods import ConfigSection
from graftrl.storage.peers import DEFAULT_PEER_MATCH, PeerMatch

SERVED_CONCURRENCY = 8
SERVED_RETRIES = 3
SERVED_BACKOFF_S = 0.5
SERVED_TIMEOUT_S = 300.0
"""A served peer's request defaults (``ServedPeerConfig``; ``models.served.ServedPeerClient``)."""


class PeerSettings(BaseModel):
    """What every ``peers[]`` entry has: its name and its kind."""

    model_config = ConfigSection.model_config  # as the run's other sections (schema._Section)

    name: str
    """Peer name: for a stored peer the source recorded in the store (its `source` column); for a
    served peer the `source` its groups are recorded under in this run's store."""
    source: str
    """The peer's kind (a key of ``PEER_SETTINGS``)."""

    @property
    def served(self) -> bool:
        """It answers the receivers' all-fail prompts only (no group on the others)."""
        return self.source == "served"


class StoredPeerConfig(PeerSettings):
    """A stored peer: trajectories an earlier run recorded (algorithm.md §2.3)."""

    source: Literal["stored"] = "stored"
    """`stored`: trajectories recorded by an earlier run (`path`); `served`: a model behind an
    OpenAI-compatible endpoint answers the receivers' all-fail prompts (`endpoint`, `model`;
    docs/served-peer.md). Set to `served` by giving an `endpoint`."""
    path: str | None = None
    """Stored: the store folder (a run's `store/`, or one filled by `graftrl import-trajectories`)."""
    match: PeerMatch = DEFAULT_PEER_MATCH
    """Stored: which stored group serves a prompt at step t: `step` (the group of that prompt id
    stored at step t), `nearest` (stored at the step nearest t, the earlier on a tie) or `prompt_id`
    (the latest stored group of that prompt, whatever its step); the rules of
    `graftrl.storage.peers`, TRL's `graft_peer_match` alike."""
    partial: bool = False
    """Stored: the store holds groups for some prompts only (a served peer's record: the receivers'
    all-fail prompts); a prompt without a group gives no candidate instead of an error."""

    @model_validator(mode="after")
    def _has_path(self) -> StoredPeerConfig:
        if not self.path:
            raise ValueError(
                f"peers[{self.name}]: a stored peer needs `path` (its store folder), or give an `endpoint`"
            )
        return self


class ServedPeerConfig(PeerSettings):
    """A served peer: a model behind an OpenAI-compatible endpoint (docs/served-peer.md).

    TRL's ``ServedPeer`` is this class (keyword arguments: ``ServedPeer(endpoint=..., model=...,
    name=...)``). A template with TRL's former ``{prompt}`` placeholder is still accepted for one
    release: read as ``{problem}``, with a DeprecationWarning (``_prompt_placeholder``)."""

    source: Literal["served"] = "served"
    """`served` (implied by an `endpoint`)."""
    endpoint: str | None = None
    """Served: the OpenAI-compatible base URL, e.g. `http://127.0.0.1:8000/v1` (`vllm serve`)."""
    model: str | None = None
    """Served: the model name the endpoint serves (`GET {endpoint}/models`)."""
    api_key_env: str | None = None
    """Served: the environment variable holding the endpoint's API key (sent as a bearer token;
    never logged or written). None: no key."""
    template: str = "{problem}"
    """Served: the peer's prompt template, a Python format string with `{problem}` (the problem
    text plus the data suffix); a chat model's template is spelled out here."""
    concurrency: int = Field(default=SERVED_CONCURRENCY, ge=1)
    """Served: requests in flight at once (one request per prompt, n completions each)."""
    retries: int = Field(default=SERVED_RETRIES, ge=0)
    """Served: retries of a request answered 429 / 5xx or not at all (exponential backoff)."""
    backoff_s: float = Field(default=SERVED_BACKOFF_S, ge=0)
    """Served: the first retry's wait, doubled at each further retry (a `Retry-After` header wins)."""
    timeout_s: float = Field(default=SERVED_TIMEOUT_S, gt=0)
    """Served: the per-step limit on all of a step's requests; prompts unanswered by then are
    missing (their groups stay on the receiver; counted in `served_missing/<peer>`)."""

    @model_validator(mode="before")
    @classmethod
    def _prompt_placeholder(cls, data: Any) -> Any:
        """The one place ``{prompt}`` (TRL's ``ServedPeer`` before it was this class) is accepted:
        a template with ``{prompt}`` and no ``{problem}`` reads as ``{problem}``; deprecated."""
        template = data.get("template") if isinstance(data, dict) else None
        if isinstance(template, str) and "{prompt}" in template and "{problem}" not in template:
            warnings.warn(
                f"peers[{data.get('name')}].template: the {{prompt}} placeholder is deprecated and will be "
                "refused in the next release; write {problem} (the same text)",
                DeprecationWarning,
                stacklevel=2,
            )
            data = {**data, "template": template.replace("{prompt}", "{problem}")}
        return data

    @model_validator(mode="after")
    def _reachable(self) -> ServedPeerConfig:
        where = f"peers[{self.name}]"
        if not self.endpoint or not self.model:
            raise ValueError(
                f"{where}: a served peer needs `endpoint` (e.g. http://127.0.0.1:8000/v1) and `model`"
            )
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"{where}.endpoint: {self.endpoint!r} is not an http(s) URL; e.g. http://127.0.0.1:8000/v1"
            )
        if "{problem}" not in self.template:
            raise ValueError(f"{where}.template: {self.template!r} has no {{problem}} placeholder")
        return self


PeerConfig = StoredPeerConfig | ServedPeerConfig
"""A built-in ``peers[]`` entry (the union ``peer_settings`` resolves on ``source``)."""

PEER_SETTINGS: dict[str, type[PeerSettings]] = {"stored": StoredPeerConfig, "served": ServedPeerConfig}
"""Peer kind (``source``) -> its settings class; the tags of the union."""


def register_peer_settings(kind: str, settings: type[PeerSettings]) -> type[PeerSettings]:
    """Register the settings class of the ``peers[]`` entries with ``source: <kind>``."""
    PEER_SETTINGS[kind] = settings
    return settings


def kind_of(entry: dict[str, Any]) -> str:
    """An entry's kind: its ``source``; else ``served`` with an ``endpoint``, else ``stored``."""
    if "source" in entry:
        return str(entry["source"])
    return "served" if entry.get("endpoint") is not None else "stored"


def peer_settings(entry: Any) -> Any:
    """A ``peers[]`` entry (a mapping, or settings already built) as its kind's settings class.

    Another built-in kind's fields at their defaults (a config.yaml written when one class held
    both kinds' fields) are dropped; any other field of another kind is refused as unknown."""
    if not isinstance(entry, dict):
        return entry
    kind = kind_of(entry)
    if kind not in PEER_SETTINGS:
        known = ", ".join(sorted(PEER_SETTINGS))
        raise ValueError(f"peers[{entry.get('name')}].source: {kind!r} is no peer kind (known: {known})")
    settings = PEER_SETTINGS[kind]
    entry = {**entry, "source": kind}
    for other in PEER_SETTINGS.values():
        for key, field in other.model_fields.items():
            if key not in settings.model_fields and key in entry and entry[key] == field.default:
                del entry[key]
    return settings.model_validate(entry)


PeerEntry = Annotated[SerializeAsAny[PeerSettings], BeforeValidator(peer_settings)]
"""The type of a ``peers[]`` entry in ``RunConfig``: resolved on its kind, dumped with its fields."""
