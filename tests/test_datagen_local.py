"""`app.datagen.local` in-process: the prompt it renders and the length it cuts at, the seed of a
sampled run, the refusals before the target loads, and what a run says and counts (the answers
themselves against the target's greedy decode: tests/test_local_datagen.py)."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from tokenizers import AddedToken
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from app.datagen.local import _model_name, _seed, render_prompt, run_local_datagen
from app.datagen.prompts import load_prompts
from app.errors import UserError
from app.model.target import load_target
from tests.datagen_helpers import quiet_console, write_jsonl
from tests.test_local_datagen import config, rows, write_prompts
from tests.test_speculative import greedy_reference

SYSTEM_AND_USER = {
    "id": "s",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Continue: the"}],
}


def record_of(tmp_path: Path, record: dict):
    (loaded,) = load_prompts([str(write_jsonl(tmp_path / "one.jsonl", [record]))]).records
    return loaded


def test_a_prompt_is_the_chat_template_s_rendering_up_to_the_answer_and_cut_above_the_limit(
    tmp_path: Path, tiny_lm_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    # the template marks its extra arguments: they must reach it
    tokenizer.chat_template += "{{- marker | default('') }}"
    # and this tokenizer adds a first token of its own to what it encodes: the template's text has its
    # special tokens already
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", start)]
    )
    assert tokenizer("x")["input_ids"][0] == start
    record = record_of(tmp_path, SYSTEM_AND_USER)
    text = tokenizer.apply_chat_template(
        SYSTEM_AND_USER["messages"], tokenize=False, add_generation_prompt=True, marker="MARK"
    )
    assert text.endswith("<|im_start|>assistant\nMARK") and "Be brief." in text
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    fits = config(tmp_path, local_max_prompt_tokens=len(expected), chat_template_kwargs={"marker": "MARK"})
    assert render_prompt(record, tokenizer, fits) == expected
    short = config(
        tmp_path, local_max_prompt_tokens=len(expected) - 1, chat_template_kwargs={"marker": "MARK"}
    )
    assert render_prompt(record, tokenizer, short) == (
        f"prompt of {len(expected)} tokens > datagen.local_max_prompt_tokens"
    )
    two = record_of(
        tmp_path,
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ]
        },
    )
    assert (
        render_prompt(two, tokenizer, fits)
        == "the local engine answers one assistant turn; this record has several"
    )


def test_the_seed_is_datagen_seed_and_the_first_pending_record_s_id(tmp_path: Path) -> None:
    record = record_of(tmp_path, SYSTEM_AND_USER)

    def expected(text: str) -> int:
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1

    assert _seed(config(tmp_path, seed=3), record) == expected("3:s")
    assert _seed(config(tmp_path), record) == expected("0:s")
    assert 0 <= _seed(config(tmp_path, seed=3), record) < 2**63


def test_the_model_column_names_the_target(tiny_lm_dir: Path) -> None:
    from app.config import validate_config

    drafter = {"num_layers": 1, "block_size": 4, "mask_token_id": 5}
    named = [
        _model_name(validate_config({"target": target, "drafter": drafter}))
        for target in (
            {"builtin": "tiny-lm"},
            {"architecture": {"model_type": "qwen3"}},
            {"path": str(tiny_lm_dir)},
        )
    ]
    assert named == ["builtin:tiny-lm", "random-weight target", str(tiny_lm_dir)]


@pytest.mark.parametrize(
    ("datagen", "refusal"),
    [
        ({"top_p": 0.99}, "datagen.top_p: the local engine samples from the whole distribution; set it to 1"),
        (
            {"prompts": []},
            "datagen.prompts: no usable prompt records in {tmp_path}/a.jsonl, {tmp_path}/b.jsonl",
        ),
    ],
)
def test_a_refusal_leaves_the_output_directory_alone(tmp_path: Path, datagen: dict, refusal: str) -> None:
    run = config(tmp_path)
    if "prompts" in datagen:
        datagen = {
            "prompts": [
                str(write_jsonl(tmp_path / f"{name}.jsonl", [{"text": "no messages"}])) for name in "ab"
            ]
        }
    with pytest.raises(UserError) as refused:
        run_local_datagen(config(tmp_path, **datagen), quiet_console())
    assert (
        str(refused.value) == refusal.format(tmp_path=tmp_path) and not Path(run.datagen.output_dir).exists()
    )


def test_a_sampled_run_draws_from_datagen_seed_and_its_shortest_prompt_s_id(
    tmp_path: Path, tiny_lm_dir: Path
) -> None:
    """Sampled answers (temperature 1) are the decoder's stream of the prompts, shortest first, seeded
    from `datagen.seed` and the shortest prompt's record id; another seed samples other answers."""
    from app.generate.build import local_decoder
    from app.model.loading import load_tokenizer

    def answers(name: str, seed: int) -> dict[str, str]:
        (tmp_path / name).mkdir()
        run_local_datagen(config(tmp_path / name, temperature=1.0, seed=seed), quiet_console())
        return {row["id"]: row["messages"][-1]["content"] for row in rows(tmp_path / name / "out")}

    sampled, other = answers("a", 3), answers("b", 4)
    assert len(sampled) == 6 and sampled != other

    run = config(tmp_path / "a", temperature=1.0, seed=3)
    tokenizer = load_tokenizer(run)
    records = [r for r in load_prompts(run.datagen.prompts).records if r.id != "multi"]
    ready = sorted(((r.id, render_prompt(r, tokenizer, run)) for r in records), key=lambda p: len(p[1]))
    digest = hashlib.sha256(f"3:{ready[0][0]}".encode()).digest()
    decoder = local_decoder(run, tokenizer, [ids for _, ids in ready], lambda line: None)
    stop_ids = set(decoder.stop_ids.tolist())
    expected = {}
    for index, answer in decoder.stream(
        [ids for _, ids in ready], seed=int.from_bytes(digest[:8], "big") >> 1
    ):
        ended = bool(answer) and answer[-1] in stop_ids
        expected[ready[index][0]] = tokenizer.decode(
            answer[:-1] if ended else answer, skip_special_tokens=True
        ).strip()
    assert sampled == expected


def test_a_run_says_what_it_answers_counts_its_tokens_and_a_rerun_has_nothing_left(
    tmp_path: Path, tiny_lm_dir: Path
) -> None:
    """The record the engine cannot answer comes first: the records after it are answered all the same."""
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    lines = prompts.read_text().splitlines()
    prompts.write_text("\n".join([lines[-1], *lines[:-1]]) + "\n")
    run = config(tmp_path, prompts=[str(prompts)])
    # a terminal's console: the decode line is printed as it is, without highlighting
    console = Console(file=io.StringIO(), force_terminal=True, width=300)
    report = run_local_datagen(run, console)
    log = console.file.getvalue()
    assert (
        "datagen: 6 records to generate (0 already done) with builtin:tiny-lm in this process, "
        "4 rows refilled as answers end"
    ) in log
    (decode,) = [line for line in log.splitlines() if "decode: " in line]
    # (after the progress bar's cursor-show sequence)
    assert "\x1b" not in decode[decode.index("decode: ") :] and "answer tokens in" in decode
    bar = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", log)  # the progress bar without its colours
    assert re.search(r"datagen \S* 6/6 0 failed", bar), bar[-600:]  # it counts the records to answer
    # the counts are the target's greedy answers': every token generated (a stop token too), and
    # the answers cut at max_tokens
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    target = load_target(run, "cpu")
    references = []
    written = rows(tmp_path / "out")
    assert sorted(row["id"] for row in written) == [f"p{i}" for i in range(6)]
    for row in written:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["messages"][0]["content"]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        references.append(greedy_reference(target, ids, 12, tokenizer.eos_token_id))
        user, answer = (message["content"] for message in row["messages"])
        assert row["messages"] == [  # the roles the rendering and the answer give, no reasoning
            {"role": "user", "content": user, "reasoning_content": None},
            {"role": "assistant", "content": answer, "reasoning_content": None},
        ]
        assert row["reasoning_content"] == [None, None]
    stopped = [reference[-1] == tokenizer.eos_token_id for reference in references]
    assert report.completion_tokens == sum(map(len, references))
    assert report.truncated == stopped.count(False) and 0 < report.truncated < 6
    assert (report.done, report.failed) == (6, 1)

    console = quiet_console()
    again = run_local_datagen(run, console)
    assert (again.done, again.failed, again.resumed) == (0, 1, 6)
    assert "datagen: nothing to generate (6 already done)" in console.file.getvalue()


@pytest.mark.parametrize("made", ["special", "stop"])
def test_an_answer_that_decodes_to_nothing_is_a_reject_not_an_empty_record(
    tmp_path: Path, tiny_lm_dir: Path, made: str
) -> None:
    """The tiny target's first answer token of every prompt made a special token of its tokenizer (its
    one-token answers decode, special tokens skipped, to nothing) or a stop token of its generation
    config (the answers end at once, the stop token cut): no training record, each one a reject with
    the reason, for a rerun to retry."""
    from app.model.loading import load_tokenizer

    target_dir = tmp_path / "target"
    shutil.copytree(tiny_lm_dir, target_dir)
    run = config(tmp_path, target={"path": str(target_dir)}, max_tokens=1 if made == "special" else 12)
    tokenizer = load_tokenizer(run)
    target = load_target(run, "cpu")
    records = [r for r in load_prompts(run.datagen.prompts).records if r.id != "multi"]
    firsts = {
        greedy_reference(target, render_prompt(r, tokenizer, run), 1, tokenizer.eos_token_id)[0]
        for r in records
    }
    firsts.discard(tokenizer.eos_token_id)  # a stop token ends an answer empty already
    assert firsts, "the tiny target stops at once on every prompt: no token to make special"
    if made == "special":
        added = [AddedToken(tokenizer.convert_ids_to_tokens(first), special=True) for first in sorted(firsts)]
        tokenizer.add_tokens(added, special_tokens=True)
        assert tokenizer.convert_tokens_to_ids([token.content for token in added]) == sorted(
            firsts
        )  # ids kept
        tokenizer.save_pretrained(target_dir)
    else:
        assert not firsts & set(tokenizer.all_special_ids)  # only the cut keeps them out of the text
        generation = json.loads((target_dir / "generation_config.json").read_text())
        generation["eos_token_id"] = [tokenizer.eos_token_id, *sorted(firsts)]
        (target_dir / "generation_config.json").write_text(json.dumps(generation))

    report = run_local_datagen(run, quiet_console())
    assert (report.done, report.failed) == (0, 7) and not rows(tmp_path / "out")
    rejects = [json.loads(line) for line in (tmp_path / "out" / ".datagen" / "rejects.jsonl").open()]
    assert {reject["id"]: reject["reason"] for reject in rejects if reject["id"] != "multi"} == {
        record.id: "the target answered nothing" for record in records
    }


def test_a_system_prompt_is_rendered_and_kept_in_the_record(tmp_path: Path, tiny_lm_dir: Path) -> None:
    first = json.loads(write_prompts(tmp_path / "prompts.jsonl").read_text().splitlines()[0])
    user = first["messages"][0]  # the tiny target's own kind of prompt: it answers it
    record = {"id": "s", "messages": [{"role": "system", "content": "Be brief."}, user]}
    prompts = write_jsonl(tmp_path / "system.jsonl", [record])
    run_local_datagen(config(tmp_path, prompts=[str(prompts)]), quiet_console())
    (row,) = rows(tmp_path / "out")
    assert [(message["role"], message["content"]) for message in row["messages"][:2]] == [
        ("system", "Be brief."),
        ("user", user["content"]),
    ]
    assert row["messages"][2]["role"] == "assistant" and len(row["messages"]) == 3


def test_without_a_console_the_lines_go_to_stderr_uncut(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    deep = tmp_path / ("a-directory-name-long-enough-to-pass-eighty-columns-" * 2)
    deep.mkdir()
    only_bad = write_jsonl(deep / "bad.jsonl", [{"text": "x"}])
    with pytest.raises(UserError):
        run_local_datagen(config(tmp_path, prompts=[str(only_bad)]))
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "bad.jsonl" in line]
    assert line.startswith(f"  {only_bad}:") and len(line) > 100
