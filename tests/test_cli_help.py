"""What `--help` says is true to the code and reads whole: one-line summaries, the CONFIG forms
`load_config` reads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from app.cli import cli
from app.cli.arguments import CONFIG_FORMS
from app.config import load_config
from tests.helpers import ROOT, dflash


def commands(command: Any = None, path: str = "dflash") -> Iterator[tuple[str, Any]]:
    command = command or typer.main.get_command(cli)
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, f"{path} {name}")


def test_every_summary_is_one_sentence_on_one_line() -> None:
    """The command list shows a docstring's first paragraph with its line breaks: a summary over two
    lines breaks mid-sentence there."""
    broken = []
    for path, command in commands():
        summary = (command.help or "").strip().split("\n\n")[0]
        if "\n" in summary or not summary.endswith("."):
            broken.append(f"{path}: {summary!r}")
    assert broken == []


def test_every_config_argument_names_what_load_config_reads(tmp_path: Path) -> None:
    configs = {
        path: param.help for path, command in commands() for param in command.params if param.name == "config"
    }
    assert (
        len(configs) >= 12
        and {path: text for path, text in configs.items() if CONFIG_FORMS not in text} == {}
    )
    # ... and it reads each of them: a .json file, and a run directory holding its config.json
    config = load_config(ROOT / "configs" / "tiny.toml")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(config.model_dump_json())
    (tmp_path / "config.json").write_text(config.model_dump_json())
    assert load_config(tmp_path / "config.json") == config
    # a run directory is the run at that directory, wherever its config.json says it was written
    as_run = config.model_copy(
        update={"train": config.train.model_copy(update={"output_dir": str(tmp_path / "run")})}
    )
    assert load_config(tmp_path / "run") == as_run


def test_the_data_loaders_info_lines_show_on_standard_error(tmp_path: Path, capsys, monkeypatch) -> None:
    """The data module logs its cache hits and builds at INFO, which Python drops without a handler:
    `dflash` shows them (once each, plain) on standard error."""
    from app.data import dataset

    dflash(capsys, monkeypatch, "status", str(tmp_path / "none"))  # any command: main() sets it up
    dflash(capsys, monkeypatch, "status", str(tmp_path / "none"))  # twice: still one handler
    dataset.log.info("tokenized data: cache hit at %s (%d samples)", tmp_path, 3)
    assert capsys.readouterr().err == f"tokenized data: cache hit at {tmp_path} (3 samples)\n"
