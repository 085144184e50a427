"""`dflash datagen` across its lifecycle: stopped by a signal or a closed terminal and resumed, a
changed config refused on a rerun, one run per output dir, and its output trained on by `dflash train`."""

from __future__ import annotations

import json
import os
import pty
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from app.datagen import run_datagen
from app.datagen.store import OutputDirBusy, ShardStore
from app.errors import UserError
from tests.datagen_helpers import (
    DFLASH,
    FAST,
    REPO,
    assert_complete,
    default_hangup,
    make_config,
    output_rows,
    quiet_console,
    snapshot,
    start_cli,
    user_prompts,
    wait_for,
    write_jsonl,
    write_run_config,
)
from tests.datagen_server import ScriptedServer, TransformersServe


def slow_generation(tmp_path: Path, records: int) -> tuple[ScriptedServer, Path, Path, Path]:
    """A started server answering in 50 ms, `records` prompts and a run config of 2 workers, one shard:
    a run long enough to be interrupted. Returns (server, prompts, output dir, config file)."""
    server = ScriptedServer(delay_s=0.05).start()
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(records))
    output = tmp_path / "out"
    config = write_run_config(
        tmp_path / "run.toml",
        {"prompts": [str(prompts)], "output_dir": str(output), "servers": [server.url], "concurrency": 2,
         "shard_size": 1000, **FAST},
    )  # fmt: skip
    return server, prompts, output, config


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_commits_completed_records_and_the_resume_command_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, stop: signal.Signals
) -> None:
    """SIGTERM (docker stop) and SIGHUP (the terminal closed) alike: exit 128 + the signal, every
    finished record committed, and the printed resume command finishes the rest."""
    from app.cli import main

    server, prompts, output, config = slow_generation(tmp_path, 30)
    try:
        run = start_cli(config)
        wait_for(lambda: len(server.requests) >= 8, 60, "eight requests")
        answered = server.answered
        run.send_signal(stop)
        stdout, _ = run.communicate(timeout=30)
        assert run.returncode == 128 + stop, stdout
        assert f"stopped by {stop.name}" in stdout and f"to resume: dflash datagen {config}" in stdout
        committed = output_rows(output)
        assert_complete(committed, prompts)
        # every answer the run had before the hangup is kept; one per worker may still have been on its way
        assert answered - 2 <= len(committed) <= len(server.requests)
        assert f"done {len(committed)} + failed 0 + skipped 0 + unfinished {30 - len(committed)}" in stdout

        resume = shlex.split(stdout.split("datagen: to resume: ")[1].splitlines()[0])
        monkeypatch.setattr(sys, "argv", resume)  # in this process: one interpreter start less
        main()  # returns on exit status 0, raises SystemExit on any other
    finally:
        server.stop()
    resumed = capsys.readouterr().out
    assert f"done {30 - len(committed)} + failed 0 + skipped {len(committed)} == input 30" in resumed
    rows = output_rows(output)
    assert len(rows) == 30 and rows[: len(committed)] == committed
    assert_complete(rows, prompts)


def test_closing_the_terminal_commits_completed_records(tmp_path: Path) -> None:
    """The run's terminal goes away: the kernel sends SIGHUP and every later write fails (EIO)."""
    server, prompts, output, config = slow_generation(tmp_path, 30)
    # a session of its own whose controlling terminal is the pty, as a shell in a terminal window has
    as_session_leader = "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.argv[1], sys.argv[1:])"
    window, tty = pty.openpty()
    try:
        run = subprocess.Popen(
            [sys.executable, "-c", as_session_leader, str(DFLASH), "datagen", str(config)],
            cwd=REPO, stdin=tty, stdout=tty, stderr=tty, start_new_session=True, preexec_fn=default_hangup,
        )  # fmt: skip
        os.close(tty)
        # unread, the window fills no buffer: the run writes only a few KiB before it is closed
        wait_for(lambda: len(server.requests) >= 8, 60, "eight requests")
        answered = server.answered
        os.close(window)
        assert run.wait(timeout=30) == 129
    finally:
        server.stop()
    committed = output_rows(output)
    assert_complete(committed, prompts)
    assert answered - 2 <= len(committed) <= len(server.requests)


def test_an_ignored_sighup_does_not_stop_the_run(tmp_path: Path) -> None:
    """Under nohup a closed terminal must not stop the run: the ignored SIGHUP stays ignored."""
    server = ScriptedServer(delay_s=0.05).start()
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(16))
    config = make_config(prompts, tmp_path / "out", [server.url], concurrency=2)

    def hang_up() -> None:
        wait_for(lambda: len(server.requests) >= 4, 60, "four requests")
        os.kill(os.getpid(), signal.SIGHUP)

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup leaves to the run
    hangup = threading.Thread(target=hang_up)
    try:
        hangup.start()
        report = run_datagen(config, quiet_console())
        hangup.join()
    finally:
        signal.signal(signal.SIGHUP, previous)
        server.stop()
    assert (report.stopped_by, report.done, report.exit_code) == (None, 16, 0)
    assert_complete(output_rows(tmp_path / "out"), prompts)


def test_changed_settings_are_refused_when_every_record_is_done(
    scripted: ScriptedServer, tmp_path: Path
) -> None:
    from app.config import load_config

    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(3))
    output = tmp_path / "out"
    config = write_run_config(
        tmp_path / "run.toml",
        {"prompts": [str(prompts)], "output_dir": str(output), "servers": [scripted.url], "max_tokens": 8, **FAST},
    )  # fmt: skip
    assert run_datagen(load_config(config).datagen, quiet_console()).done == 3
    before = snapshot(output)

    rerun = subprocess.run(
        [str(DFLASH), "datagen", str(config), "datagen.temperature=0.7"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert rerun.returncode == 2, rerun.stdout + rerun.stderr
    (line,) = rerun.stderr.splitlines()
    assert line == (
        f"dflash: error: datagen.output_dir: {output} holds records made with other settings "
        "(temperature 0.0 -> 0.7); use a new datagen.output_dir to generate with the new settings, "
        "or restore the old ones"
    )
    assert snapshot(output) == before
    for override, change in [
        ("datagen.max_tokens=16", "max_tokens 8 -> 16"),
        ('datagen.model="other-model"', "model 'scripted-model' -> 'other-model'"),
        ("datagen.reasoning='drop'", "reasoning 'keep' -> 'drop'"),
    ]:
        with pytest.raises(UserError, match=re.escape(f"other settings ({change})")):
            run_datagen(load_config(config, [override]).datagen, quiet_console())
        assert snapshot(output) == before
    assert len(scripted.requests) == 3  # the refused reruns asked nothing
    unchanged = run_datagen(load_config(config).datagen, quiet_console())
    assert (unchanged.resumed, unchanged.done, unchanged.exit_code) == (3, 0, 0)


def test_changed_sampling_settings_are_refused(scripted: ScriptedServer, tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(2))
    output = tmp_path / "out"
    assert run_datagen(make_config(prompts, output, [scripted.url]), quiet_console()).done == 2
    write_jsonl(prompts, user_prompts(3))
    with pytest.raises(UserError, match=r"other settings \(temperature 0.0 -> 0.7\)"):
        run_datagen(make_config(prompts, output, [scripted.url], temperature=0.7), quiet_console())
    again = run_datagen(make_config(prompts, output, [scripted.url]), quiet_console())
    assert (again.done, again.resumed) == (1, 2)


# Each setting the records of an output directory share, changed alone, and how the refusal names it.
SETTING_CHANGES = {
    "temperature": (0.7, "temperature 0.0 -> 0.7"),
    "top_p": (0.9, "top_p 1.0 -> 0.9"),
    "max_tokens": (16, "max_tokens 8 -> 16"),
    "seed": (5, "seed None -> 5"),
    "reasoning": ("drop", "reasoning 'keep' -> 'drop'"),
    "chat_template_kwargs": (
        {"enable_thinking": True},
        "chat_template_kwargs {} -> {'enable_thinking': True}",
    ),
    "model": ("other-model", "model 'scripted-model' -> 'other-model'"),
}


@pytest.fixture(scope="module")
def finished_output(tmp_path_factory: pytest.TempPathFactory):
    """A server and an output directory whose every record is done (one run for all the keys)."""
    server = ScriptedServer().start()
    root = tmp_path_factory.mktemp("settings")
    prompts = write_jsonl(root / "p.jsonl", user_prompts(2))
    assert run_datagen(make_config(prompts, root / "out", [server.url]), quiet_console()).done == 2
    yield server, prompts, root / "out"
    server.stop()


@pytest.mark.parametrize("key", SETTING_CHANGES)
def test_a_rerun_with_any_one_setting_changed_is_refused(finished_output, key: str) -> None:
    """The seed too: records sampled from other seeds are other data, as much as another temperature."""
    server, prompts, output = finished_output
    recorded = json.loads((output / ".datagen" / "manifest.json").read_text())
    assert set(recorded) == set(SETTING_CHANGES)  # a new setting needs its row above
    before, asked = snapshot(output), len(server.requests)
    value, change = SETTING_CHANGES[key]
    with pytest.raises(UserError, match=re.escape(f"other settings ({change})")):
        run_datagen(make_config(prompts, output, [server.url], **{key: value}), quiet_console())
    assert snapshot(output) == before and len(server.requests) == asked


def test_one_run_per_output_dir(tmp_path: Path) -> None:
    holder = ShardStore(tmp_path / "out")
    holder.open()
    try:
        # the holder is named: here this very process, from a second store of the same directory
        expected = (
            f"being written by another dflash datagen run (pid {os.getpid()} on {socket.gethostname()} ("
        )
        with pytest.raises(OutputDirBusy, match=re.escape(expected)):
            ShardStore(tmp_path / "out").open()
    finally:
        holder.close()


def test_regenerated_data_trains_with_dflash_train(
    serve: TransformersServe, tiny_lm_dir, tmp_path: Path
) -> None:
    """datagen's output directory is valid `data.train_files` input: `dflash train` runs on it as is."""
    from app.config import load_config
    from app.train.trainer import Trainer

    prompts = [
        {"messages": [{"role": "user", "content": f"Tell me about module number {i}."}]} for i in range(12)
    ]
    output = tmp_path / "regenerated"
    report = run_datagen(
        make_config(
            write_jsonl(tmp_path / "p.jsonl", prompts), output, [serve.url], max_tokens=24, shard_size=5
        ),
        quiet_console(),
    )
    assert report.done == 12

    root = Path(__file__).resolve().parents[1]
    overrides = [
        f"data.train_files=['{output}']", f"train.output_dir={tmp_path / 'run'}", "data.eval_holdout=2",
        "drafter.num_layers=1", "drafter.block_size=4", "data.token_budget=256", "data.max_length=256",
        "train.anchors=16", "train.max_steps=2", "train.eval_every=0", "telemetry.log_every=1",
    ]  # fmt: skip
    trainer = Trainer(load_config(root / "configs" / "tiny.toml", overrides), log=lambda line: None)
    # every regenerated record is usable training data (2 of them held out for eval)
    assert trainer.train_data.summary.kept == 12 and len(trainer.train_data) == 10
    result = trainer.run()
    assert result.steps == 2 and all(loss == loss for loss in result.losses)
