"""Load a run config from TOML, YAML or JSON plus `section.field=value` overrides, with one-line errors.

Errors name the file (or the override that set the value), the dotted key and what was expected
(`train.lr: must be > 0, got -1`); unknown keys get a close-match suggestion. Everything raises
`ConfigError`, which the CLI turns into exit code 2. A run directory is a config too: the resolved
`config.json` every run writes, so a pulled run trains, resumes or evaluates without its original file;
its `train.output_dir` is the directory named (a copied or moved run is the run where it is now).
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from app.config.builtins import BUILTIN_TARGET_PACKAGES, BUILTIN_TARGETS
from app.config.schema import TARGET_SOURCES, RunConfig, TargetConfig
from app.errors import UserError


class ConfigError(UserError):
    """A config file, key or override is wrong; the message is one line and names it."""


RUN_CONFIG_FILE = "config.json"
"""What a run directory holds as its resolved config."""


MAPPING_SOURCE = "<config mapping>"
"""How errors name a config given as a mapping (the Python API) rather than a file."""


def load_config(
    source: str | Path | Mapping[str, Any], overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Read `source` (a config file, a run directory's config.json, or a mapping of sections as a file
    holds them, which is left unchanged), apply `overrides` in order, validate everything."""
    if isinstance(source, Mapping):
        raw, name = copy.deepcopy(dict(source)), MAPPING_SOURCE
    else:
        path = Path(source)
        if path.is_dir():
            if not (path / RUN_CONFIG_FILE).is_file():
                raise ConfigError(
                    f"{path}: a directory without {RUN_CONFIG_FILE}, so not a run directory; expected a "
                    ".toml, .yaml, .yml or .json config file, or a run directory"
                )
            raw, name = _read_file(path / RUN_CONFIG_FILE), str(path / RUN_CONFIG_FILE)
            # The directory named is the run: a copy resumes as itself, a moved run where it now is,
            # not wherever its recorded train.output_dir points.
            train = raw.setdefault("train", {})
            if isinstance(train, dict):  # not a table: validation names it
                train["output_dir"] = str(path)
        else:
            raw, name = _read_file(path), str(path)
    set_by = {_apply_override(raw, override): override for override in overrides}
    return validate_config(raw, source=name, set_by=set_by)


def validate_config(
    raw: dict[str, Any], source: str = "<config>", set_by: dict[str, str] | None = None
) -> RunConfig:
    """Validate a raw mapping into a `RunConfig` and check what needs the target's shape.

    `set_by`: dotted key -> the override that set it, so an error in it names the override."""
    _reject_unknown_keys(raw, RunConfig, prefix="", source=source)
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as error:
        key = ".".join(str(part) for part in error.errors(include_url=False)[0]["loc"])
        blamed = f"override {set_by[key]!r}" if set_by and key in set_by else source
        raise ConfigError(f"{blamed}: {_describe(error)}") from None
    _check_against_target(config, source)
    return config


def target_architecture(target: TargetConfig) -> dict[str, Any] | None:
    """The target's HF config as a dict, without loading weights; None when the path has none yet."""
    if target.architecture is not None:
        return target.architecture
    if target.builtin is not None:
        return BUILTIN_TARGETS[target.builtin]
    config_file = Path(target.path) / "config.json"
    if not config_file.is_file():
        return None
    try:
        return json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{config_file}: not a readable JSON model config ({error})") from None


def require_builtin_packages(builtin: str | None) -> None:
    """Refuse the built-in target `builtin` (a `target.builtin`; None: none) where its dependency group
    is not installed, in milliseconds (a module lookup, no import): `dflash train` and `dflash eval`
    call it before anything loads or is written. Not part of `validate_config`, so that a config stays
    showable and a run exportable on any machine."""
    needs = BUILTIN_TARGET_PACKAGES.get(builtin or "")
    if needs is None:
        return
    module, group = needs
    if importlib.util.find_spec(module) is None:
        raise UserError(
            f'target.builtin = "{builtin}" needs the {group} dependency group: ./uvw sync --group {group}'
        )


def text_architecture(architecture: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Qwen3.5/3.6) keep the language model's fields under `text_config`."""
    return architecture.get("text_config", architecture)


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` layer ids spread evenly from 1 to num_target_layers - 3 (64, 5 -> [1, 16, 31, 46, 61])."""
    first, last = 1, max(1, num_target_layers - 3)
    if count == 1:
        return [first]
    return [round(first + i * (last - first) / (count - 1)) for i in range(count)]


def default_gamma(block_size: int) -> float:
    """Published loss decays for common block sizes; large blocks start near block_size / 2.5."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2.5)


def _check_against_target(config: RunConfig, source: str) -> None:
    architecture = target_architecture(config.target)
    if architecture is None:
        return  # checked again when the target is loaded
    text = text_architecture(architecture)
    num_layers = text.get("num_hidden_layers")
    vocab_size = text.get("vocab_size")
    drafter = config.drafter
    if num_layers is not None and drafter.target_layer_ids is not None:
        bad = [i for i in drafter.target_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ConfigError(
                f"{source}: drafter.target_layer_ids: must be in [0, {num_layers}) for a {num_layers}-layer "
                f"target, got {bad}"
            )
    if vocab_size is not None and drafter.mask_token_id >= vocab_size:
        raise ConfigError(
            f"{source}: drafter.mask_token_id: must be a row of the target embedding (< {vocab_size}), "
            f"got {drafter.mask_token_id}"
        )


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    text = _read_text(path)
    try:
        if path.suffix == ".toml":
            raw = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            raw = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            raw = json.loads(text)
        else:
            raise ConfigError(
                f"{path}: expected a .toml, .yaml, .yml or .json config file, or a run directory"
            )
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{path}: not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
        ) from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML: {error.problem or error}{where}") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as error:
        detail = str(error).splitlines()[0]
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {detail}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return raw


def _read_text(path: Path) -> str:
    """The file's text; bytes that are not UTF-8 (every format read here is UTF-8) are named by line and
    column, not left to a decoder's traceback."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config file ({error.strerror or error})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(
            f"{path}: not UTF-8 text: byte {data[error.start : error.start + 1]!r} at line {line}, column "
            f"{column} ({error.reason}); save the file as UTF-8"
        ) from None


def _apply_override(raw: dict[str, Any], override: str) -> str:
    """`section.field=value`: the value is parsed as a TOML value when it is one, else kept as text;
    for a list field, bare text is a comma-separated list (`a.jsonl`, `a.jsonl,b.jsonl`,
    `[a.jsonl,b.jsonl]`). Returns the dotted key it set."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r}: expected section.field=value")
    parts = key.strip().split(".")
    node: Any = raw
    model: type[BaseModel] | None = RunConfig
    for depth, part in enumerate(parts[:-1]):
        _check_known(part, model, ".".join(parts[:depth]), source=f"override {override!r}")
        model = _section_model(model, part)
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: depth + 1])} is not a section")
    _check_known(parts[-1], model, ".".join(parts[:-1]), source=f"override {override!r}")
    value = _parse_value(text.strip())
    if not isinstance(value, str) and model is not None and _is_string_field(model, parts[-1]):
        value = text.strip()  # `telemetry.run_name=2026-12-04` is a name, not the date TOML reads there
    if isinstance(value, str) and model is not None and _is_list_field(model, parts[-1]):
        if value.startswith("[") != value.endswith("]"):  # a cut list, not a file named "[unclosed"
            raise ConfigError(
                f"override {override!r}: {'.'.join(parts)}: a list with unbalanced brackets; expected "
                "[a, b] or a,b"
            )
        value = [item.strip().strip("'\"") for item in value.strip("[]").split(",") if item.strip()]
    node[parts[-1]] = value
    return ".".join(parts)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _is_list_field(model: type[BaseModel], name: str) -> bool:
    """`list[...]`, also inside an Optional."""
    return any(typing.get_origin(candidate) is list for candidate in _field_types(model, name))


def _is_string_field(model: type[BaseModel], name: str) -> bool:
    """`str` or a Literal of strings, also inside an Optional, and nothing else: the override's text is
    the value whatever TOML would read in it."""
    kinds = [candidate for candidate in _field_types(model, name) if candidate is not type(None)]
    return bool(kinds) and all(
        candidate is str
        or (
            typing.get_origin(candidate) is typing.Literal
            and all(isinstance(a, str) for a in typing.get_args(candidate))
        )
        for candidate in kinds
    )


def _field_types(model: type[BaseModel], name: str) -> tuple[Any, ...]:
    """The field's annotation, or the members of its Union."""
    annotation = model.model_fields[name].annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _section_model(model: type[BaseModel] | None, name: str) -> type[BaseModel] | None:
    if model is None:
        return None
    annotation = model.model_fields[name].annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _check_known(name: str, model: type[BaseModel] | None, prefix: str, source: str) -> None:
    if model is None or name in model.model_fields:
        return
    dotted = f"{prefix}.{name}" if prefix else name
    known = list(model.model_fields)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
    raise ConfigError(f"{source}: unknown key {dotted!r}{hint}")


def _reject_unknown_keys(raw: Any, model: type[BaseModel], prefix: str, source: str) -> None:
    """Walk the raw mapping first so an unknown key is reported with a suggestion, not pydantic's text."""
    if not isinstance(raw, dict):
        return
    for name, value in raw.items():
        _check_known(name, model, prefix, source)
        section = _section_model(model, name)
        if section is not None:
            _reject_unknown_keys(value, section, f"{prefix}.{name}" if prefix else name, source)


_EXPECTATIONS = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "literal_error": "must be one of {expected}",
    "missing": "is required",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a table/mapping",
    "model_type": "must be a table/mapping",
    "tuple_type": "must be a list",
}


def _describe(error: ValidationError) -> str:
    """The first error as `dotted.key: expectation, got value`."""
    first = error.errors(include_url=False)[0]
    key = ".".join(str(part) for part in first["loc"])
    if first["type"] == "value_error":
        # our own validators already write `key: message`
        return str(first["ctx"]["error"])
    template = _EXPECTATIONS.get(first["type"])
    expectation = (
        template.format(**first.get("ctx", {})) if template else first["msg"][0].lower() + first["msg"][1:]
    )
    if first["type"] == "missing":
        return f"{key}: {expectation}{_what_is_required(key)}"
    return f"{key}: {expectation}, got {first['input']!r}"


def _what_is_required(key: str) -> str:
    """What a missing section needs: the target one of its sources, any other its required fields."""
    if key == "target":
        choices = [f"target.{name} ({takes})" for name, takes in TARGET_SOURCES.items()]
        return f": set {', '.join(choices[:-1])} or {choices[-1]}"
    section = _section_model(RunConfig, key) if key in RunConfig.model_fields else None
    fields = section.model_fields if section is not None else {}
    required = [f"{key}.{name}" for name, field in fields.items() if field.is_required()]
    return f" (with {', '.join(required)})" if required else ""
