"""Storage: what graftrl keeps on disk and reads back.

Owns the tokenizer-neutral trajectory record (``records``), the Parquet trajectory store
(``store``), problem datasets (``data``), the metrics log and its sinks (``metrics``) and
verified checkpoints (``checkpoint``). May import ``graftrl.errors``, ``graftrl.files`` and
``graftrl.core``; never models, training or reporting.
"""
