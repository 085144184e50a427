"""The compile cache as a build artifact (docs/architecture.md, Compile cache).

- `apply`: torch.compile applied to the drafter (layers, flex_attention, the loss's CE chunk), main thread;
- `key`: what a cache is keyed on (GPU, torch/CUDA/triton, inductor settings, shapes, code, lock);
- `artifacts`: one entry on disk, `compile_cache/<key>/` (Mega-Cache artifacts, Triton files, manifest);
- `catalog`: the entries compared with this machine and run (trainer, doctor);
- `environment`: persistent, writable inductor/Triton dirs and USER/HOME, set before anything compiles;
- `warmup`: the exact-shape synthetic step that compiles everything, and the baseline timing;
- `guard`: eager-on-CUDA refusal, cache counters, fail_on_recompile, the FX-trace flags, throughput;
- `build`: `dflash build-cache`; `prepare`: `prepare_compiled_training`, what the trainer calls at start.

Submodules are imported directly (`from app.compile.prepare import ...`): importing this package
loads nothing, so the doctor can list caches without loading the model code.
"""
