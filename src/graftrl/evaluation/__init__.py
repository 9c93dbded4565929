"""Evaluation: held-out pass@k of a policy, as the paper measures it.

Owns the benchmark suites (``benchmarks``) and the sampling protocol and its summaries
(``evaluate``). May import ``models``, ``storage``, ``config`` and below; the trainer's periodic
validation (``graftrl.training.validation``) and the reports build on it.
"""
