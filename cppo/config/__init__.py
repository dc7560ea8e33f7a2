"""What a user configures: TrainConfig (every setting, its choices and checks), loaded from a preset or a YAML file
with key=value overrides."""

from .settings import (  # noqa: I001  (grouped, as __all__)
    DATASETS, DTYPES, FIXED, HUB_ID_RE, KERNEL_BACKENDS, LORA_TARGET_MODULES, LR_SCHEDULES, MAX_SEED, MAX_YAML_DEPTH,
    PRESET_DIR, RESUMABLE, TINY_MODELS, TRL_NAMES, TrainConfig, available_presets, check_model_and_data,
    check_tiny_config, did_you_mean, load_config, setting_help,
)  # fmt: skip

__all__ = [
    "DATASETS", "DTYPES", "FIXED", "HUB_ID_RE", "KERNEL_BACKENDS", "LORA_TARGET_MODULES", "LR_SCHEDULES", "MAX_SEED",
    "MAX_YAML_DEPTH", "PRESET_DIR", "RESUMABLE", "TINY_MODELS", "TRL_NAMES", "TrainConfig", "available_presets",
    "check_model_and_data", "check_tiny_config", "did_you_mean", "load_config", "setting_help",
]  # fmt: skip
