"""Parley's LLM serving engine. Must not import ``app``."""
