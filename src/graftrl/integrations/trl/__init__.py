"""GRAFT inside TRL: record a GRPOTrainer run as a stored peer; train with GRAFT from stored peers.

Two steps (docs/trl.md)::

    from graftrl.integrations.trl import GraftGRPOConfig, GraftGRPOTrainer, RecordingGRPOTrainer

    # 1. record: any TRL GRPO run, written into graftrl's trajectory store
    RecordingGRPOTrainer(model=peer, reward_funcs=verify, args=GRPOConfig(...),
                         train_dataset=data, record_store="peer-store", record_source="peer").train()
    # 2. replay: GRAFT from the stored peer (its model is never loaded)
    GraftGRPOTrainer(model=receiver, reward_funcs=verify, args=GraftGRPOConfig(...),
                     train_dataset=data, peer_stores=["peer-store"]).train()

Stores written here are read by ``graftrl train`` (``peers:``) and vice versa. This package
imports without TRL; ``GraftGRPOConfig``, ``GraftGRPOTrainer`` and ``RecordingGRPOTrainer`` import
TRL when first used (``pip install 'graftrl[trl]'``).
"""

from __future__ import annotations

from typing import Any

from graftrl.integrations.trl._compat import INSTALL_HINT, TRLIntegrationError, TRLUnavailableError
from graftrl.integrations.trl.exchange import Exchange, graft_exchange, peer_last_order
from graftrl.integrations.trl.peers import (
    PROMPT_ID_COLUMN,
    PeerStore,
    StoredPeer,
    prompt_hash,
    prompt_id_of,
)
from graftrl.integrations.trl.recording import RecordTrajectoriesMixin
from graftrl.training.trajectories import peer_groups

_NEED_TRL = ("GraftGRPOConfig", "GraftGRPOTrainer", "RecordingGRPOTrainer", "graft_method")

__all__ = [
    "INSTALL_HINT",
    "PROMPT_ID_COLUMN",
    "Exchange",
    "PeerStore",
    "RecordTrajectoriesMixin",
    "StoredPeer",
    "TRLIntegrationError",
    "TRLUnavailableError",
    "graft_exchange",
    "peer_groups",
    "peer_last_order",
    "prompt_hash",
    "prompt_id_of",
    *_NEED_TRL,
]


def __getattr__(name: str) -> Any:
    if name in _NEED_TRL:
        from graftrl.integrations.trl import trainer  # imports TRL: TRLUnavailableError without it

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
