"""The embedded default: a task and a pair of tiny models that run anywhere, in minutes.

Owns the procedural tasks (``task``; the code task's programs and tests: ``code_task``), the tokenizers and tiny models (``models``), the
warm-start recipes and the sweeps' knobs (``mixes``), the cached deterministic warm-start
(``warmstart``; ``warmstart_workers``: the models' warm-starts side by side), the default pair's shipped weights (``shipped``) and the task as a base config
(``base``). May import ``verifiers``, ``models``, ``storage`` and below; never training, reporting or
experiments.
"""
