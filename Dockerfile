# The dflash training image: the locked training stack from uv.lock, nothing else (docs/containers.md).
#
#   base (once):    scripts/base-image.sh      Debian bookworm + Python 3.11 made with debootstrap: no
#                                              container registry is needed, only Debian's archive
#   GPU (default):  DOCKER_BUILDKIT=1 docker build -t dflash:latest \
#                     --build-arg REVISION="$(git rev-parse HEAD)" \
#                     --build-arg LOCK_SHA256="$(sha256sum uv.lock | cut -d' ' -f1)" .
#   CPU smoke:      ... --build-arg FAST_KERNELS=0 .
#   causal-conv1d:  ... --build-arg CAUSAL_CONV1D=1 \
#                       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04 \
#                       --build-arg RUNTIME_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 .
#
# The CUDA 12.8 userspace comes from the locked wheels, not the base: torch 2.10.0+cu128 brings cudart,
# cuDNN, cuBLAS and NCCL, and triton its ptxas. Only the driver's libcuda is missing, and the NVIDIA
# container runtime mounts it at run time. So the default base is plain Debian with Python 3.11 (the
# interpreter the lock is resolved for), which every builder can make; `debian:bookworm` from a registry
# works as well. Hybrid targets run their causal conv on flash-linear-attention's Triton kernel. Only the
# optional causal-conv1d variant compiles CUDA code and so needs nvcc: the nvidia/cuda -devel base.
# Bases are pinned by tag; pin a registry base by digest as well for bit-for-bit rebuilds.
ARG BASE_IMAGE=local/bookworm-python:base
ARG RUNTIME_IMAGE=local/bookworm-python:base

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS build

# 1: the Qwen3.5/3.6 hybrid-target kernels (flash-linear-attention from uv group `gpu`; pure Python
# and Triton, nothing compiled here). 0: CPU-only images (smoke tests, laptops): the same recipe without them.
ARG FAST_KERNELS=1
# 1: also causal-conv1d (uv group `causal-conv1d`), compiled against this stage's nvcc (the nvidia/cuda -devel
# base). 0 (default): hybrid targets' conv runs on flash-linear-attention's Triton kernel instead.
ARG CAUSAL_CONV1D=0
# Parallel nvcc jobs for causal-conv1d; lower it if the build runs out of memory.
ARG MAX_JOBS=4
# GPU generations causal-conv1d is compiled for (A100, H100/H200, B200, RTX PRO 6000 / RTX 50): no GPU is
# visible during a build, and without a list torch would compile for every architecture it knows.
ARG TORCH_CUDA_ARCH_LIST="8.0 9.0 10.0 12.0"
# Installed from PyPI (the one registry every builder can reach). With a container registry at hand,
# `COPY --from=ghcr.io/astral-sh/uv:0.13.9@sha256:<digest> /uv /usr/local/bin/uv` does the same.
ARG UV_VERSION=0.13.9

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
# A mistyped variant must fail here, not build an image silently without its kernels.
RUN case "$FAST_KERNELS/$CAUSAL_CONV1D" in \
        0/0 | 1/0 | 1/1) ;; \
        *) echo "FAST_KERNELS must be 0 or 1 and CAUSAL_CONV1D 0 or 1 (1 only with FAST_KERNELS=1)," \
                "not FAST_KERNELS='$FAST_KERNELS' CAUSAL_CONV1D='$CAUSAL_CONV1D'" >&2; exit 1 ;; \
    esac; \
    if [ "$CAUSAL_CONV1D" = 1 ] && ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then \
        echo "CAUSAL_CONV1D=1 compiles CUDA code: build on a base with nvcc (BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04)" >&2; \
        exit 1; \
    fi
# hadolint ignore=DL3008
RUN if [ "$CAUSAL_CONV1D" = 1 ]; then set -- python3-dev g++; fi; \
    apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates "$@" \
    && rm -rf /var/lib/apt/lists/*

# Downloads trust the builder's CA when it passes one (`--secret id=ca,src=$SSL_CERT_FILE`, e.g. behind a
# TLS-inspecting proxy); without the secret the image's own bundle is used. The CA is never baked in.
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=secret,id=ca,target=/etc/ssl/certs/ca-certificates.crt \
    python3 -m venv /opt/uv-installer \
    && /opt/uv-installer/bin/pip install --no-cache-dir "uv==${UV_VERSION}" \
    && install -m 0755 /opt/uv-installer/bin/uv /usr/local/bin/uv \
    && rm -rf /opt/uv-installer

# Byte-compiled at install (no first-start compile, read-only site-packages is fine); copied rather than
# hard-linked out of the cache mount; the system interpreter (the runtime stage has the same one).
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON=/usr/bin/python3 \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/app/.venv \
    MAX_JOBS=${MAX_JOBS} \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}
WORKDIR /app

# Dependencies first: this layer changes only when uv.lock does, not on every code edit.
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,source=uv.lock,target=uv.lock \
    --mount=type=bind,source=pyproject.toml,target=pyproject.toml \
    --mount=type=secret,id=ca,target=/etc/ssl/certs/ca-certificates.crt \
    if [ "$FAST_KERNELS" = 1 ]; then set -- --group gpu; fi; \
    if [ "$CAUSAL_CONV1D" = 1 ]; then set -- "$@" --group causal-conv1d; fi; \
    uv sync --locked --no-install-project --no-default-groups "$@"

# Then the project, as a wheel the runtime stage installs on top of the dependencies.
COPY pyproject.toml uv.lock README.md /app/
COPY app /app/app
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=secret,id=ca,target=/etc/ssl/certs/ca-certificates.crt \
    uv build --wheel --out-dir /dist

# ---------------------------------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE} AS runtime

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
# gcc/g++ and the Python headers are runtime needs, not build leftovers: Triton compiles its kernel
# launchers with them and inductor's CPU backend compiles C++. tini forwards SIGTERM to torchrun.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc g++ tini ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The run user takes uid 1000 so bind mounts made by the usual first host user are writable (the
# nvidia/cuda Ubuntu bases ship a uid-1000 `ubuntu` user, which goes).
ARG APP_UID=1000
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && groupadd --gid "${APP_UID}" dflash \
    && useradd --create-home --uid "${APP_UID}" --gid "${APP_UID}" --shell /bin/bash dflash \
    && mkdir -p /app/runs /app/data /data /checkpoints /models \
    && chown dflash:dflash /app/runs /app/data /data /checkpoints

# Compiled kernels go under HOME, never /tmp (a /tmp cleanup once destroyed 353 MB of them).
ENV HOME=/home/dflash \
    USER=dflash \
    PATH=/app/.venv/bin:${PATH} \
    VIRTUAL_ENV=/app/.venv \
    PYTHONUNBUFFERED=1 \
    DFLASH_CACHE=/home/dflash/.cache/dflash \
    TORCHINDUCTOR_CACHE_DIR=/home/dflash/.cache/dflash/inductor \
    TRITON_CACHE_DIR=/home/dflash/.cache/dflash/triton
WORKDIR /app

COPY --from=build /app/.venv /app/.venv
# The project on its own layer: a code change rebuilds this small layer, not a copy of the whole venv.
RUN --mount=type=bind,from=build,source=/dist,target=/dist \
    --mount=type=bind,from=build,source=/usr/local/bin/uv,target=/usr/local/bin/uv \
    uv pip install --python /app/.venv/bin/python --no-deps --no-index --no-cache --compile-bytecode /dist/*.whl
# `dflash doctor` finds the project (and uv.lock, which it checks every installed package against) here.
COPY pyproject.toml uv.lock README.md /app/
COPY configs /app/configs
COPY scripts/container-smoke.sh /app/scripts/container-smoke.sh
COPY entrypoint.sh /app/entrypoint.sh
# Fail the build, not the first run, when the venv does not work on this base (e.g. another Python).
RUN python -c "import torch, transformers, app.cli" \
    && mkdir -p "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR" \
    && chown -R dflash:dflash /home/dflash

USER ${APP_UID}:${APP_UID}
ENTRYPOINT ["tini", "--", "/app/entrypoint.sh"]
CMD ["doctor"]

# Last: the compile cache built on the target hardware (`docker compose run build-cache`), so a new
# cache re-bakes only this layer.
COPY compile_cache /app/compile_cache

# Provenance last: these change with every commit, and an ARG declared earlier would re-run every RUN
# after it (build args are part of a RUN's cache key).
ARG REVISION=unknown
ARG LOCK_SHA256=unknown
ARG SOURCE_URL=unknown
ARG FAST_KERNELS=1
ARG CAUSAL_CONV1D=0
ARG BASE_IMAGE
ARG RUNTIME_IMAGE
LABEL org.opencontainers.image.title="dflash-appliance" \
      org.opencontainers.image.description="Reproducible DFlash drafter training: the locked uv.lock stack" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${RUNTIME_IMAGE}" \
      dflash.uv-lock.sha256="${LOCK_SHA256}" \
      dflash.fast-kernels="${FAST_KERNELS}" \
      dflash.causal-conv1d="${CAUSAL_CONV1D}"
ENV DFLASH_IMAGE_REVISION=${REVISION}
