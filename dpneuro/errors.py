"""The package's own exception types, in a module that imports nothing of the package, so that any module can
raise them without importing the configuration (``dpneuro.config`` re-exports :class:`ConfigError`)."""


class ConfigError(ValueError):
    """A field of the run configuration is missing or invalid (the message names it)."""
