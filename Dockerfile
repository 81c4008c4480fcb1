# syntax=docker/dockerfile:1
# phalanx images, one Dockerfile, two targets:
#
#   docker build --target base  -t ghcr.io/phalanx-dev/phalanx:0.1.0 .        operator + job masters (no torch)
#   docker build --target train -t ghcr.io/phalanx-dev/phalanx-train:0.1.0 .  workers (phalanx-run) + torch;
#                                                                              a base for users' training images
#
# The master and the operator never import torch (DESIGN.md §2), so their image stays small and starts fast.
# Both need the Kubernetes client (the master keeps its state in the ElasticJob's ConfigMap), hence the
# `operator` extra in `base`. The static checks in tests/shipping/test_dockerfile.py keep this file honest
# (COPY sources exist, extras exist in pyproject.toml, non-root user, targets present).

ARG PYTHON_IMAGE=python:3.11-slim

# ---- wheel: build the phalanx wheel once; the runtime stages install it and never see the source tree.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- base: the operator and every job's master.
FROM ${PYTHON_IMAGE} AS base
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="phalanx" \
      org.opencontainers.image.description="Keeps PyTorch training jobs alive through failures: operator and master." \
      org.opencontainers.image.source="https://github.com/phalanx-dev/phalanx" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=wheel /wheels /tmp/wheels
# The wheel's file name carries its version; the glob keeps this line free of it.
RUN set -eux; \
    wheel="$(ls /tmp/wheels/phalanx-*.whl)"; \
    pip install "${wheel}[operator]"; \
    cp "${wheel}" /opt/; \
    rm -rf /tmp/wheels
# A fixed numeric uid so Pod securityContexts can say runAsNonRoot + runAsUser without guessing.
RUN groupadd --system --gid 10001 phalanx \
    && useradd --system --uid 10001 --gid phalanx --home-dir /home/phalanx --create-home phalanx
USER 10001:10001
WORKDIR /home/phalanx
ENTRYPOINT ["phalanx"]
CMD ["--help"]

# ---- train: workers. phalanx-run supervises the training processes, which import torch.
FROM base AS train
ARG VERSION=0.1.0
# Point at a PyTorch wheel index (e.g. https://download.pytorch.org/whl/cu128) to pick the CUDA build.
ARG TORCH_INDEX_URL=""
LABEL org.opencontainers.image.title="phalanx-train" \
      org.opencontainers.image.description="phalanx worker image: phalanx-run and PyTorch." \
      org.opencontainers.image.version="${VERSION}"
USER root
RUN set -eux; \
    wheel="$(ls /opt/phalanx-*.whl)"; \
    if [ -n "${TORCH_INDEX_URL}" ]; then \
        pip install --extra-index-url "${TORCH_INDEX_URL}" "${wheel}[train,s3]"; \
    else \
        pip install "${wheel}[train,s3]"; \
    fi
# Same entrypoint as base: worker Pods name `phalanx-run` in their command, and `phalanx local` (which
# starts workers itself) needs torch, so this image is also the one to try phalanx on one machine.
USER 10001:10001
