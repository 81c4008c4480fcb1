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
# Layer order: what changes least comes first. Both targets start from `runtime` (the Python base, the user);
# `train` then installs torch in a layer of its own that depends on nothing of this repository (only on the
# base image and TORCH_REQUIREMENTS), so a change to src/ or pyproject.toml rebuilds the small layers above it
# and never the 4+ GB torch layer. The phalanx wheel comes last in both targets.
#
# Build arguments:
#   PYTHON_IMAGE        the base: a Debian-based image with python3.11 and pip on PATH (default: the public
#                       slim image, exact tag). scripts/images passes one built with debootstrap, no registry.
#   TORCH_REQUIREMENTS  what the torch layer installs (default: the `train` extra's torch, numpy, safetensors
#                       ranges; scripts/images pins the versions of the tested venv).
#   TORCH_FROM          `index` (default): from the package index (TORCH_INDEX_URL picks a PyTorch wheel index
#                       for a CUDA build); `wheels`: from a folder of wheels, offline (`pip install --no-index
#                       --find-links`), given as the build context `torch-wheels`:
#                         docker buildx build --build-context torch-wheels=/path/to/wheels \
#                             --build-arg TORCH_FROM=wheels --target train .
#                       (buildah bud takes the same --build-context flag.) The folder is bind-mounted into that
#                       one RUN step: the wheels never land in a layer.
#   PIP_CONSTRAINTS     pins (`name==version ...`) for everything pip installs above torch (default: none, pip
#                       resolves); scripts/images passes the project venv's versions, so the images run what
#                       the tests ran.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- torch-wheels: empty; `--build-context torch-wheels=<folder>` replaces it (TORCH_FROM=wheels).
FROM scratch AS torch-wheels

# ---- wheel: build the phalanx wheel once; the runtime stages install it and never see the source tree.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler, and Python's headers where the base lacks them (Debian's python3.11), for phalanx._ringwrite:
# the interval recorder's write path in C (hatch_build.py). In this stage only: the images get the built wheel.
RUN set -eux; \
    pkgs="gcc libc6-dev"; \
    python -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
        || pkgs="${pkgs} libpython3.11-dev"; \
    apt-get update -qq; \
    apt-get install -y -qq --no-install-recommends ${pkgs} >/dev/null; \
    rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md hatch_build.py ./
COPY src ./src
# Without the extension the wheel would be pure Python (the build only warns): an image must not be.
RUN pip wheel --no-deps --wheel-dir /wheels . \
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
# The dependencies first (they change with pyproject.toml only), then the wheel (changes with every edit).
ARG PIP_CONSTRAINTS=""
COPY pyproject.toml /tmp/phalanx-pyproject.toml
RUN printf '%s\n' ${PIP_CONSTRAINTS} > /tmp/constraints.txt \
    && python -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]; \
print("\n".join(p["dependencies"] + [r for e in sys.argv[2:] for r in p["optional-dependencies"][e]]))' \
        /tmp/phalanx-pyproject.toml operator > /tmp/requirements.txt \
    && pip install -c /tmp/constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt /tmp/phalanx-pyproject.toml
COPY --from=wheel /wheels /tmp/wheels
# The wheel's file name carries its version; the glob keeps this line free of it.
RUN set -eux; \
    wheel="$(ls /tmp/wheels/phalanx-*.whl)"; \
    pip install -c /tmp/constraints.txt "${wheel}[operator]"; \
    cp "${wheel}" /opt/; \
    rm -rf /tmp/wheels /tmp/constraints.txt
USER 10001:10001
WORKDIR /home/phalanx
ENTRYPOINT ["phalanx"]
CMD ["--help"]

# ---- torch: the heavy layer of `train`, before anything of this repository.
FROM runtime AS torch
ARG TORCH_REQUIREMENTS="torch>=2.15,<2.16 numpy>=1.26 safetensors>=0.4"
ARG TORCH_FROM=index
# Point at a PyTorch wheel index (e.g. https://download.pytorch.org/whl/cu128) to pick the CUDA build.
ARG TORCH_INDEX_URL=""
RUN --mount=type=bind,from=torch-wheels,target=/tmp/torch-wheels \
    set -eux; \
    case "${TORCH_FROM}" in \
        wheels) pip install --no-index --find-links /tmp/torch-wheels ${TORCH_REQUIREMENTS} ;; \
        index) if [ -n "${TORCH_INDEX_URL}" ]; then \
                   pip install --extra-index-url "${TORCH_INDEX_URL}" ${TORCH_REQUIREMENTS}; \
               else \
                   pip install ${TORCH_REQUIREMENTS}; \
               fi ;; \
        *) echo "TORCH_FROM must be index or wheels, not ${TORCH_FROM}" >&2; exit 2 ;; \
    esac

# ---- train: workers. phalanx-run supervises the training processes, which import torch.
# The same install as `base` (its dependencies, then the wheel with the `operator` extra), plus torch below it.
FROM torch AS train
ARG VERSION=0.1.0
ARG TORCH_INDEX_URL=""
LABEL org.opencontainers.image.title="phalanx-train" \
      org.opencontainers.image.description="phalanx worker image: phalanx-run and PyTorch." \
      org.opencontainers.image.source="https://github.com/phalanx-dev/phalanx" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
ARG PIP_CONSTRAINTS=""
COPY pyproject.toml /tmp/phalanx-pyproject.toml
RUN printf '%s\n' ${PIP_CONSTRAINTS} > /tmp/constraints.txt \
    && python -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]; \
print("\n".join(p["dependencies"] + [r for e in sys.argv[2:] for r in p["optional-dependencies"][e]]))' \
        /tmp/phalanx-pyproject.toml operator train s3 > /tmp/requirements.txt \
    && pip install -c /tmp/constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt /tmp/phalanx-pyproject.toml
COPY --from=wheel /wheels /tmp/wheels
# torch is already there (the layer above satisfies the `train` extra), so this adds phalanx only.
RUN set -eux; \
    wheel="$(ls /tmp/wheels/phalanx-*.whl)"; \
    if [ -n "${TORCH_INDEX_URL}" ]; then \
        pip install -c /tmp/constraints.txt --extra-index-url "${TORCH_INDEX_URL}" "${wheel}[operator,train,s3]"; \
    else \
        pip install -c /tmp/constraints.txt "${wheel}[operator,train,s3]"; \
    fi; \
    cp "${wheel}" /opt/; \
    rm -rf /tmp/wheels /tmp/constraints.txt
# Same entrypoint as base: worker Pods name `phalanx-run` in their command, and `phalanx local` (which
# starts workers itself) needs torch, so this image is also the one to try phalanx on one machine.
USER 10001:10001
WORKDIR /home/phalanx
ENTRYPOINT ["phalanx"]
CMD ["--help"]
