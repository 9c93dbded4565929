"""Experiments: what plans, runs and resumes cells of runs, and loads their models to do so.

Owns method comparisons over paired seeds (``compare``: the run; ``matrix``: variants and
presets; ``compare_task``: the embedded task; ``cells``: training, evaluation and reuse of each
cell; ``launchers``: cells side by side, in processes or on Ray; ``compare_report``: compare's
report.md; ``benchmark_tables``: the paper's tables of a compare), the embedded demo as its
``demo`` preset (``demo``), the sweeps (``sweep``: the overlap knob and the sweeps' one driver;
``mastery``: the mastery knob) and the probe (``probe``: `graftrl probe`, its folder and files;
``probe_steps``: a training step up to the update, composed of the trainer's phases). May import
``reporting``, ``training`` and everything below; only the CLI imports it.
"""
