"""Reporting: finished runs turned into numbers, tables and figures; it loads no model.

Computation: one run's diagnostics (``analyze``, with ``complementarity``, ``exchange``: what
every method moved, and ``served``: a served peer's answers and cost), diagnostics across runs
(``diagnostics``, ``contrast``), the weights transferred responses were trained with
(``weights``), the figures of a probe and their recount from its files (``probe_stats``), the probe's
verdict rule and its measured track record (``probe_rule``), the lab's data files those and the
mastery line read from the checkout, not package data (``lab_data``), the
logs of a run as curves (``run_logs``), a compare cell's per-problem results
(``problem_results``), using the statistics of ``graftrl.evaluation``.
Writing: analysis.md (``analysis_report``), probe.md (``probe_report``), Markdown and rich tables
(``render``), every figure (``plots``) and the provenance line of every report (``provenance``).
What runs cells and loads their models (compare, the sweeps, the demo, the probe's driver) is
``graftrl.experiments``, above it. May import ``training.log_schema`` (the declared metrics keys)
and the layers below training; never models, the rest of training or experiments, not even
lazily (tests/test_layers.py).
"""
