"""The package version, in a module of its own so that components can read it without importing the public face."""

__version__ = "0.2.0"
