"""Storage: what graftrl keeps on disk and reads back.

Owns the run folder's layout and its JSONL logs (``rundir``: the only module that names a
run-folder file), the declared keys of every log (``log_keys``), the tokenizer-neutral trajectory record (``records``),
the Parquet trajectory store (``store``: folder, reader and writer; ``store_rows``: its row, a
record plus replay fields, and the row checks; ``store_manifest``: the file that says which steps
it holds; ``store_import``: several steps written as one resumable unit), which stored group
serves a prompt at a step (``peers``: the one lookup of stored peers, in graftrl and in TRL), problem datasets (``problems``: the ``Problem`` row; ``data``; ``data_formats``: the row formats it reads), the metrics sinks (``metrics``: JSONL,
TensorBoard, W&B) and verified checkpoints (``checkpoint``). May import ``graftrl.errors``,
``graftrl.files`` and ``graftrl.core``; never models, training or reporting, not even lazily
(building rows from a rollout and importing foreign trajectories live in ``graftrl.training``).
"""
