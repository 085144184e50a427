"""`dflash config show|schema|torchrun`: the resolved config of a run, every field with its doc, and the
torchrun command that launches its topology on this node."""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.cli.arguments import CONFIG_FORMS, Overrides, require_importable_stack
from app.config import RunConfig, load_config
from app.config.toml_text import config_toml

group = typer.Typer(help="Inspect run configs.", no_args_is_help=True)


@group.command("show")
def show(
    config: Annotated[str, typer.Argument(help=f"Run config: {CONFIG_FORMS}.")],
    overrides: Overrides = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of TOML.")] = False,
) -> None:
    """Print the fully resolved config, as TOML that `dflash train` accepts as it is.

    File + overrides + defaults, and the defaults derived from the target (the drafter's head layout,
    FFN, target layers) and the block size (gamma); unset settings are comments."""
    loaded = load_config(config, overrides or [])
    require_importable_stack()  # the derived defaults import torch and transformers
    data = _with_derived_defaults(loaded).model_dump(mode="json")
    if as_json:
        print(json.dumps(data, indent=2))
        return
    print(config_toml(data), end="")


@group.command("torchrun")
def torchrun(
    config: Annotated[str, typer.Argument(help=f"Run config: {CONFIG_FORMS}.")],
    overrides: Overrides = None,
) -> None:
    """Print the torchrun command that launches the config's topology on this node, one word per line.

    Without the program it runs: from topology.nnodes / nproc_per_node and the rendezvous variables
    (RDZV_ENDPOINT and RDZV_ID, or MASTER_ADDR, MASTER_PORT and NODE_RANK), after waiting for an
    endpoint another node hosts. entrypoint.sh train runs it; a partial rendezvous is refused."""
    import os

    from app.pipeline.launch import torchrun_options

    options = torchrun_options(load_config(config, overrides or []).topology, os.environ)
    print("\n".join(["torchrun", *options]))


@group.command("schema")
def schema(
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON schema.")] = False,
) -> None:
    """Print every config field with its type, default and documentation."""
    if as_json:
        print(json.dumps(RunConfig.model_json_schema(), indent=2))
        return
    console = Console(width=160)
    for section, field in RunConfig.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        table = Table(title=f"[{section}]  {field.description or ''}", title_justify="left", show_lines=False)
        table.add_column("key", style="bold")
        table.add_column("type")
        table.add_column("default")
        table.add_column("meaning")
        for name, sub in model.model_fields.items():
            # escaped: rich would read `[int]` of `list[int]` as markup and drop it
            table.add_row(
                name, escape(_type_name(sub.annotation)), escape(_default(sub)), escape(sub.description or "")
            )
        console.print(table)


def _with_derived_defaults(config: RunConfig) -> RunConfig:
    """The config as a run records it; as loaded, with a note, when the target's config is not here."""
    from app.errors import UserError
    from app.model.drafter import DrafterArch, with_derived_defaults  # torch: only for `show`

    try:
        return with_derived_defaults(config, DrafterArch.from_config(config))
    except UserError as error:
        print(f"# defaults derived from the target left unset: {error}", file=sys.stderr)
        return config


def _type_name(annotation: Any) -> str:
    """A field's type as a user writes values of it: a Literal's allowed values, `| null` for Optional."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(value) for value in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if arg is type(None) else _type_name(arg) for arg in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(_type_name(arg) for arg in args)}]"
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _default(field: Any) -> str:
    if field.is_required():
        return "(required)"
    return json.dumps(field.get_default(call_default_factory=True), default=str)
