# trustbatch GPU image: the trainer, SGLang (the `gpu` extra) and bubblewrap for the code sandbox.
#   docker build -t trustbatch .
#   docker run --gpus all -v $PWD/runs:/work/runs trustbatch train configs/quickstart.yaml
#   docker run --gpus all -p 8000:8000 -v $PWD/runs:/work/runs trustbatch serve models:/quickstart@best --host 0.0.0.0
#   docker run --gpus all -v $PWD/runs:/work/runs trustbatch eval models:/quickstart@best --k 8
# The MLflow store (runs/mlflow.db) records artifact paths as the training process saw them: serve and eval
# from the image what was trained in the image (same /work/runs), or mount runs/ at its original path.
# SGLang 0.5.23 pins torch 2.14.1 built for CUDA 13, hence the CUDA 13 base.
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

# TORCH_VERSION must be the torch that SGLANG_VERSION pins (tests/unit/test_dockerfile.py checks both against
# the ranges in pyproject.toml).
ARG SGLANG_VERSION=0.5.23
ARG TORCH_VERSION=2.14.1

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    PATH=/opt/venv/bin:$PATH

# Package versions come with the pinned base image's Ubuntu release; pinning each one would break on every
# security update of the archive.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/trustbatch
COPY pyproject.toml README.md ./
COPY app app
COPY trainer trainer
COPY rewards rewards
COPY sandbox sandbox
COPY tools tools
COPY configs configs
# The gpu extra brings SGLang and its CUDA build of torch (inside the range pyproject allows).
RUN pip install "torch==${TORCH_VERSION}" "sglang==${SGLANG_VERSION}" "./[gpu]"

WORKDIR /work
RUN cp -r /opt/trustbatch/configs /work/configs
# `trustbatch serve` listens here (pass --host 0.0.0.0 to reach it from outside the container).
EXPOSE 8000
ENTRYPOINT ["trustbatch"]
CMD ["--help"]
