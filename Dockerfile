# syntax=docker/dockerfile:1
# pagedserve server image.
#   GPU (default):  docker build -t pagedserve:0.1.0 .
#   CPU variant:    docker build --build-arg VARIANT=cpu -t pagedserve:0.1.0-cpu .
# The server reads the model from /mnt/models (where KServe's storage initializer puts it) and serves
# gRPC on 8001 and HTTP (/metrics, health, KServe v2 REST) on 8000.
ARG VARIANT=cuda

# The CUDA version of the base follows torch's: the PyPI torch==2.13.0 wheel is built with CUDA 13.0
# (it requires cuda-toolkit==13.0.3). The base's NVIDIA_REQUIRE_CUDA then makes the NVIDIA runtime
# refuse a node whose driver is too old for it (CUDA 13.0 needs driver >= 580), and its cuda-compat
# libraries are the ones torch can use, instead of a 12.x base that starts where torch finds no GPU.
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04 AS base-cuda
FROM ubuntu:24.04 AS base-cpu

# The base is one of the two stages above, picked by VARIANT; both are pinned there.
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG VARIANT

# Compilers at run time: Triton builds its GPU launcher with the system C compiler and Python
# headers (CUDA variant); on CPU, torch.compile's inductor builds the fused forward pass with the
# C++ compiler (without one the server runs eagerly, slower). Versions follow the base image.
# tini runs as PID 1 (see ENTRYPOINT).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev libc6-dev tini \
 && if [ "$VARIANT" = cuda ]; then apt-get install -y --no-install-recommends gcc; \
    else apt-get install -y --no-install-recommends g++; fi \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/venv

# torch first, pinned: on the CPU variant from the CPU index, so installing pagedserve below does not
# pull a multi-GB CUDA build; the default PyPI build bundles its own CUDA libraries.
RUN if [ "$VARIANT" = cpu ]; then \
      pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0; \
    else \
      pip install --no-cache-dir torch==2.13.0; \
    fi

# The package itself, non-editable, from a read-write bind mount of the build context (build
# leftovers stay out of the image). The OTLP exporters make --otlp-traces-endpoint work, over either
# protocol OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names (grpc, http/protobuf).
RUN --mount=type=bind,target=/src,rw \
    pip install --no-cache-dir /src \
      opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2

# Non-root, group 0 with group-writable home, so arbitrary-uid platforms (OpenShift) work too.
ENV HOME=/home/pagedserve \
    PAGEDSERVE_MODEL=/mnt/models
RUN useradd --uid 10001 --gid 0 --create-home --home-dir /home/pagedserve pagedserve \
 && mkdir -p /mnt/models \
 && chown 10001:0 /mnt/models \
 && chmod -R g=u /home/pagedserve /mnt/models
USER 10001
WORKDIR /home/pagedserve

EXPOSE 8001 8000
# tini is PID 1 and forwards SIGTERM to the server. The kernel drops signals to a PID 1 that has no
# handler for them, and the server has none while Python starts: as PID 1 itself, a pod deleted
# in that moment would lose the SIGTERM and wait out the grace period.
# tini also reaps orphaned subprocesses (compiler and worker processes).
ENTRYPOINT ["/usr/bin/tini", "--", "pagedserve", "serve"]
CMD ["--model", "/mnt/models", "--port", "8001", "--http-port", "8000"]
