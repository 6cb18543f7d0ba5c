"""The package's own exception types, in a module that imports nothing of the package, so that any module can
raise them without importing the configuration (``dpneuro.config`` re-exports :class:`ConfigError`)."""


class DpneuroError(Exception):
    """Every error dpneuro raises on purpose derives from this (with the built-in type it always had, so
    ``except ValueError`` keeps working): ``except DpneuroError`` catches what the package reports by name."""


class ConfigError(DpneuroError, ValueError):
    """A field of the run configuration is missing or invalid (the message names it)."""


class UnsafeRelease(DpneuroError, ValueError):
    """A site refuses to release: the noise another party asked for is below what its own configuration promises
    (the message names the site, the field and the party that set it)."""


class DataValidationError(DpneuroError, ValueError):
    """An input file is missing, unreadable or does not fit the analysis."""
