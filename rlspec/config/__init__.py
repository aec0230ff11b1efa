"""Structured configs: the only home of defaults (rlspec/config/schema.py and, for speculation,
speculation.py, each field documented there). YAML under conf/ selects groups and overrides
values; `resolve_auto` fixes the settings left 'auto' (resolve.py); `validate` checks what types
cannot, naming the offending key (checks.py). The offline draft trainer's sections are in draft.py."""
from rlspec.config.checks import validate
from rlspec.config.draft import DraftConfig, DraftTrainConfig
from rlspec.config.resolve import (default_dtype, engine_dtype, fp32_grad_accumulation, off_policy_correction,
                                   plan_of, recompute_logprobs, resolve_auto, resolve_engine)
from rlspec.config.schema import (ASSETS, SPEC_METHODS, AlgoConfig, AsyncGRPOConfig, ClusterConfig, ConfigError,
                                  DataConfig, DatasetConfig, GenerationConfig, HistoryConfig, LoggingConfig,
                                  ModelConfig, OnlineDraftConfig, RLSpecConfig, SpeculationConfig, SyntheticConfig,
                                  TrainerConfig, register_configs, register_resolvers)

__all__ = ["ASSETS", "SPEC_METHODS", "AlgoConfig", "AsyncGRPOConfig", "ClusterConfig", "ConfigError", "DataConfig",
           "DatasetConfig", "DraftConfig", "DraftTrainConfig", "GenerationConfig", "HistoryConfig", "LoggingConfig",
           "ModelConfig", "OnlineDraftConfig", "RLSpecConfig", "SpeculationConfig", "SyntheticConfig",
           "TrainerConfig", "default_dtype", "engine_dtype", "fp32_grad_accumulation", "off_policy_correction",
           "plan_of", "recompute_logprobs", "register_configs", "register_resolvers", "resolve_auto",
           "resolve_engine", "validate"]
