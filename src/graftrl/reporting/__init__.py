"""Reporting: runs turned into numbers, tables and figures.

Owns run analysis (``analyze``), method comparisons over paired seeds (``compare``) and the
embedded demo built on them (``demo``), the statistics helpers (``stats``) and every figure
(``plots``). The top layer: may import anything below it; only the CLI imports it.
"""
