"""Reporting: runs turned into numbers, tables and figures.

Computation: run diagnostics (``analyze``), method comparisons over paired seeds (``compare``:
matrices, presets, cells) with the embedded demo as its ``demo`` preset (``demo``), using the
statistics of ``graftrl.evaluation.stats``. Rendering: Markdown and rich tables
(``render``) and every figure (``plots``). The top layer: may import anything below it; only the
CLI imports it.
"""
