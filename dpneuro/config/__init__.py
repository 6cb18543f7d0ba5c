"""The run configuration: one TOML file, validated as a whole before anything runs.

- :mod:`dpneuro.config.schema`: :class:`RunConfig`, every setting declared once (its default, documentation,
  constraint, the stages it changes and whether every party must share it);
- :mod:`dpneuro.config.constraints`: what a setting accepts;
- :mod:`dpneuro.config.docs`: docs/api.md's settings table and site_templates/run.toml, generated from the
  schema (``python -m dpneuro.config --write .``).
"""

from dpneuro._utils.errors import ConfigError
from dpneuro.config.constraints import Boolean, Constraint, Interval, OrNone, StrOptions
from dpneuro.config.docs import run_template, settings_markdown, toml_value, with_settings
from dpneuro.config.schema import (
    CALIBRATIONS,
    DEFAULT_RUN_ID,
    ICA_MODELS,
    PCA_CONTRIBUTIONS,
    PLANS,
    REAL_DATA_SETTINGS,
    REDUCTIONS,
    SITE_MAPS_METHODS,
    STAGES,
    STATE_METHODS,
    STATE_METRICS,
    SUBJECTS_PER_TASK,
    SYNTHETIC_CONSORTIUM,
    TUNED_FIELDS,
    UNITS,
    UNMIXINGS,
    RunConfig,
    SiteEntry,
    check_colluding,
    check_delta,
    consortium_fields,
    constraint,
    estimator_name,
    stage_fields,
    summary,
)

__all__ = [
    "CALIBRATIONS", "ICA_MODELS", "PCA_CONTRIBUTIONS", "PLANS", "REDUCTIONS", "STATE_METHODS", "STATE_METRICS",
    "TUNED_FIELDS", "UNITS", "UNMIXINGS", "DEFAULT_RUN_ID", "REAL_DATA_SETTINGS", "SITE_MAPS_METHODS", "STAGES",
    "SUBJECTS_PER_TASK", "SYNTHETIC_CONSORTIUM", "Boolean", "ConfigError", "Constraint", "Interval", "OrNone",
    "RunConfig", "SiteEntry", "StrOptions", "check_colluding", "check_delta", "consortium_fields", "constraint",
    "estimator_name", "run_template", "settings_markdown", "stage_fields", "summary", "toml_value", "with_settings",
]
