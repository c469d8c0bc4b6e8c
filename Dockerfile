# syntax=docker/dockerfile:1
# GPU image (default):  docker build -t specserve .
# CPU image:            docker build -t specserve:cpu --build-arg BASE_IMAGE=debian:bookworm-slim \
#                         --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
# Behind a proxy that re-signs TLS: add --secret id=ca,src=/path/to/ca-bundle.crt (pip uses it
# during the build; it is never stored in the image). scripts/image_check.sh builds and runs it.
ARG BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu124

# -- build: a virtual environment with torch and specserve ------------------------------------
FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && apt-get clean && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir "torch>=2.4,<2.15" --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY server /src/server
COPY training /src/training
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && pip install --no-cache-dir /src

# -- runtime: the environment, the configs, a non-root user ----------------------------------
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev g++ curl ca-certificates \
    && apt-get clean && rm -rf /var/lib/apt/lists/*
# g++ and the Python headers: the C++ CPU kernels (engine/kernels/csrc), compiled below into
# the user's ~/.cache/specserve/kernels, are compiled again at start where that cache is not
# there (another user or HOME)
COPY --from=build /opt/venv /opt/venv
COPY configs /etc/specserve
RUN useradd --create-home --uid 10001 specserve \
    && mkdir -p /models && chown specserve:specserve /models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPECSERVE_MODEL_CACHE=/models \
    HF_HOME=/models/hf
USER specserve
# The CPU kernels at build time (~3 min here, not at every new container's start): compiled with
# explicit -m<feature> flags, never -march=native, so they run on any CPU that has the features;
# at start each is loaded only where the CPU has them (torch's ops elsewhere)
RUN python -m engine.kernels.cpu_ext
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=900s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["specserve", "serve"]
CMD ["--config", "/etc/specserve/default.yaml", "--host", "0.0.0.0", "--port", "8000", \
     "--fetch-missing"]
