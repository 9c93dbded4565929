"""Experiments: what plans, runs and resumes cells of runs, and loads their models to do so.

Owns method comparisons over paired seeds (``compare``: the run; ``matrix``: variants and
presets; ``compare_task``: the embedded task; ``cells``: training, evaluation and reuse of each
cell; ``cell_inputs``: what a cell was trained from, by content; ``launchers``: cells side by side, in processes or on Ray; ``compare_report``: compare's
report.md; ``compare_exchange``: its exchange diagnostics; ``benchmark_tables``: the paper's tables of a compare;
``paired_decisions``: the paired comparisons, their correction and seeds needed; ``compare_plan``:
``--plan``; ``compare_rounds``: ``--seeds auto``'s rounds), the embedded demo as its
``demo`` preset (``demo``), the sweeps (``sweep``: the overlap knob and the sweeps' one driver;
``mastery``: the mastery knob; ``mastery_hint``: its hint rows; ``mastery_rule``: its test of the probe's rule) and the probe (``probe``: `graftrl probe`, its folder and files;
``probe_steps``: a training step up to the update, composed of the trainer's phases). May import
``reporting``, ``training`` and everything below; only the CLI imports it.
"""
