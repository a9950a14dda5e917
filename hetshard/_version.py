"""The package version (one place: the package and its modules read it here)."""

__version__ = "0.1.0"
