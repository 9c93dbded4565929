"""GRAFT inside TRL: record a GRPOTrainer run as a stored peer; train with GRAFT from stored peers.

Two steps, runnable as written in the README ("From TRL") and explained in docs/trl.md:

1. ``RecordingGRPOTrainer(..., reward_funcs=math_reward, record_store=DIR, record_source=NAME)``:
   any TRL GRPO run, written into graftrl's trajectory store;
2. ``GraftGRPOTrainer(..., reward_funcs=math_reward, args=GraftGRPOConfig(...),
   peers=[StoredPeer(DIR, source=NAME)])``: GRAFT from the stored peer (its model is never
   loaded).

``math_reward`` is the 0/1 verifier reward ``graftrl train`` gives (the last ``\\boxed{}`` against
the dataset's ``answer`` column); ``verifier_reward(kind=...)`` is any verifier of ``reward.kind``
(code in graftrl's sandbox, match, a user's scorer), with ``code_reward`` and ``match_reward``
ready made. Stores written here are read by ``graftrl train`` (``peers:``) and vice versa. This
package imports without TRL; ``GraftGRPOConfig``, ``GraftGRPOTrainer`` and ``RecordingGRPOTrainer``
import TRL when first used (``bash scripts/setup_trl.sh``, or
``pip install -e '.[trl]'`` from a clone).

Modules: ``recording`` (the recording trainer), ``trainer`` (``GraftGRPOTrainer``), ``exchange``
(GRAFT on one generation batch), ``rewards`` (``math_reward``, ``verifier_reward``), ``sources``
(the peers as ``graftrl train``'s peer sources: stored, served, or any kind registered with
``training.peer_sources.register_source``), ``served`` (``ServedPeer``: a peer behind an
OpenAI-compatible endpoint), ``_compat`` (the TRL versions it runs on). Which stored group serves a prompt is graftrl's one lookup, ``graftrl.storage.peers``.
"""

from __future__ import annotations

from typing import Any

from graftrl.integrations.trl._compat import INSTALL_HINT, TRLIntegrationError, TRLUnavailableError
from graftrl.integrations.trl.exchange import Exchange, graft_exchange, peer_last_order
from graftrl.integrations.trl.recording import RecordTrajectoriesMixin
from graftrl.integrations.trl.rewards import code_reward, match_reward, math_reward, verifier_reward
from graftrl.integrations.trl.served import ServedPeer
from graftrl.storage.peers import (
    PROMPT_ID_COLUMN,
    PeerStore,
    StoredPeer,
    prompt_hash,
    prompt_id_of,
)
from graftrl.training.trajectories import peer_groups

_NEED_TRL = ("GraftGRPOConfig", "GraftGRPOTrainer", "RecordingGRPOTrainer", "graft_method")

__all__ = [
    "INSTALL_HINT",
    "PROMPT_ID_COLUMN",
    "Exchange",
    "PeerStore",
    "RecordTrajectoriesMixin",
    "ServedPeer",
    "StoredPeer",
    "TRLIntegrationError",
    "TRLUnavailableError",
    "code_reward",
    "graft_exchange",
    "match_reward",
    "math_reward",
    "peer_groups",
    "peer_last_order",
    "prompt_hash",
    "prompt_id_of",
    "verifier_reward",
    *_NEED_TRL,
]


def __getattr__(name: str) -> Any:
    if name in _NEED_TRL:
        from graftrl.integrations.trl import trainer  # imports TRL: TRLUnavailableError without it

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
