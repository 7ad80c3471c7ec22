"""Integrations with external training frameworks (each imported lazily)."""
