"""graftrl: cross-model trajectory exchange for reinforcement learning with verifiable rewards.

The foundation every layer may import (docs/architecture.md): ``errors`` (the errors a user can
fix), ``files`` (crash-safe writes and hashes), ``console`` (progress bars, warnings, quiet mode),
``interrupts`` (Ctrl-C that stops), ``machine`` (CPU kernels and threads) and ``workers``
(processes that end with their parent). The packages above it are the layers.
"""

__version__ = "0.1.0"
