# The compose tests' CPU stand-in for the SGLang server: our CPU image plus the dev group, which carries
# `transformers serve` (a real OpenAI-compatible server). Test-only; never the training image.
ARG BUILD_IMAGE=dflash:cpu-build
ARG RUNTIME_IMAGE=dflash:cpu

FROM ${BUILD_IMAGE} AS build
RUN uv export --locked --only-group dev --no-emit-project --format requirements-txt -o /dev-requirements.txt

FROM ${RUNTIME_IMAGE}
USER 0
RUN --mount=type=bind,from=build,source=/dev-requirements.txt,target=/tmp/dev-requirements.txt \
    --mount=type=bind,from=build,source=/usr/local/bin/uv,target=/usr/local/bin/uv \
    --mount=type=cache,target=/root/.cache/uv \
    --mount=type=secret,id=ca,target=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    uv pip install --python /app/.venv/bin/python -r /tmp/dev-requirements.txt
USER 1000:1000
