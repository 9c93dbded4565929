"""Evaluation: held-out pass@k of a policy, as the paper measures it.

Owns the benchmark suites (``benchmarks``), the sampling protocol and its summaries
(``evaluate``), what `graftrl eval` loads (``targets``: a run's checkpoints or bare folders),
the report's files (``eval_report``: JSON, the paper's table, a plot) and the
statistics over seeds and runs (``stats``: mean ± std and the paired differences of result rows;
``intervals``: graftrl's one paired-difference type, ``Difference``, with its interval over seeds
or over seeds x problems and its one text; ``decisions``: Holm / BH, seeds needed and
the group-sequential looks of ``--seeds auto``). May import ``verifiers`` (the run's verifier,
any ``reward.kind``), ``models``, ``storage``, ``config`` and below; the trainer's periodic
validation (``graftrl.training.validation``) and the reports build on it.
"""
