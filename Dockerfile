# syntax=docker/dockerfile:1
# GPU image (default):  docker build -t specserve .
# CPU image:            docker build -t specserve:cpu --build-arg BASE_IMAGE=ubuntu:22.04 \
#                         --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
ARG BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu124

# -- build: a virtual environment with torch and specserve ------------------------------------
FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir "torch>=2.4,<2.15" --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY server /src/server
COPY training /src/training
RUN pip install --no-cache-dir /src

# -- runtime: the environment, the configs, a non-root user ----------------------------------
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ curl \
       ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# g++ and the Python headers: the C++ CPU kernels (engine/kernels/csrc) are compiled at the
# first start, for the CPU they run on, into the user's ~/.cache/specserve/kernels
COPY --from=build /opt/venv /opt/venv
COPY configs /etc/specserve
RUN useradd --create-home --uid 10001 specserve \
    && mkdir -p /models && chown specserve:specserve /models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPECSERVE_MODEL_CACHE=/models \
    HF_HOME=/models/hf
USER specserve
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=900s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["specserve", "serve"]
CMD ["--config", "/etc/specserve/default.yaml", "--host", "0.0.0.0", "--port", "8000", \
     "--fetch-missing"]
