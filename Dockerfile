# EvoSpec server image: CUDA runtime + Python 3.11, non-root, the README's two steps
# (scripts/setup.sh, then evospec serve). Runs on a GPU when one is passed in (--gpus all),
# on the CPU otherwise (--device auto).
#
#   docker build -t evospec .
#   docker run --gpus all -p 8000:8000 -e EVOSPEC_ADMIN_TOKEN=change-me evospec
#
# Other presets: docker run ... evospec .venv/bin/evospec serve --config configs/eagle2-gpu.yaml
# (uses the EAGLE-2 head shipped in evospec/heads/ for the default model).
FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHON=python3.11

# g++ and the Python headers: hnswlib where it has no wheel, and the fused CPU ops
# (evospec/kernels/cpu_ops.cpp), built on first CPU use; without them CPU decoding is slower.
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common ca-certificates curl \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
        g++ python3.11-dev \
    && apt-get purge -y software-properties-common && apt-get autoremove -y \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 evospec \
    && install -d -o evospec -g evospec /home/evospec/app
USER evospec
WORKDIR /home/evospec/app
ENV EVOSPEC_HOME=/home/evospec/.cache/evospec

# Only what the package needs (never a host .venv or caches from the build context).
COPY --chown=evospec:evospec pyproject.toml README.md ./
COPY --chown=evospec:evospec scripts/ scripts/
COPY --chown=evospec:evospec evospec/ evospec/
COPY --chown=evospec:evospec indices/ indices/
COPY --chown=evospec:evospec service/ service/
COPY --chown=evospec:evospec configs/ configs/

# A CUDA build of torch first: scripts/setup.sh keeps an existing torch (it installs the CPU
# build only when none is present). Then the README's setup step, and the one-time conversion
# of the default model's weights so the container starts serving in seconds.
RUN python3.11 -m venv .venv \
    && .venv/bin/python -m pip install --disable-pip-version-check -q torch --index-url "$TORCH_INDEX_URL" \
    && ./scripts/setup.sh \
    && .venv/bin/evospec models pull smollm2-135m-instruct

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1

CMD [".venv/bin/evospec", "serve", "--config", "configs/ar.yaml", "--host", "0.0.0.0", "--device", "auto", "--no-progress"]
