"""Training engine: one step of rollouts, exchange and updates, repeated, resumable.

Owns the per-policy worker (``worker``) and its phases: the rollout (``sampling``), a method's rescue round with a peer's hint in
the prompt (``rescue``), the rows a
receiver trains on (``rows``: re-tokenized, re-scored, weighted), the optimizer steps and the loss
metrics' sums (``update``), the policy's checkpoint part (``policy_state``), the step's peak memory
(``peak_memory``) and every seed (``randomness``); the one rollout -> record converter
(``trajectories``: exchanged records and store rows), FSDP2 data parallelism (``parallel``: what a
rank calls; ``ranks``: the rank processes and their proxies), the local and Ray backends that
host workers behind one typed interface, ``WorkerGroup`` (``backends``; each call's request
and result and what they call on a worker: ``worker_calls``), periodic validation
(``validation``), the loop with logs (``trainer``) and its checkpoints (``trainer_checkpoints``),
a stored peer's coverage of the run (``stored_peers``), served peers asked
each step (``served_peers``), a failed worker reported in a paragraph
(``failures``), the metrics keys it logs
(``log_schema``: its own and each method's loss metrics) and the JSONL trajectory importer that
scores foreign responses with the source model (``importer``). May import ``methods``,
``models``, ``verifiers``, ``evaluation``, ``storage``, ``config`` and below; never reporting or experiments.
"""
