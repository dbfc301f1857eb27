"""Converters between atencion models and other implementations."""
