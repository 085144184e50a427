"""A resolved config as TOML text that `load_config` reads back to the same config.

TOML has no null: a setting left unset (its default, or a value derived from the target at train time)
is written as a comment, so the text stays a config `dflash train` accepts and the unset settings stay
visible. Every Optional setting's default is None (the schema has no other), so leaving one out means
what null meant.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def config_toml(sections: dict[str, dict[str, Any]]) -> str:
    """`RunConfig.model_dump(mode="json")` as a TOML document, one table per section."""
    lines: list[str] = []
    for section, fields in sections.items():
        lines.append(f"[{section}]")
        for name, value in fields.items():
            if value is None:
                lines.append(f"# {name}: unset")
            else:
                lines.append(f"{_key(name)} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """One value as TOML; a null inside a table is left out (TOML has none, and the key absent is the
    library's default), a null inside an array is refused."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML basic string escapes
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        items = [f"{_key(str(key))} = {toml_value(item)}" for key, item in value.items() if item is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise ValueError(f"no TOML for {value!r}")


def _key(name: str) -> str:
    return name if BARE_KEY.match(name) else json.dumps(name)
