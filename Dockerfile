# trustbatch GPU image: the trainer, SGLang (the `gpu` extra) and bubblewrap for the code sandbox.
#   docker build -t trustbatch .
#   docker run --gpus all -v $PWD/runs:/work/runs trustbatch train configs/quickstart.yaml
# SGLang 0.5.23 pins torch 2.14.1 built for CUDA 13, hence the CUDA 13 base.
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    PATH=/opt/venv/bin:$PATH

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
COPY configs configs
# The gpu extra brings SGLang, which brings its own CUDA build of torch (inside the range pyproject allows).
RUN pip install --upgrade pip && pip install '.[gpu]'

WORKDIR /work
RUN cp -r /opt/trustbatch/configs /work/configs
ENTRYPOINT ["trustbatch"]
CMD ["--help"]
