"""A resolved config as TOML text that `load_config` reads back to the same config.

TOML has no null: a setting left unset (its default, or a value derived from the target at train time)
is written as a comment, so the text stays a config `dflash train` accepts and the unset settings stay
visible. Every Optional setting's default is None (the schema has no other), so leaving one out means
what null meant. Values are written by tomli-w, whose escapes cover every character a string may hold
(the surrogate pairs of JSON's escapes, which TOML rejects, broke non-BMP text before).
"""

from __future__ import annotations

from typing import Any

import tomli_w


def config_toml(sections: dict[str, dict[str, Any]]) -> str:
    """`RunConfig.model_dump(mode="json")` as a TOML document, one table per section (a dict-valued
    setting, e.g. `target.architecture`, as its sub-table)."""
    parts = []
    for section, fields in sections.items():
        header = f"[{section}]\n"
        body = tomli_w.dumps(
            {section: {name: _without_nulls(value) for name, value in fields.items() if value is not None}}
        )
        body = body.removeprefix(header)  # a section holding only sub-tables gets no header of its own
        unset = "".join(f"# {name}: unset\n" for name, value in fields.items() if value is None)
        parts.append(header + unset + body)
    return "\n".join(parts)


def _without_nulls(value: Any) -> Any:
    """A null inside a table is left out (the key absent is the library's default); one inside an array
    is refused (TOML has none, and an array has no key to leave out)."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        if any(item is None for item in value):
            raise ValueError(f"no TOML for a null inside the array {value!r}")
        return [_without_nulls(item) for item in value]
    return value
