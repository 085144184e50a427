"""Generation by the frozen target in this process (docs/architecture.md, Generation).

- `transformers_internals`: the private transformers state the decoder relies on, in one place;
- `attention`: a decode step's attention (query heads packed per KV head, the ring's blocks in use);
- `step`: the decoder's shape and its one decode step over a ring of cache slots;
- `decoder`: continuous batching through that step (`BatchDecoder`), `generate` for other targets;
- `build`: the one place a decoder is made, compiled (datagen, bench decode) or eager (eval).
"""
