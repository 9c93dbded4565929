"""Experiments: what plans, runs and resumes cells of runs, and loads their models to do so.

Owns method comparisons over paired seeds (``compare``: the sub-package of `graftrl compare`,
its run, task, report.md, exchange diagnostics, ``--plan`` and ``--seeds auto``'s rounds;
``matrix``: variants and presets; ``cells``: training, evaluation and reuse of each cell;
``cell_inputs``: what a cell was trained from, by content; ``launchers``: cells side by side, in
processes or on Ray; ``benchmark_tables``: the paper's tables of a compare; ``paired_decisions``:
the paired comparisons, their correction and seeds needed), the embedded demo as its
``demo`` preset (``demo``), the sweeps (``sweep``: the overlap knob and the sweeps' one driver;
``mastery``: the mastery knob; ``mastery_hint``: its hint rows; ``mastery_rule``: its test of the probe's rule) and the probe (``probe``: `graftrl probe`, its folder and files;
``probe_steps``: a training step up to the update, composed of the trainer's phases). May import
``reporting``, ``training`` and everything below; only the CLI imports it.
"""
