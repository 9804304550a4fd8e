"""Integrations with other frameworks and engines (each in its own subpackage or module)."""
