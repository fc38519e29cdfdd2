# The loraplane image: one image for the control plane, the operator and the data plane (the
# chart runs `loraplane controlplane|operator`, a ServingPool's pods `loraplane serve`).
#
#   docker build -t ghcr.io/loraplane/loraplane:0.1.0 .
#       target full (the default): every component, torch for CPU, the native CPU LoRA kernel
#       prebuilt for x86-64-v4, -v3 and baseline CPUs (each pod loads the best its CPU runs)
#   docker build --target slim -t ghcr.io/loraplane/loraplane:0.1.0-slim .
#       control plane and operator only: no torch, no kernel (under 400 MB)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       -t ghcr.io/loraplane/loraplane:0.1.0-cuda .
#       the data plane on NVIDIA GPUs: torch's CUDA wheels bring their CUDA runtime, so the
#       base stays python:3.11-slim (TORCH_SPEC picks another torch release)
#
# Build arguments: BASE, the base of every stage (any Debian-like image with python3 3.11 and
# pip: CI builds from a base made with debootstrap, no registry needed); PIP_INDEX_URL and
# TORCH_INDEX_URL, where pip finds packages (CI: a wheelhouse served on the loopback, built with
# --network host); EXTRAS, the project's extras for full (default every component's).
#
# Runs as uid 10001 (the chart's runAsUser) with a read-only root file system: it writes only
# to /tmp (a volume in the chart; HOME points there). Nothing is downloaded at run time.

ARG BASE=python:3.11-slim

# -- the native CPU LoRA kernel, compiled for portable instruction-set levels (never -march=native:
#    the image runs on other CPUs than the builder's); the compiler stays in this stage
FROM ${BASE} AS kernels
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev; \
    rm -rf /var/lib/apt/lists/*
COPY loraplane/dataplane/kernels/sgmv_cpu.c loraplane/dataplane/kernels/sgmv_cpu_prebuilt.py /src/
RUN python3 /src/sgmv_cpu_prebuilt.py /opt/loraplane/kernels

# -- the project's wheel
FROM ${BASE} AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
WORKDIR /src
COPY pyproject.toml README.md ./
COPY loraplane ./loraplane
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# -- what every target shares: the user, the environment
FROM ${BASE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp
RUN useradd --uid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin loraplane

# -- slim: the control plane and the operator (no torch)
FROM runtime AS slim
ARG PIP_INDEX_URL=https://pypi.org/simple
COPY --from=build /dist /dist
RUN set -eux; \
    pip install --no-cache-dir "$(ls /dist/loraplane-*.whl)[controlplane,operator]"; \
    # what the image never runs: kubernetes 37's asyncio copy of its client (about 68 MB with
    # its bytecode; loraplane uses the synchronous one) and the packages' own test suites
    site="$(python3 -c "import importlib.util as u, os; \
      print(os.path.dirname(u.find_spec('numpy').submodule_search_locations[0]))")"; \
    rm -rf "$site/kubernetes/aio"; \
    find "$site" -type d -name tests -prune -exec rm -rf {} +; \
    rm -rf /dist; \
    if python3 -c "import torch" 2> /dev/null; then echo "slim: torch came in" >&2; exit 1; fi; \
    loraplane --help > /dev/null
USER 10001
WORKDIR /tmp
ENTRYPOINT ["loraplane"]
CMD ["--help"]

# -- full (the default target): slim and the data plane: torch, the prebuilt kernels
FROM slim AS full
USER root
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG EXTRAS=controlplane,operator,dataplane
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY --from=build /dist /dist
# torch first, from its index, so the data plane extra does not pull another build
RUN set -eux; \
    case ",${EXTRAS}," in \
      *,dataplane,*) pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" ;; \
    esac; \
    pip install --no-cache-dir "$(ls /dist/loraplane-*.whl)[${EXTRAS}]"; \
    site="$(python3 -c "import importlib.util as u, os; \
      print(os.path.dirname(u.find_spec('numpy').submodule_search_locations[0]))")"; \
    find "$site" -type d -name tests -prune -exec rm -rf {} +; \
    rm -rf /dist; \
    loraplane --help > /dev/null
COPY --from=kernels /opt/loraplane/kernels /opt/loraplane/kernels
ENV LORAPLANE_KERNEL_PREBUILT=/opt/loraplane/kernels
# the data plane loads a prebuilt kernel here (on the builder's CPU), not a compiled one
RUN case ",${EXTRAS}," in *,dataplane,*) python3 -c "if 1: \
      from loraplane.dataplane.kernels import sgmv_cpu; loaded = sgmv_cpu.loaded(); print(loaded); \
      raise SystemExit(loaded is None or loaded.origin != 'prebuilt')" ;; esac
USER 10001
