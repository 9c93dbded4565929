"""The `peers` section of the run configuration: one entry per peer, stored or served.

A stored peer replays trajectories an earlier run recorded (``graftrl.storage.peers``); a served
peer is a model behind an OpenAI-compatible endpoint that answers the receivers' all-fail prompts
(docs/served-peer.md). Each entry says which it is (``source``, or ``served`` implied by an
``endpoint``) and is checked for the fields of its kind; ``RunConfig`` checks the names against
the policies'.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from graftrl.methods import ConfigSection
from graftrl.storage.peers import DEFAULT_PEER_MATCH, PeerMatch


class PeerConfig(BaseModel):
    model_config = ConfigSection.model_config  # as the run's other sections (schema._Section)

    name: str
    """Peer name: for a stored peer the source recorded in the store (its `source` column); for a
    served peer the `source` its groups are recorded under in this run's store."""
    source: Literal["stored", "served"] = "stored"
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
    concurrency: int = Field(default=8, ge=1)
    """Served: requests in flight at once (one request per prompt, n completions each)."""
    retries: int = Field(default=3, ge=0)
    """Served: retries of a request answered 429 / 5xx or not at all (exponential backoff)."""
    backoff_s: float = Field(default=0.5, ge=0)
    """Served: the first retry's wait, doubled at each further retry (a `Retry-After` header wins)."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Served: the per-step limit on all of a step's requests; prompts unanswered by then are
    missing (their groups stay on the receiver; counted in `served_missing/<peer>`)."""

    @model_validator(mode="before")
    @classmethod
    def _kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and "source" not in data and data.get("endpoint") is not None:
            data = {**data, "source": "served"}
        return data

    @model_validator(mode="after")
    def _fields_of_kind(self) -> PeerConfig:
        where = f"peers[{self.name}]"
        if self.source == "stored":
            if not self.path:
                raise ValueError(
                    f"{where}: a stored peer needs `path` (its store folder), or give an `endpoint`"
                )
            return self
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

    @property
    def served(self) -> bool:
        return self.source == "served"
