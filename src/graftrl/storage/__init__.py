"""Storage: what graftrl keeps on disk and reads back.

Owns the run folder's layout and its JSONL logs (``rundir``: the only module that names a
run-folder file), the declared keys of every log (``log_keys``), the tokenizer-neutral trajectory record (``records``),
the Parquet trajectory store (``store``: format, manifest, reader and writer; its row is a record
plus replay fields), problem datasets (``data``), the metrics sinks (``metrics``: JSONL,
TensorBoard, W&B) and verified checkpoints (``checkpoint``). May import ``graftrl.errors``,
``graftrl.files`` and ``graftrl.core``; never models, training or reporting, not even lazily
(building rows from a rollout and importing foreign trajectories live in ``graftrl.training``).
"""
