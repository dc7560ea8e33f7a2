"""What a user configures, as plain data (importing it imports no torch): TrainConfig, every setting with its meaning
and checks (settings.py; each component's check imported as it runs), the pruning settings declared once for it and
CPPOConfig (pruning.py), the rollout_stop: section's options (sections.py), the choices of the named ones and what a
resume may change (choices.py), loaded from a preset or a YAML file with key=value overrides (loading.py); the model
and data checked to exist (sources.py); values in YAML's words (values.py)."""

from .choices import (  # noqa: I001  (grouped, as __all__)
    DATASETS, DTYPES, FIXED, HUB_ID_RE, KERNEL_BACKENDS, LORA_TARGET_MODULES, LR_SCHEDULES, MAX_SEED, RESUMABLE,
    TINY_MODELS,
)  # fmt: skip
from .pruning import PRUNING_SETTINGS, HoldsPruning, pruning_setting
from .loading import MAX_YAML_DEPTH, PRESET_DIR, TRL_NAMES, available_presets, load_config
from .names import Names
from .sections import ROLLOUT_STOP, rollout_stop_defaults, with_rollout_stop_section
from .settings import TrainConfig, setting_help
from .sources import check_model_and_data, check_tiny_config
from .values import did_you_mean

__all__ = [
    "DATASETS", "DTYPES", "FIXED", "HUB_ID_RE", "KERNEL_BACKENDS", "LORA_TARGET_MODULES", "LR_SCHEDULES", "MAX_SEED",
    "RESUMABLE", "TINY_MODELS", "PRUNING_SETTINGS", "HoldsPruning", "pruning_setting",
    "MAX_YAML_DEPTH", "PRESET_DIR", "TRL_NAMES", "available_presets", "load_config", "Names",
    "ROLLOUT_STOP", "rollout_stop_defaults", "with_rollout_stop_section",
    "TrainConfig", "setting_help", "check_model_and_data", "check_tiny_config", "did_you_mean",
]  # fmt: skip
