"""Run config: files, overrides, one-line errors naming the key, cross-field rules."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from app.config import ConfigError, default_gamma, default_target_layer_ids, load_config
from tests.helpers import dflash, run_dflash

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))

MINIMAL = """
[target]
builtin = "tiny-lm"

[drafter]
mask_token_id = 3
"""


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid(path: Path) -> None:
    config = load_config(path)
    assert config.data.token_budget % 128 == 0


def test_production_config_matches_the_incident() -> None:
    config = load_config(ROOT / "configs" / "qwen3.6-27b.toml")
    assert config.drafter.target_layer_ids == [1, 16, 31, 46, 61]
    assert (config.train.anchors, config.drafter.block_size) == (1024, 32)
    assert (config.data.token_budget, config.data.max_batch_size) == (49152, 64)
    assert config.drafter.mask_token_id == 248070
    assert (config.topology.target_ranks, config.topology.drafter_ranks) == (5, 3)
    assert config.train.precision == "bf16" and config.train.epochs == 6
    # the published Qwen3.6-27B DFlash drafter layout, so a run can start from a published drafter
    drafter = config.drafter
    assert (drafter.num_attention_heads, drafter.num_key_value_heads, drafter.head_dim) == (32, 8, 128)
    assert drafter.intermediate_size == 17408
    assert (drafter.sliding_window, drafter.sliding_window_layers) == (2048, [0, 1, 2, 3])


def test_defaults_are_the_documented_ones(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL))
    assert config.train.epochs == 6 and config.train.precision == "bf16"
    assert config.train.max_steps is None  # no early stopping
    assert config.topology.target_ranks == 0  # colocated


def test_yaml_config(tmp_path: Path) -> None:
    path = write(
        tmp_path, "target: {builtin: tiny-lm}\ndrafter: {mask_token_id: 3, block_size: 8}\n", "run.yaml"
    )
    assert load_config(path).drafter.block_size == 8


def test_unknown_key_suggests_close_match(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "\n[train]\nepoch = 2\n")
    with pytest.raises(ConfigError, match=r"run\.toml: unknown key 'train\.epoch'; did you mean 'epochs'\?"):
        load_config(path)


def test_unknown_section_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'trian'; did you mean 'train'"):
        load_config(write(tmp_path, MINIMAL + "\n[trian]\nlr = 1\n"))


def test_wrong_type_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run\.toml: train\.epochs: must be an integer, got 'six'"):
        load_config(write(tmp_path, MINIMAL + '\n[train]\nepochs = "six"\n'))


def test_bound_violation_reads_like_the_rule(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.lr: must be > 0(\.0)?, got -1$"):
        load_config(write(tmp_path, MINIMAL), ["train.lr=-1"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["drafter.block_size=1"], r"drafter\.block_size: must be >= 2, got 1"),
        (["train.anchors=0"], r"train\.anchors: must be >= 1, got 0"),
        (["data.token_budget=1000"], r"data\.token_budget: must be a multiple of 128, got 1000"),
        (["drafter.target_layer_ids=[1, 9]"], r"drafter\.target_layer_ids: must be in \[0, 6\) .* got \[9\]"),
        (["drafter.mask_token_id=4096"], r"drafter\.mask_token_id: must be a row of the target embedding"),
        (
            ["topology.target_ranks=5", "topology.drafter_ranks=3"],
            r"target_ranks \+ drafter_ranks must equal",
        ),
        (["target.path=/models/x"], r"exactly one of target\.path, target\.builtin, target\.architecture"),
        (
            ["train.anchors=4096", "data.token_budget=2048", "data.max_length=512"],
            r"train\.anchors: must be <=",
        ),
        (
            ["drafter.block_size=16", "data.max_length=16", "data.token_budget=128", "train.anchors=16"],
            r"^.*: drafter\.block_size: a training sample needs 2 x block_size = 32 supervised tokens, more "
            r"than data\.max_length \(16\) holds; got block_size 16$",
        ),
    ],
)
def test_cross_field_rules(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, MINIMAL), overrides)


def test_overrides_are_typed(tmp_path: Path) -> None:
    config = load_config(
        write(tmp_path, MINIMAL),
        ["train.lr=1e-4", "train.epochs=2", "drafter.target_layer_ids=[1,2]", "train.output_dir=runs/x",
         "compile.fail_on_recompile=false", "topology.nproc_per_node=2", "topology.drafter_ranks=2"],
    )  # fmt: skip
    assert config.train.lr == 1e-4 and config.train.epochs == 2
    assert config.drafter.target_layer_ids == [1, 2]
    assert config.train.output_dir == "runs/x"
    assert config.compile.fail_on_recompile is False


def test_override_into_a_mapping_field(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL), ["data.chat_template_kwargs.enable_thinking=true"])
    assert config.data.chat_template_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize("override", ["train.lr", "=3", "nosuch.field=1", "train.nosuch=1"])
def test_bad_overrides_are_rejected(tmp_path: Path, override: str) -> None:
    with pytest.raises(ConfigError, match=r"override"):
        load_config(write(tmp_path, MINIMAL), [override])


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: config file not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_config(write(tmp_path, "[target\nbuiltin=", "bad.toml"))
    with pytest.raises(
        ConfigError, match=r"expected a \.toml, \.yaml, \.yml or \.json config file, or a run directory"
    ):
        load_config(write(tmp_path, MINIMAL, "run.ini"))
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML: .* \(line 4, column 1\)"):
        load_config(write(tmp_path, "target:\n  builtin: tiny-lm\ndrafter: [a, {b\n", "bad.yaml"))
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON: Expecting .* \(line 1, column 12\)"):
        load_config(write(tmp_path, '{"target": }', "bad.json"))
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"[target]\nbuiltin = 'tiny-lm'\n# caf\xe9\n")
    with pytest.raises(
        ConfigError,
        match=r"^.*latin1\.toml: not UTF-8 text: byte b'\\xe9' at line 3, column 6 \(invalid continuation "
        r"byte\); save the file as UTF-8$",
    ):
        load_config(latin1)


@pytest.mark.parametrize(
    ("override", "files"),
    [
        ("data.train_files=a.jsonl", ["a.jsonl"]),
        ("data.train_files=a.jsonl,b.jsonl", ["a.jsonl", "b.jsonl"]),
        ("data.train_files=[a.jsonl, b.jsonl]", ["a.jsonl", "b.jsonl"]),
        ("data.train_files=['a.jsonl']", ["a.jsonl"]),
    ],
)
def test_list_overrides_take_what_a_shell_user_types(tmp_path: Path, override: str, files: list[str]) -> None:
    assert load_config(write(tmp_path, MINIMAL), [override]).data.train_files == files
    ids = load_config(write(tmp_path, MINIMAL), ["drafter.target_layer_ids=1,2"]).drafter.target_layer_ids
    assert ids == [1, 2]  # an Optional list too, its items typed


@pytest.mark.parametrize("override", ["data.train_files=[unclosed", "data.train_files=a.jsonl]"])
def test_a_list_override_with_unbalanced_brackets_is_refused(tmp_path: Path, override: str) -> None:
    """Not read as a file named `unclosed` (the shell user dropped the bracket, or quoting ate it)."""
    with pytest.raises(
        ConfigError,
        match=rf"^override {re.escape(repr(override))}: data\.train_files: a list with unbalanced brackets",
    ):
        load_config(write(tmp_path, MINIMAL), [override])


def test_a_bad_override_value_names_the_override_not_the_file(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^override 'train\.lr=fast': train\.lr: must be a number, got 'fast'$"
    ):
        load_config(write(tmp_path, MINIMAL), ["train.epochs=2", "train.lr=fast"])
    with pytest.raises(ConfigError, match=r"run\.toml: train\.lr: must be > 0"):
        load_config(write(tmp_path, MINIMAL + "[train]\nlr = -1\n"), ["train.epochs=2"])


def test_a_run_directory_is_a_config(tmp_path: Path) -> None:
    """What a run writes as config.json trains, resumes or evaluates as is (after `dflash pull` on
    another machine, the original TOML and overrides are not needed)."""
    original = load_config(
        write(tmp_path, MINIMAL), ["train.lr=1e-4", f"train.output_dir={tmp_path / 'run'}"]
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(original.model_dump_json())
    assert load_config(run_dir) == original
    copied = tmp_path / "copy"
    shutil.copytree(run_dir, copied)  # a copy (or a move) is the run where it is now
    assert load_config(copied).train.output_dir == str(copied)
    assert load_config(copied, [f"train.output_dir={run_dir}"]).train.output_dir == str(run_dir)
    assert load_config(run_dir / "config.json", ["train.lr=2e-4"]).train.lr == 2e-4
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty: a directory without config\.json, so not a run directory"):
        load_config(tmp_path / "empty")


def test_target_path_shape_is_checked_from_its_config_json(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        '{"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 8, "vocab_size": 500}}'
    )
    text = f'[target]\npath = "{model_dir}"\n[drafter]\nmask_token_id = 3\ntarget_layer_ids = [1, 8]\n'
    with pytest.raises(ConfigError, match=r"must be in \[0, 8\) for a 8-layer target, got \[8\]"):
        load_config(write(tmp_path, text))


def test_default_layer_ids_and_gamma() -> None:
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(6, 1) == [1]
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert 10 <= default_gamma(32) <= 14


def test_cli_config_show_and_exit_codes(tmp_path: Path) -> None:
    shown = run_dflash("config", "show", "configs/tiny.toml", "train.lr=0.5")
    assert shown.returncode == 0, shown.stderr
    assert "[train]" in shown.stdout and "lr = 0.5" in shown.stdout
    # the defaults derived from the target (tiny-lm: 6 layers, 4/2 heads of 32, FFN 384) and block 8
    for line in ("target_layer_ids = [1, 3]", "num_attention_heads = 4", "num_key_value_heads = 2",
                 "head_dim = 32", "intermediate_size = 384", "gamma = 4.0"):  # fmt: skip
        assert line in shown.stdout.splitlines(), line

    elsewhere = run_dflash("config", "show", "configs/qwen3.6-27b.toml")  # its target is not on this machine
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert "target_layer_ids = [1, 16, 31, 46, 61]" in elsewhere.stdout  # set in the file
    assert "num_attention_heads = 32" in elsewhere.stdout  # the published drafter layout, set in the file
    assert "# rope_theta: unset" in elsewhere.stdout  # from the target, which is not here
    assert elsewhere.stderr.startswith("# defaults derived from the target left unset: target.path:")

    bad = run_dflash("config", "show", "configs/tiny.toml", "train.lr=-1")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "dflash: error: override 'train.lr=-1': train.lr: must be > 0.0, got -1"
    ]

    usage = run_dflash("config", "show")
    assert usage.returncode == 2


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        (
            "configs/tiny.toml",
            ["train.lr=0.5", 'data.chat_template_kwargs={think=false, say="a\\"b", t=1.5e-7}'],
        ),
        ("configs/qwen3.6-27b.toml", []),  # its target is not here: the derived settings stay unset
        (
            "configs/tiny.toml",
            ['telemetry.run_name="run \U0001f680 \x7f"'],
        ),  # TOML escapes neither as JSON does
        ("configs/tiny.toml", ["telemetry.run_name=2026-12-04"]),  # a string field takes the text, not a date
    ],
)
def test_config_show_prints_a_config_train_accepts_as_it_is(
    capsys, monkeypatch, tmp_path: Path, config: str, overrides: list[str]
) -> None:
    """The shown TOML, saved, loads (as `dflash train` loads it) to the config shown: no null, every
    value as it was, the derived defaults included."""
    shown = dflash(capsys, monkeypatch, "config", "show", config, *overrides)
    assert shown.returncode == 0, shown.stderr
    assert "null" not in shown.stdout
    saved = tmp_path / "shown.toml"
    saved.write_text(shown.stdout)
    resolved = json.loads(dflash(capsys, monkeypatch, "config", "show", "--json", config, *overrides).stdout)
    assert load_config(saved).model_dump(mode="json") == resolved
    assert dflash(capsys, monkeypatch, "config", "show", str(saved)).stdout == shown.stdout


def test_cli_prints_its_version() -> None:
    done = run_dflash("--version")
    assert done.returncode == 0 and done.stdout.strip() == "dflash 0.1.0"


def test_cli_config_schema_documents_every_field() -> None:
    from app.config.schema import RunConfig

    result = run_dflash("config", "schema", "--json")
    assert result.returncode == 0
    assert '"token_budget"' in result.stdout
    for section in RunConfig.model_fields.values():
        for name, field in section.annotation.model_fields.items():  # type: ignore[union-attr]
            assert field.description, f"{section.annotation.__name__}.{name} has no docstring"


def test_cli_config_schema_shows_the_values_a_field_takes() -> None:
    """Allowed values of a Literal, `| null` of an Optional, and item types, as a user writes them."""
    text = run_dflash("config", "schema").stdout
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in text.splitlines()
        if line.count("│") >= 4
    }
    assert rows["precision"] == '"bf16" | "fp32"'
    assert rows["format"] == '"auto" | "messages" | "sharegpt"'
    assert rows["target_layer_ids"] == "list[int] | null"
    assert rows["betas"] == "tuple[float, float]"
    assert rows["max_steps"] == "int | null"


def test_misleading_inputs_get_one_line_naming_the_file_or_field(
    tiny_lm_dir, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Each through `dflash train`, exit 2: a config without a target names the ways to set one; a
    target.path that is not there says so before a tokenizer loader reads it as a hub repo id; a .json
    data file that is not JSON says where it stops being JSON (not "no messages column among []")."""
    no_target = write(tmp_path, "[drafter]\nmask_token_id = 3\n", "no-target.toml")
    missing = tmp_path / "models" / "Qwen3-8B"
    no_model = write(
        tmp_path, f'[target]\npath = "{missing}"\n[drafter]\nmask_token_id = 3\n[train]\ndevice = "cpu"\n'
        f'output_dir = "{tmp_path / "run"}"\n', "no-model.toml",
    )  # fmt: skip
    not_json = write(
        tmp_path,
        '[\n  {"messages": [{"role": "user", "content": "hi"}]\n  {"messages": []}\n]\n',
        "data.json",
    )
    cases = [
        (
            [str(no_target)],
            f"{no_target}: target: is required: set target.path (a local Hugging Face model directory), "
            'target.builtin ("tiny-lm", the CPU demo\'s, or "smollm2-135m-instruct", a real 135M chat model) '
            "or target.architecture (a Hugging Face config, for a random-weight target)",
        ),
        (
            [str(no_model)],
            f"target.path: {missing} does not exist (expected a local Hugging Face model directory)",
        ),
        (
            ["configs/tiny.toml", f"data.train_files={not_json}", f"train.output_dir={tmp_path / 'run2'}"],
            f"{not_json}: not valid JSON: Expecting ',' delimiter (line 3, column 3)",
        ),
    ]
    for args, message in cases:
        done = dflash(capsys, monkeypatch, "train", *args)
        assert (done.returncode, done.stderr.splitlines()[-1:]) == (2, [f"dflash: error: {message}"])
        assert "Traceback" not in done.stderr and "Failed to load JSON" not in done.stderr


def test_the_one_gpu_benchmark_configs_keep_the_production_drafter_and_shapes():
    """The H200 benchmark configs stand in for the production run on one GPU (a random-weight target,
    cut to fit): their drafter layout and step shapes are the production config's, so a benchmark
    measures what production trains (the 16-layer one once lacked the sliding window, and its step
    was compared with the peer's sliding-window time)."""
    production = load_config("configs/qwen3.6-27b.toml")
    bench = load_config("configs/qwen3.6-27b-16l-h200.toml")
    layout = production.drafter.model_dump(exclude={"target_layer_ids"})
    assert bench.drafter.model_dump(exclude={"target_layer_ids"}) == layout
    shapes = {"data": {"max_length", "token_budget", "max_batch_size", "lengths_per_octave"}}
    shapes["train"] = {"anchors", "gamma", "precision", "loss_chunk_size"}
    for section, fields in shapes.items():
        expected = getattr(production, section).model_dump(include=fields)
        assert getattr(bench, section).model_dump(include=fields) == expected, section
