# lmi-serve: the LMI-style inference container.
#
#   docker build -t lmi-serve .
#   # SageMaker runs `docker run IMAGE serve`; locally, mount a model dir (with serving.properties):
#   docker run --gpus all --shm-size 2g -p 8080:8080 -v $PWD/models/tiny:/opt/ml/model lmi-serve serve
#   # or mount only a properties file next to a hub id / s3:// prefix given in it or as HF_MODEL_ID:
#   docker run --gpus all --ipc=host -p 8080:8080 \
#       -v $PWD/serving.properties:/opt/ml/model/serving.properties lmi-serve serve
#
# Multi-GPU (engine=MPI, tensor_parallel_degree > 1) needs shared memory for NCCL:
# pass --shm-size (e.g. 2g or more) or --ipc=host.
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv python3.11-dev build-essential \
        openmpi-bin libopenmpi-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv

WORKDIR /opt/lmi
# dependencies first (pyproject pins torch; on PyPI that pin is the CUDA build)
COPY pyproject.toml README.md ./
COPY container ./container
COPY handlers ./handlers
COPY engines ./engines
COPY serving.properties.examples ./serving.properties.examples
RUN pip install --upgrade pip && pip install . \
 && (pip install --no-build-isolation 'flash-attn>=2.5' \
     || echo "flash-attn not installed: attention falls back to PyTorch SDPA")

RUN useradd --create-home --uid 1000 lmi \
 && mkdir -p /opt/ml/model /home/lmi/.cache/lmi-serve \
 && chown -R lmi:lmi /opt/ml /home/lmi/.cache
USER lmi
# the load-optimised weight cache (docs/planning.md): written on the first start, read on later
# ones; option.load_cache_dir in serving.properties overrides it
ENV OPTION_LOAD_CACHE_DIR=/home/lmi/.cache/lmi-serve/load-cache

EXPOSE 8080
LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true
ENTRYPOINT ["/opt/lmi/container/serve"]
CMD ["serve"]
