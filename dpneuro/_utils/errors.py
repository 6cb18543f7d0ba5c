"""The package's own exception types, in a module that imports nothing of the package, so that any module can
raise them without importing the configuration (``dpneuro.config`` re-exports :class:`ConfigError`)."""


class ConfigError(ValueError):
    """A field of the run configuration is missing or invalid (the message names it)."""


class UnsafeRelease(ValueError):
    """A site refuses to release: the noise another party asked for is below what its own configuration promises
    (the message names the site, the field and the party that set it)."""
