"""dflash appliance: train DFlash speculative-decoding drafters reproducibly."""

import os

# Triton keeps the autotuning result of a library kernel (flash-linear-attention's, per input shape)
# in memory only, unless this is set before the library is imported: then it lands in the Triton
# cache, where build-cache bakes it and the library-JIT watch sees a new one appear.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
