"""Structured configs: the only home of defaults (rlspec/config/schema.py and, for speculation,
speculation.py, each field documented there). YAML under conf/ selects groups and overrides
values; `check_values` checks what types cannot, naming the offending key (checks.py). A leaf: the
checks and resolutions that need the placement plan, the memory model or a registry are
rlspec/checks.py's (`validate`, `resolve_auto`, `plan_of`). The offline draft trainer's sections
are in draft.py."""
from rlspec.config.checks import check_values
from rlspec.config.draft import DraftConfig, DraftTrainConfig
from rlspec.config.resolve import (default_dtype, engine_dtype, fp32_grad_accumulation, off_policy_correction,
                                   recompute_logprobs, resolve_engine)
from rlspec.config.schema import (ASSETS, SPEC_METHODS, AlgoConfig, AsyncGRPOConfig, ClusterConfig, ConfigError,
                                  DataConfig, DatasetConfig, GenerationConfig, HistoryConfig, LoggingConfig,
                                  ModelConfig, OnlineDraftConfig, RLSpecConfig, SpeculationConfig, SyntheticConfig,
                                  TrainerConfig, register_configs, register_resolvers)

__all__ = ["ASSETS", "SPEC_METHODS", "AlgoConfig", "AsyncGRPOConfig", "ClusterConfig", "ConfigError", "DataConfig",
           "DatasetConfig", "DraftConfig", "DraftTrainConfig", "GenerationConfig", "HistoryConfig", "LoggingConfig",
           "ModelConfig", "OnlineDraftConfig", "RLSpecConfig", "SpeculationConfig", "SyntheticConfig",
           "TrainerConfig", "check_values", "default_dtype", "engine_dtype", "fp32_grad_accumulation",
           "off_policy_correction", "recompute_logprobs", "register_configs", "register_resolvers", "resolve_engine"]
