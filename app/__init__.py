"""Parley: a real-time, fully local voice assistant."""

__version__ = "0.1.0"
