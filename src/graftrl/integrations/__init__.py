"""Bridges between graftrl and other training libraries (``graftrl.integrations.trl``: TRL).

Nothing else in graftrl imports these libraries. Each integration imports without its library
installed and fails only when a part that needs it is used, with a one-line install hint.
Integrations sit beside the CLI at the top of the layers, but reach down only to what a bridge
needs: graftrl's top-level utilities (``graftrl.errors``, ...), core, methods, storage, models,
verifiers (``graftrl.verifiers``: the run's verifier of any ``reward.kind`` as a reward function)
with the ``reward`` section's settings (``config.rewards``), the served peer's settings
(``config.peers``: TRL's ``ServedPeer`` is ``graftrl train``'s ``ServedPeerConfig``), training's
records (``training.trajectories``: a recorded run's rows are the trainer's, and a replayed stored
peer's groups are re-verified as the trainer's are) and its peer sources (``training.peer_sources``:
TRL builds its peers through the same interface and registry, so a peer kind registered for
``graftrl train`` works in TRL too); never the rest of config, evaluation, embedded, the rest of
training, reporting or the CLI (tests/test_layers.py).
"""
