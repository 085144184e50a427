"""A resolved config as TOML text that `load_config` reads back to the same config.

TOML has no null: a setting left unset (its default, or a value derived from the target at train time)
is written as a comment, so the text stays a config `dflash train` accepts and the unset settings stay
visible. Every Optional setting's default is None (the schema has no other), so leaving one out means
what null meant. Keys and scalars are written by tomli-w, whose escapes cover every character a string
may hold (the surrogate pairs of JSON's escapes, which TOML rejects, broke non-BMP text before); arrays
and tables stay inline, one setting a line.
"""

from __future__ import annotations

from typing import Any

import tomli_w


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
    """One value as inline TOML; a null inside a table is left out (TOML has none, and the key absent is
    the library's default), a null inside an array is refused."""
    if isinstance(value, list):
        if any(item is None for item in value):
            raise ValueError(f"no TOML for a null inside the array {value!r}")
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        items = [f"{_key(str(key))} = {toml_value(item)}" for key, item in value.items() if item is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")


def _key(name: str) -> str:
    return tomli_w.dumps({name: 0}).removesuffix(" = 0\n")
