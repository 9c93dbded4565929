"""Training engine: one step of rollouts, exchange and updates, repeated, resumable.

Owns the per-policy worker (``worker``: rollout, re-tokenize, score, update), FSDP2 data
parallelism (``parallel``), the local and Ray backends that host workers behind one typed
interface, ``WorkerGroup`` (``backends``), periodic validation (``validation``) and the loop with
checkpoints and logs (``trainer``). May import ``methods``, ``models``, ``evaluation``,
``storage``, ``config`` and below; never reporting.
"""
