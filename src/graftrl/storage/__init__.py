"""Storage: what graftrl keeps on disk and reads back.

Owns the tokenizer-neutral trajectory record (``records``), the Parquet trajectory store
(``store``: format, manifest, reader and writer; its row is a record plus replay fields),
problem datasets (``data``), the metrics log and its sinks (``metrics``) and verified
checkpoints (``checkpoint``). May import ``graftrl.errors``, ``graftrl.files`` and
``graftrl.core``; never models, training or reporting, not even lazily (building rows from a
rollout and importing foreign trajectories live in ``graftrl.training``).
"""
