"""The mask token's string, `dflash_config.mask_token`, read from the target's tokenizer.

Why the export writes it besides `mask_token_id`: SGLang resolves the mask token from this string.
Its first DFlash builds read only the string (default `<|MASK|>`) and looked it up in the target's
tokenizer, adding it as a new token when absent; its releases from 0.5.11 on take `mask_token_id` but
refuse to start when the string (or that default) is a token of the tokenizer with another id. A
config without the string is therefore served with the wrong mask row, or not at all, whenever the
target's tokenizer holds `<|MASK|>` elsewhere. The string is taken from the tokenizer and checked to
read back as the same id, so what an engine resolves is the row the drafter was trained with.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import UserError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

ENGINE_MASK_TOKEN = "<|MASK|>"
"""The string SGLang (`DEFAULT_DFLASH_MASK_TOKEN`) and the reference DFlash demo add to a tokenizer that
has no such token: it lands on the tokenizer's next free id (Qwen3's 151669, one past its 151669 tokens)."""


def mask_token_string(tokenizer: PreTrainedTokenizerBase, mask_token_id: int) -> str:
    """The token `mask_token_id` names in `tokenizer`, checked to map back to that id.

    An id one past the tokenizer's last token is the row an engine's added `<|MASK|>` takes, so that
    string is returned for it (checked by adding it to a copy). Any other id without a token, or a
    token that reads back as another id, is refused: an engine resolving the string would embed
    another row than the one the drafter was trained with.
    """
    source = " ".join(filter(None, [tokenizer.name_or_path, f"({len(tokenizer)} tokens)"]))
    token = _token_of(tokenizer, mask_token_id)
    if token is None and mask_token_id == len(tokenizer):
        return _added_mask_token(tokenizer, mask_token_id, source)
    if token is None:
        raise UserError(
            f"export: drafter.mask_token_id {mask_token_id} is no token of the target's tokenizer {source}, "
            f"nor its next free id {len(tokenizer)} where engines add {ENGINE_MASK_TOKEN!r}: SGLang builds "
            "that resolve the mask token by its string would embed another row; train with a mask token "
            "id the tokenizer has"
        )
    back = tokenizer.convert_tokens_to_ids(token)
    if back != mask_token_id:
        raise UserError(
            f"export: drafter.mask_token_id {mask_token_id} is {token!r} in the target's tokenizer {source}, "
            f"but {token!r} reads back as id {back}: SGLang would refuse it or embed row {back}; train with "
            "a mask token id whose token is unique"
        )
    return token


def tokenizer_beside(target: PretrainedConfig) -> PreTrainedTokenizerBase:
    """The tokenizer in the directory the target's config was loaded from (`name_or_path`): what an
    export without an explicit tokenizer uses, as the demo's export of a loaded target does."""
    from transformers import AutoTokenizer

    directory = getattr(target, "name_or_path", "") or ""
    if not directory or not Path(directory).is_dir():
        raise UserError(
            "export: dflash_config.mask_token needs the target's tokenizer: pass tokenizer= (the target "
            f"config names no local directory to load one from: name_or_path {directory!r})"
        )
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UserError(
            f"export: dflash_config.mask_token needs the target's tokenizer, and {directory} has none "
            f"({str(error).splitlines()[0]}): pass tokenizer="
        ) from None


def _token_of(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str | None:
    """The token string of `token_id`, None where the tokenizer has none (out of range, a gap)."""
    try:
        token = tokenizer.convert_ids_to_tokens(token_id)
    except (IndexError, KeyError, ValueError, OverflowError):  # slow tokenizers raise past their end
        return None
    return token if isinstance(token, str) and token else None


def _added_mask_token(tokenizer: PreTrainedTokenizerBase, mask_token_id: int, source: str) -> str:
    """`<|MASK|>` for the next free id, after adding it to a copy of the tokenizer as SGLang does."""
    present = tokenizer.get_vocab().get(ENGINE_MASK_TOKEN)
    if present is not None:
        raise UserError(
            f"export: drafter.mask_token_id {mask_token_id} is the next free id of the target's tokenizer "
            f"{source}, but {ENGINE_MASK_TOKEN!r} is already its id {present}: SGLang would refuse the export"
        )
    probe = copy.deepcopy(tokenizer)
    probe.add_special_tokens({"mask_token": ENGINE_MASK_TOKEN})
    added = probe.convert_tokens_to_ids(ENGINE_MASK_TOKEN)
    if added != mask_token_id:
        raise UserError(
            f"export: adding {ENGINE_MASK_TOKEN!r} to the target's tokenizer {source} gives id {added}, "
            f"not drafter.mask_token_id {mask_token_id}: an engine that adds it would embed another row"
        )
    return ENGINE_MASK_TOKEN
