"""Bridges between graftrl and other training libraries (``graftrl.integrations.trl``: TRL).

Nothing else in graftrl imports these libraries. Each integration imports without its library
installed and fails only when a part that needs it is used, with a one-line install hint.
Integrations sit beside the CLI at the top of the layers: they may import storage, core, methods,
models and training's rollout -> record converter (``training.trajectories``, so a recorded run's
rows are the trainer's), never reporting or the CLI (tests/test_layers.py).
"""
