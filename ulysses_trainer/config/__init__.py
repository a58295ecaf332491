"""The training config: TrainConfig's fields (train_config.py), TRL's spellings (trl.py), how one is loaded
from defaults < YAML recipe < --name value (load.py: typed_values.py, yaml_numbers.py, name_hints.py) and its
field-level checks (checks.py). What callers import from `ulysses_trainer.config` is exported here."""

from .checks import validate_config
from .load import build_config
from .train_config import (
    DEFAULT_DS_CONFIG,
    FIELDS,
    HINTS,
    PACKAGE_DIR,
    REPO_ROOT,
    TrainConfig,
    config_to_dict,
    record_origins,
)

__all__ = ["DEFAULT_DS_CONFIG", "FIELDS", "HINTS", "PACKAGE_DIR", "REPO_ROOT", "TrainConfig", "build_config",
           "config_to_dict", "record_origins", "validate_config"]
