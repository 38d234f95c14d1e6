"""Integrations with training libraries, each imported by its own path (e.g. ``surgeon.integrations.transformers``)."""
