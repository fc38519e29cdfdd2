# syntax=docker/dockerfile:1
# The loraplane image: one image for the control plane, the operator and the data plane (the
# chart runs `loraplane controlplane|operator`, a ServingPool's pods `loraplane serve`).
#
#   docker build -t ghcr.io/loraplane/loraplane:0.1.0 .
#       every component, torch for CPU
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       -t ghcr.io/loraplane/loraplane:0.1.0-cuda .
#       the data plane on NVIDIA GPUs (torch's CUDA wheels bring their CUDA runtime)
#   docker build --build-arg EXTRAS=controlplane,operator -t ghcr.io/loraplane/loraplane:0.1.0-slim .
#       control plane and operator only: no torch, a few hundred MB
#
# Runs as uid 10001 (the chart's runAsUser) with a read-only root file system: write only to
# mounted volumes (/tmp is one in the chart).

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY loraplane ./loraplane
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM python:3.11-slim
ARG EXTRAS=controlplane,operator,dataplane
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
COPY --from=build /dist /dist
# torch first, from the chosen index, so the data plane extra does not pull another build
RUN set -eux; \
    case ",${EXTRAS}," in \
      *,dataplane,*) pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" ;; \
    esac; \
    pip install --no-cache-dir "$(ls /dist/loraplane-*.whl)[${EXTRAS}]"; \
    rm -rf /dist; \
    useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin loraplane; \
    loraplane --help > /dev/null
USER 10001
WORKDIR /tmp
ENTRYPOINT ["loraplane"]
CMD ["--help"]
