"""islands: communication-efficient, fault-tolerant training across poorly connected device groups."""

__version__ = "0.1.0"
