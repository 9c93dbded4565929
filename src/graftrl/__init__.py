"""graftrl: cross-model trajectory exchange for reinforcement learning with verifiable rewards."""

__version__ = "0.1.0"
