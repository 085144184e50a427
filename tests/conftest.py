import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.datagen_server import ScriptedServer, TransformersServe, build_tiny_chat_model

# Directories a fresh machine has: the system's own, nothing installed by hand (/usr/local, ~/.local,
# pyenv, cargo). Tools found only elsewhere (a hand-installed `uv`, say) are not assumed to exist.
SYSTEM_PATH = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
# Drivers and engines a machine provides rather than the project: the GPU driver's nvidia-smi (the GPU
# tier) and the Docker client (the image tier installs it itself, scripts/image-smoke.sh).
MACHINE_TOOLS = ("nvidia-smi", "docker", "docker-compose")


def pytest_configure(config):
    """Run the suite, and every process it starts, with the PATH of a fresh machine plus the project's
    own venv: a test that calls a tool the project does not install fails here on every machine, not
    only on a clean one (bare `uv` was such a tool: `./uvw` keeps it in .tools/)."""
    original = os.environ.get("PATH", "")
    machine = [
        os.path.dirname(found) for tool in MACHINE_TOOLS if (found := shutil.which(tool, path=original))
    ]
    keep = [str(Path(sys.executable).parent), *SYSTEM_PATH, *machine]
    os.environ["PATH"] = os.pathsep.join(dict.fromkeys(keep))


# --- data pipeline fixtures: the tiny tokenizer, built once per session (self-contained) ---


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """Directory of the tiny BPE tokenizer with its Qwen3-style chat template (built in ~0.3 s)."""
    from app.model.tiny_tokenizer import build_tokenizer, corpus_paragraphs, save_tokenizer

    directory = tmp_path_factory.mktemp("tiny-tokenizer") / "tokenizer"
    save_tokenizer(build_tokenizer(2048, corpus_paragraphs()), directory)
    return directory


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    """The tiny tokenizer loaded from `tiny_tokenizer_dir`, as a trainer would load a target's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


# --- trainer fixtures: the built-in tiny-lm target and conversations in its chat format ---


@pytest.fixture(scope="session")
def tiny_lm_dir(pytestconfig):
    """The built-in `tiny-lm` target (trained once per machine, cached under ~/.cache/dflash). Its
    first build's progress lines reach the terminal past pytest's capture: a minute of silence on a
    fresh machine would look like a hang."""
    from app.model.tiny_lm import ensure_tiny_lm

    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    writer = pytestconfig.get_terminal_writer()

    def progress(message: str) -> None:
        with capture.global_and_fixture_disabled():
            writer.line(f"\n{message}")

    return ensure_tiny_lm(progress=progress)


@pytest.fixture(scope="session")
def tiny_conversations(tmp_path_factory):
    """A jsonl of conversations in the tiny target's chat format (OpenAI `messages` records)."""
    import json

    from app.model.tiny_lm import chat_sample
    from app.model.tiny_tokenizer import corpus_paragraphs

    path = tmp_path_factory.mktemp("conversations") / "train.jsonl"
    with open(path, "w") as handle:
        for paragraph in corpus_paragraphs():
            if len(paragraph.split()) >= 24:
                handle.write(json.dumps({"messages": chat_sample(paragraph)}) + "\n")
    return path


@pytest.fixture
def persistent_tmp():
    """A scratch directory outside /tmp, removed afterwards: the compile cache refuses kernel dirs under
    /tmp (cleanups delete them there)."""
    import tempfile

    from app.paths import cache_root

    root = cache_root() / "tests"
    root.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="scratch-", dir=root))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def compile_dirs_kept_to_their_test() -> Iterator[None]:
    """A start exports the inductor and Triton dirs it picks (`use_compile_dirs`): set in this process
    by one test, they would pass to every later test's child processes, which would then find kernels
    an earlier test compiled there (a baked cache that could not be read looked complete that way)."""
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def no_ambient_wandb_settings(monkeypatch):
    """A machine's own WANDB_* variables (CI sets WANDB_MODE) must not change what the tests see."""
    import os

    for name in [name for name in os.environ if name.startswith("WANDB_")]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def accumulation_reference(tiny_lm_dir, tiny_conversations, tmp_path_factory) -> Path:
    """The colocated single-process trainer accumulating 2 batches per step for KILL_RUN_STEPS steps,
    a checkpoint at every step: what 2 drafters on one node, or 1 drafter on any number of nodes,
    accumulating 1 or 2 batches each, must train bit for bit (tests/test_distributed.py,
    tests/test_multinode.py)."""
    from app.config import load_config
    from app.train.trainer import Trainer
    from tests.helpers import SMALL
    from tests.jobs import CONFIG, KILL_RUN_STEPS, one_thread

    run_dir = tmp_path_factory.mktemp("reference")
    config = load_config(
        CONFIG,
        [*SMALL, f"data.train_files=['{tiny_conversations}']", f"train.output_dir={run_dir}",
         f"train.max_steps={KILL_RUN_STEPS}", "train.grad_accum=2", "train.save_every=1", "train.keep_last=100"],
    )  # fmt: skip
    one_thread(lambda: Trainer(config, log=lambda line: None).run())
    return run_dir


# --- datagen servers: the real OpenAI-compatible one (once per session) and the scripted one ---


@pytest.fixture(scope="session")
def serve(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Iterator[TransformersServe]:
    """The real server, up for the whole session (about 10-15 s to start on 2 cores)."""
    root = tmp_path_factory.mktemp("datagen-serve")
    server = TransformersServe(build_tiny_chat_model(root / "model", tiny_tokenizer_dir), root / "serve.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    server = ScriptedServer().start()
    yield server
    server.stop()
