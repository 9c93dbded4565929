"""Training engine: one step of rollouts, exchange and updates, repeated, resumable.

Owns the per-policy worker (``worker``: rollout, re-tokenize, score, update), the one rollout ->
record converter (``trajectories``: exchanged records and store rows), FSDP2 data parallelism
(``parallel``), the local and Ray backends that host workers behind one typed interface,
``WorkerGroup`` (``backends``), periodic validation (``validation``), the loop with checkpoints
and logs (``trainer``) and the JSONL trajectory importer that scores foreign responses with the
source model (``importer``). May import ``methods``, ``models``, ``evaluation``, ``storage``,
``config`` and below; never reporting.
"""
