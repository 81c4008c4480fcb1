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
# (COPY sources exist, extras exist in pyproject.toml, non-root user, targets present, layer order).
#
# Every Python package comes from uv.lock, by version and hash: requirements/*.txt are exported from it
# (scripts/export-requirements; `make lint` fails when they drift), installed with --require-hashes --no-deps,
# and the phalanx wheel is installed last with --no-index, which fails if the lock lacked anything it needs.
#
# Layer order: what changes least comes first. Both targets start from `runtime` (the Python base, the user);
# `train` then installs torch in a layer of its own that depends on nothing of this repository but the lock's
# torch pins (requirements/torch.txt), so a change to src/, pyproject.toml or any other pin rebuilds the small
# layers above it and never the 4+ GB torch layer. The phalanx wheel comes last in both targets.
#
# Build arguments:
#   PYTHON_IMAGE        the base: a Debian- or Ubuntu-based image with CPython 3.11 or later as `python`, and
#                       pip, on PATH (default: the public slim image, exact tag). scripts/images passes one
#                       built with debootstrap, no registry. The lock's pins have wheels for 3.11 to 3.13.
#   TORCH_FROM          `index` (default): requirements/torch.txt from the package index; `wheels`: the same
#                       files from a folder, offline (`pip install --no-index --find-links`), given as the
#                       build context `torch-wheels`:
#                         docker buildx build --build-context torch-wheels=/path/to/wheels \
#                             --build-arg TORCH_FROM=wheels --target train .
#                       (buildah bud takes the same --build-context flag.) The folder is bind-mounted into that
#                       one RUN step: the wheels never land in a layer.
#   TORCH_INDEX_URL     a PyTorch wheel index (e.g. https://download.pytorch.org/whl/cu128) for a CUDA build
#                       other than the package index's: torch, numpy and safetensors at the lock's versions
#                       from there, their CUDA libraries as that index pins them (outside the lock).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- torch-wheels: empty; `--build-context torch-wheels=<folder>` replaces it (TORCH_FROM=wheels).
FROM scratch AS torch-wheels

# ---- wheel: build the phalanx wheel once; the runtime stages install it and never see the source tree.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler, and Python's headers where the base lacks them (a distribution's python3.N: Debian's, Ubuntu's),
# for phalanx._ringwrite: the interval recorder's write path in C, built for this Python's ABI (hatch_build.py).
# In this stage only: the images get the built wheel.
RUN set -eux; \
    pkgs="gcc libc6-dev"; \
    python -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
        || pkgs="${pkgs} libpython$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev"; \
    apt-get update -qq; \
    apt-get install -y -qq --no-install-recommends ${pkgs} >/dev/null; \
    rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The build backend at the lock's version (pip's build isolation would take the newest hatchling).
COPY requirements/build.txt /tmp/build.txt
RUN pip install --require-hashes --no-deps -r /tmp/build.txt
COPY pyproject.toml README.md hatch_build.py ./
COPY src ./src
# Without the extension the wheel would be pure Python (the build only warns): an image must not be.
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
    && if ls /wheels/*-none-any.whl >/dev/null 2>&1; then echo "the wheel lacks phalanx._ringwrite" >&2; exit 1; fi

# ---- runtime: what both targets share, and nothing of this repository.
FROM ${PYTHON_IMAGE} AS runtime
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# A fixed numeric uid so Pod securityContexts can say runAsNonRoot + runAsUser without guessing.
RUN groupadd --system --gid 10001 phalanx \
    && useradd --system --uid 10001 --gid phalanx --home-dir /home/phalanx --create-home phalanx

# ---- base: the operator and every job's master.
FROM runtime AS base
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="phalanx" \
      org.opencontainers.image.description="Keeps PyTorch training jobs alive through failures: operator and master." \
      org.opencontainers.image.source="https://github.com/phalanx-dev/phalanx" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
# The dependencies first (they change with uv.lock only), then the wheel (changes with every edit).
COPY requirements/base.txt /tmp/requirements.txt
RUN pip install --require-hashes --no-deps -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY --from=wheel /wheels /tmp/wheels
# The wheel's file name carries its version; the glob keeps this line free of it.
RUN set -eux; \
    wheel="$(ls /tmp/wheels/phalanx-*.whl)"; \
    pip install --no-index "${wheel}[operator]"; \
    cp "${wheel}" /opt/; \
    rm -rf /tmp/wheels
USER 10001:10001
WORKDIR /home/phalanx
ENTRYPOINT ["phalanx"]
CMD ["--help"]

# ---- torch: the heavy layer of `train`, before anything of this repository but the lock's torch pins.
FROM runtime AS torch
ARG TORCH_FROM=index
ARG TORCH_INDEX_URL=""
COPY requirements/torch.txt /tmp/torch.txt
RUN --mount=type=bind,from=torch-wheels,target=/tmp/torch-wheels \
    set -eux; \
    case "${TORCH_FROM}" in \
        wheels) pip install --no-index --find-links /tmp/torch-wheels --require-hashes --no-deps -r /tmp/torch.txt ;; \
        index) if [ -n "${TORCH_INDEX_URL}" ]; then \
                   grep -E '^(torch|numpy|safetensors)==' /tmp/torch.txt | sed 's/ *\\$//' > /tmp/pins.txt; \
                   pip install --extra-index-url "${TORCH_INDEX_URL}" -r /tmp/pins.txt; \
               else \
                   pip install --require-hashes --no-deps -r /tmp/torch.txt; \
               fi ;; \
        *) echo "TORCH_FROM must be index or wheels, not ${TORCH_FROM}" >&2; exit 2 ;; \
    esac; \
    rm -f /tmp/torch.txt /tmp/pins.txt

# ---- train: workers. phalanx-run supervises the training processes, which import torch.
# The same install as `base` (its dependencies, then the wheel with the `operator` extra), plus torch below it.
FROM torch AS train
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="phalanx-train" \
      org.opencontainers.image.description="phalanx worker image: phalanx-run and PyTorch." \
      org.opencontainers.image.source="https://github.com/phalanx-dev/phalanx" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
# InfiniBand and RoCE: NCCL opens libibverbs and its device providers (mlx5, efa, ...) at run time and, when
# it cannot, falls back to TCP sockets without a word: the cluster's fabric unused while NCCL_IB_HCA is set.
# rdma-core's libraries (Debian's libibverbs1, ibverbs-providers, librdmacm1), not its daemons: the devices
# come from the node (the RDMA device plugin), the libraries from the image.
RUN set -eux; \
    apt-get update -qq; \
    apt-get install -y -qq --no-install-recommends libibverbs1 ibverbs-providers librdmacm1 >/dev/null; \
    rm -rf /var/lib/apt/lists/*
# Everything else of the lock's `operator`, `train` and `s3` extras (torch's closure is the layer below).
COPY requirements/train.txt /tmp/requirements.txt
RUN pip install --require-hashes --no-deps -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY --from=wheel /wheels /tmp/wheels
# torch is already there (the layer above satisfies the `train` extra), so this adds phalanx only.
RUN set -eux; \
    wheel="$(ls /tmp/wheels/phalanx-*.whl)"; \
    pip install --no-index "${wheel}[operator,train,s3]"; \
    cp "${wheel}" /opt/; \
    rm -rf /tmp/wheels
# Same entrypoint as base: worker Pods name `phalanx-run` in their command, and `phalanx local` (which
# starts workers itself) needs torch, so this image is also the one to try phalanx on one machine.
USER 10001:10001
WORKDIR /home/phalanx
ENTRYPOINT ["phalanx"]
CMD ["--help"]
