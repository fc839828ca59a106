"""The package version (its own module, so low layers need not import the package root)."""

__version__ = "0.1.0"
