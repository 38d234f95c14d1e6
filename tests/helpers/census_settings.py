"""Per-type settings for the census (:mod:`helpers.census`): sizes a type's config ties together that the
generic shrink cannot keep in step, and values a type's default config lacks that its own code needs (a real
checkpoint's config.json has them). Each is set after the shrink (a dotted key sets a sub-config's: ``text_config.
hidden_size``); a top-level key is also given when the config is created (a default its own validator refuses).
Each entry says which rule of the type's own config it satisfies.
"""

from __future__ import annotations

TYPE_SETTINGS: dict[str, dict[str, object]] = {}
