"""Reporting: runs turned into numbers, tables and figures.

Computation: one run's diagnostics (``analyze``, with ``complementarity`` and ``exchange``), diagnostics across runs (``diagnostics``,
``contrast``), the weights transferred responses were trained with (``weights``), method
comparisons over paired seeds (``compare``: the run; ``matrix``: variants and presets;
``compare_task``: the embedded task; ``cells``: training, evaluation and reuse of each cell; ``cell_inputs``: what a cell was trained from) with
the embedded demo as its ``demo`` preset (``demo``), the sweeps (``sweep``, ``mastery``), using
the statistics of ``graftrl.evaluation.stats``. Writing: analysis.md (``analysis_report``),
compare's report.md (``compare_report``), Markdown and rich tables (``render``) and every figure
(``plots``). The top layer: may import anything below it; only the CLI imports it.
"""
