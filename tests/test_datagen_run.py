"""`app.datagen.run`, the regeneration run both engines share, in this process with a scripted server:
its event lines, the accounting of its report, and its commits."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from app.datagen import run_datagen
from tests.datagen_helpers import make_config, rejects, user_prompts, write_jsonl
from tests.datagen_server import ScriptedServer


def test_a_server_error_in_markup_syntax_is_logged_as_it_is(scripted: ScriptedServer, tmp_path: Path) -> None:
    """A server's error body is text, not rich markup: a chat template's `[/INST]` in it once stopped the
    run with rich's MarkupError when the server left the rotation, and `[bold]` vanished from the line."""
    records = [*user_prompts(1), {"messages": [{"role": "user", "content": "templated500 please"}]}]
    prompts = write_jsonl(tmp_path / "p.jsonl", records)
    log = io.StringIO()
    report = run_datagen(
        make_config(prompts, tmp_path / "out", [scripted.url], max_retries=2), Console(file=log, width=400)
    )
    assert (report.done, report.failed) == (1, 1)
    body = "<s>[INST] templated500 [/INST] failed: [bold]out of memory[/bold]"
    left = f"datagen: server {scripted.url} leaves the rotation: {scripted.url}: HTTP 500: {body}"
    assert left in log.getvalue().splitlines()
    assert body in rejects(tmp_path / "out")[0]["reason"]
