# syntax=docker/dockerfile:1
# pagedserve server image.
#   GPU (default):  docker build -t pagedserve:0.1.0 .
#   CPU variant:    docker build --build-arg VARIANT=cpu -t pagedserve:0.1.0-cpu .
# The server reads the model from /mnt/models (where KServe's storage initializer puts it) and serves
# gRPC on 8001 and HTTP (/metrics, health, KServe v2 REST) on 8000.
ARG VARIANT=cuda

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-cuda
FROM ubuntu:24.04 AS base-cpu

# The base is one of the two stages above, picked by VARIANT; both are pinned there.
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG VARIANT

# Compilers at run time: Triton builds its GPU launcher with the system C compiler and Python
# headers (CUDA variant); on CPU, torch.compile's inductor builds the fused forward pass with the
# C++ compiler (without one the server runs eagerly, slower). Versions follow the base image.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev libc6-dev \
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
# leftovers stay out of the image). The OTLP exporter makes --otlp-traces-endpoint work.
RUN --mount=type=bind,target=/src,rw \
    pip install --no-cache-dir /src opentelemetry-exporter-otlp-proto-grpc==1.45.2

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
ENTRYPOINT ["pagedserve", "serve"]
CMD ["--model", "/mnt/models", "--port", "8001", "--http-port", "8000"]
