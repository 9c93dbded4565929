"""Bridges between graftrl and other training libraries (``graftrl.integrations.trl``: TRL).

Nothing else in graftrl imports these libraries. Each integration imports without its library
installed and fails only when a part that needs it is used, with a one-line install hint.
Integrations sit beside the CLI at the top of the layers: they may import storage, core, methods
and models (and never training, reporting or the CLI).
"""
