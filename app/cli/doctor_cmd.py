"""`dflash doctor`: is this the locked training stack, and what changed since a recorded run?

Exit codes: 0 healthy (with --against: no breaking difference); 1 problems in this environment
(with --against: a breaking difference); 2 a missing or corrupt fingerprint file.
The checks live in app.env; this module only renders them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from app.cli.arguments import CONFIG_FORMS
from app.env import Difference
from app.errors import UserError

if TYPE_CHECKING:
    from app.compile.artifacts import CacheEntry
    from app.config.schema import RunConfig
    from app.env import Finding

_LEVEL_STYLE = {"problem": "bold red", "warning": "yellow", "info": "dim"}
PACKAGE_ROWS_PER_KIND = 5
PACKAGE_NAMES_LISTED = 20


def doctor(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the fingerprint (with --against: the differences) as JSON.")
    ] = False,
    save: Annotated[
        Path | None,
        typer.Option(
            "--save", help="Write the fingerprint to FILE (an existing directory gets fingerprint.json)."
        ),
    ] = None,
    against: Annotated[
        Path | None,
        typer.Option(
            "--against",
            help="A recorded fingerprint: a JSON file, or a run directory (compared at its last good start).",
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config", help=f"A run config ({CONFIG_FORMS}): also match the compile caches on its shapes."
        ),
    ] = None,
) -> None:
    """Fingerprint the environment (torch/CUDA/triton/transformers, GPUs, uv.lock, stray packages, caches)."""
    from app.env import assess, collect_fingerprint, diff_fingerprints, recorded_fingerprint, save_fingerprint

    # Load first: a bad --against path or config is a usage error and should not cost a fingerprint.
    # A run directory is compared at its last good start, not at a drifted resume after it.
    recorded, recorded_as = recorded_fingerprint(against) if against is not None else (None, "")
    run_config = _load_run_config(config)
    fingerprint = collect_fingerprint()
    if save is not None:
        saved_to = save_fingerprint(fingerprint, save)
        if not as_json:
            print(f"fingerprint saved to {saved_to}")
    findings = assess(fingerprint)

    if recorded is not None:
        differences = diff_fingerprints(recorded, fingerprint)
        breaking = any(difference.breaking for difference in differences)
        if as_json:
            report = {
                "against": recorded_as,
                "breaking": breaking,
                "differences": [d.to_dict() for d in differences],
            }
            print(json.dumps(report, indent=2, default=str))
        else:
            _print_diff(Console(width=max(Console().width, 160)), recorded_as, differences, findings)
        raise typer.Exit(1 if breaking else 0)

    if as_json:
        print(json.dumps(fingerprint, indent=2, default=str))
    else:
        _print_report(Console(), fingerprint, findings)
        _print_compile_caches(Console(), run_config)
    raise typer.Exit(1 if any(finding.level == "problem" for finding in findings) else 0)


def _load_run_config(path: str | None) -> RunConfig | None:
    if path is None:
        return None
    from app.config import load_config

    return load_config(path)


def _print_compile_caches(console: Console, run_config: RunConfig | None) -> None:
    """The baked caches in compile.cache_dir: which one this machine (and config) would load, and why
    each other one would not."""
    from app.compile.artifacts import list_entries
    from app.config.schema import CompileConfig

    cache_dir = Path((run_config.compile if run_config else CompileConfig()).cache_dir).expanduser()
    console.print()
    entries, broken = list_entries(cache_dir)
    if not entries and not broken:
        console.print(
            f"compile caches: none in {cache_dir}/ (bake one with `dflash build-cache CONFIG`)",
            highlight=False,
        )
        return
    from app.compile.catalog import survey_this_machine

    key, statuses, broken = survey_this_machine(cache_dir, run_config)
    scope = "this machine and config" if run_config else "this machine (shapes not checked: pass --config)"
    console.print(f"compile caches in {cache_dir}/, compared with {scope}:", highlight=False)
    if key is not None:
        console.print(f"  this run's key: {key}", highlight=False)
    for status in statuses:
        if status.matches:
            console.print(f"  [green]matches[/]: {status.entry.describe()}", highlight=False)
            if run_config is not None and key is not None:
                _print_if_built_elsewhere(console, status.entry, run_config, key)
        else:
            console.print(f"  [yellow]differs[/]: {status.entry.describe()}", highlight=False)
            for difference in status.differences:
                console.print(f"      {difference}", highlight=False)
    for line in broken:
        console.print(f"  [red]unusable[/]: {line}", highlight=False)
    if not any(status.matches for status in statuses):
        console.print("  [yellow]no cache matches[/]: training would compile from scratch", highlight=False)


def _print_if_built_elsewhere(console: Console, entry: CacheEntry, run_config: RunConfig, key: str) -> None:
    from app.compile.environment import key_inductor_dir

    try:
        inductor_dir = key_inductor_dir(run_config.compile, key)
    except UserError:
        return  # an inductor dir under /tmp: the report above names it
    built_in = entry.built_elsewhere(inductor_dir)
    if built_in is not None:
        console.print(
            f"      [yellow]built in {built_in}[/], this config starts in {inductor_dir}: every start "
            "re-tunes its kernels; build with the same compile.inductor_dir",
            highlight=False,
        )


def _print_report(console: Console, fingerprint: dict[str, Any], findings: list[Finding]) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for label, value in [
        *_stack_rows(fingerprint),
        *_gpu_rows(fingerprint["gpus"]),
        *_state_rows(fingerprint),
    ]:
        table.add_row(label, value)
    console.print(table)
    console.print()
    for finding in findings:
        console.print(
            f"[{_LEVEL_STYLE[finding.level]}]{finding.level}[/]: {finding.message}", highlight=False
        )
        if finding.fix:
            console.print(f"  fix: {finding.fix}", highlight=False)
    problems = sum(finding.level == "problem" for finding in findings)
    warnings = sum(finding.level == "warning" for finding in findings)
    if problems:
        console.print(
            f"[bold red]verdict: NOT the locked training stack[/] ({problems} problems, {warnings} warnings)"
        )
    else:
        console.print(f"[bold green]verdict: locked training stack OK[/] ({warnings} warnings)")


def _stack_rows(fingerprint: dict[str, Any]) -> list[tuple[str, str]]:
    host, python, torch = fingerprint["host"], fingerprint["python"], fingerprint["torch"]
    if torch.get("import_error"):
        torch_row = f"[red]{torch.get('version')} does not import: {torch['import_error']}[/]"
    else:
        build = (
            f"CUDA {torch['cuda']}"
            if torch.get("cuda")
            else f"ROCm {torch['hip']}"
            if torch.get("hip")
            else "CPU"
        )
        torch_row = f"{torch['version']} ({build}, cuDNN {torch.get('cudnn')}, NCCL {torch.get('nccl')})"
    return [
        ("host", f"{host['hostname']} ({host['platform']})"),
        ("python", f"{python['version']} ({python['executable']})"),
        ("torch", torch_row),
        ("triton", str(fingerprint["triton"])),
        ("transformers", str(fingerprint["transformers"])),
    ]


def _gpu_rows(gpus: dict[str, Any]) -> list[tuple[str, str]]:
    if not gpus["devices"]:
        return [("gpus", "none visible")]
    rows = [
        (
            f"gpu {index}",
            f"{device['name']}, sm {device['compute_capability']}, {device['memory_mib']} MiB, "
            f"driver {device['driver_version']}",
        )
        for index, device in enumerate(gpus["devices"])
    ]
    return [*rows, ("gpu source", str(gpus["source"]))]


def _state_rows(fingerprint: dict[str, Any]) -> list[tuple[str, str]]:
    lock, packages, cache = fingerprint["lock"], fingerprint["packages"], fingerprint["compile_cache"]
    rows = [
        (
            "uv.lock",
            f"{lock['path']} (sha256 {lock['sha256'][:16]}…)" if lock["sha256"] else "[red]missing[/]",
        )
    ]
    if packages.get("checked"):
        rows.append(
            (
                "packages",
                f"{packages['installed_count']} installed: {len(packages['stray'])} not in uv.lock, "
                f"{len(packages['mismatched'])} at other versions, {len(packages['duplicates'])} duplicated",
            )
        )
    for module, status in fingerprint["fast_kernels"].items():
        shown = (
            "present" if status["present"] else "installed, does not import" if status["error"] else "absent"
        )
        rows.append((module, f"{shown} ({status['version']})" if status["version"] else shown))
    rows.append(("inductor cache", f"{cache['inductor_dir']} ({cache['inductor_dir_from']})"))
    rows.append(("triton cache", f"{cache['triton_dir']} ({cache['triton_dir_from']})"))
    project = fingerprint["project"]
    if project.get("revision"):
        rows.append(
            ("git", f"{project['revision'][:12]}{' (uncommitted changes)' if project.get('dirty') else ''}")
        )
    return rows


def _print_diff(
    console: Console, against: str, differences: list[Difference], findings: list[Finding]
) -> None:
    breaking = [difference for difference in differences if difference.breaking]
    cosmetic = [difference for difference in differences if not difference.breaking]
    if differences:
        table = Table(title=f"environment now vs {against}", title_justify="left")
        table.add_column("", no_wrap=True)
        table.add_column("field", style="bold", no_wrap=True)
        table.add_column("recorded")
        table.add_column("now")
        table.add_column("why it matters")
        for row in _display_rows([*breaking, *cosmetic]):
            table.add_row(*row)
        console.print(table)
    problems = sum(finding.level == "problem" for finding in findings)
    if problems:
        console.print(f"note: this environment has {problems} problems of its own; run `dflash doctor`")
    if breaking:
        console.print(
            f"[bold red]verdict: {len(breaking)} breaking differences[/] ({len(cosmetic)} cosmetic): "
            "kernels, numerics or the compile cache may differ from the recorded run"
        )
    else:
        console.print(f"[bold green]verdict: same training stack[/] ({len(cosmetic)} cosmetic differences)")


def _display_rows(differences: list[Difference]) -> list[tuple[str, str, str, str, str]]:
    """One row per difference, except that a polluted venv's hundreds of package differences show the
    first few per kind (core stack first, as diff_fingerprints orders them) and name the rest in one row."""
    order: list[Difference | str] = []
    groups: dict[str, list[Difference]] = {}
    for difference in differences:
        if not difference.field.startswith("packages."):
            order.append(difference)
            continue
        group = difference.field.rsplit(".", 1)[0]
        if group not in groups:
            groups[group] = []
            order.append(group)
        groups[group].append(difference)
    rows = []
    for item in order:
        if isinstance(item, Difference):
            rows.append(_row(item))
            continue
        members = groups[item]
        rows += [_row(difference) for difference in members[:PACKAGE_ROWS_PER_KIND]]
        rest = [difference.field.rsplit(".", 1)[1] for difference in members[PACKAGE_ROWS_PER_KIND:]]
        if rest:
            names = ", ".join(rest[:PACKAGE_NAMES_LISTED]) + (
                ", ..." if len(rest) > PACKAGE_NAMES_LISTED else ""
            )
            rows.append(
                ("[bold red]breaking[/]", f"{item}.*", "", "", f"{len(rest)} more: {names} (see --json)")
            )
    return rows


def _row(difference: Difference) -> tuple[str, str, str, str, str]:
    kind = "[bold red]breaking[/]" if difference.breaking else "[dim]cosmetic[/]"
    return kind, difference.field, _shown(difference.old), _shown(difference.new), difference.why


def _shown(value: Any) -> str:
    if value is None:
        return "(absent)"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "(none)"
    return str(value)
