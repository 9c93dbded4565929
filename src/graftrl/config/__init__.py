"""Run configuration: YAML validated by pydantic, one docstring per field.

``schema`` declares the sections (``RunConfig``; each method adds its own section, ``Config``),
``rewards`` the `reward` section (the verifier's kind and settings), ``peers`` the `peers`
entries (stored or served), ``loading`` reads files and ``--set`` overrides into them with
one-line errors, ``reference`` lists every field for `graftrl config-reference`.
Import from here.
"""

from graftrl.config.loading import (
    ConfigError,
    apply_overrides,
    config_from_dict,
    dump_config,
    load_config,
    minibatch_note,
    parse_override,
    read_config_file,
)
from graftrl.config.peers import PeerConfig
from graftrl.config.reference import config_reference, config_reference_markdown
from graftrl.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    OptimConfig,
    ParallelConfig,
    PolicyConfig,
    RayConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    StoreConfig,
    TrainConfig,
    ValidationConfig,
    VLLMConfig,
    config_model,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "OptimConfig",
    "ParallelConfig",
    "PeerConfig",
    "PolicyConfig",
    "RayConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "StoreConfig",
    "TrainConfig",
    "VLLMConfig",
    "ValidationConfig",
    "apply_overrides",
    "config_from_dict",
    "config_model",
    "config_reference",
    "config_reference_markdown",
    "dump_config",
    "load_config",
    "minibatch_note",
    "parse_override",
    "read_config_file",
]
