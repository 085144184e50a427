"""Properties of the hand-written config text handling, over generated inputs (hypothesis): what
`dflash config show` writes loads back to the same config, and a dotted override of a string setting
is that text, whatever TOML would read in it."""

from __future__ import annotations

import tomllib

from hypothesis import given, settings
from hypothesis import strategies as st

from app.config import load_config, validate_config
from app.config.toml_text import config_toml
from tests.helpers import ROOT

TINY = ROOT / "configs" / "tiny.toml"
BASE = load_config(TINY)
names = st.text(min_size=1, max_size=40)  # any code point but a surrogate: emoji, DEL, NUL, quotes
paths = st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(run_name=names, files=paths, lr=st.floats(min_value=1e-12, max_value=10, allow_subnormal=False))
def test_the_shown_toml_loads_back_to_the_config(run_name: str, files: list[str], lr: float) -> None:
    config = BASE.model_copy(
        update={
            "telemetry": BASE.telemetry.model_copy(update={"run_name": run_name}),
            "data": BASE.data.model_copy(update={"train_files": files}),
            "train": BASE.train.model_copy(update={"lr": lr}),
        }
    )
    text = config_toml(config.model_dump(mode="json"))
    assert validate_config(tomllib.loads(text)) == config


# text as typed after `name=`: not quoted (quotes are TOML's way to write a string) nor padded (the
# override is stripped)
typed = names.filter(lambda text: text == text.strip() and text[0] not in "\"'")


@settings(max_examples=150, deadline=None)
@given(run_name=typed)
def test_a_string_setting_s_override_is_its_text(run_name: str) -> None:
    assert load_config(TINY, [f"telemetry.run_name={run_name}"]).telemetry.run_name == run_name


def test_a_number_setting_still_reads_toml_and_a_literal_its_text() -> None:
    config = load_config(TINY, ["train.lr=2e-4", "train.objective=ce+tv", "telemetry.run_name=12"])
    assert (config.train.lr, config.train.objective, config.telemetry.run_name) == (2e-4, "ce+tv", "12")
