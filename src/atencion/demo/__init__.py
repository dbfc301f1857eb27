"""The embedded Spanish→English demonstration."""
