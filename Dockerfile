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
# pass --shm-size (e.g. 2g or more) or --ipc=host. The KV host tier (option.kv_offload_memory, docs/kv-tiers.md)
# lives in /dev/shm too: --shm-size must hold it (a size that does not fit is refused at start), and a
# disk tier that survives the container wants a mounted volume: -v /data/kv:/opt/ml/kv with
# option.kv_offload_dir=/opt/ml/kv.
#
# At start `serve` logs which attention backend runs ("attention backend flash_attn") and how decode
# steps run ("decode steps: cuda_graphs ..."). Building flash-attn takes a while (about an hour on 8
# cores); the wheel stage is cached by Docker between builds.
# torch's CUDA and the image's must agree: flash-attn is compiled against both. TORCH_INDEX picks
# the torch wheel for CUDA_VERSION from PyTorch's index (cu128 = CUDA 12.8); the builder stops if
# the installed torch reports another CUDA.
ARG CUDA_VERSION=12.8.1
ARG TORCH_INDEX=cu128
ARG PYTHON=python3.11

# -- stage 1: flash-attn, compiled on a CUDA -devel image (nvcc), for the GPUs LMI is deployed on
#    (A100 8.0, A10G 8.6, L4/L40S 8.9, H100 9.0) --------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubuntu22.04 AS flash-attn
ARG TORCH_INDEX
ARG PYTHON
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 \
    TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0" MAX_JOBS=8 FLASH_ATTENTION_FORCE_BUILD=TRUE
RUN apt-get update \
 && apt-get install -y --no-install-recommends ${PYTHON} ${PYTHON}-venv ${PYTHON}-dev build-essential git \
 && rm -rf /var/lib/apt/lists/* \
 && ${PYTHON} -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --upgrade pip wheel packaging ninja setuptools \
 && pip install "torch==2.13.0" --index-url "https://download.pytorch.org/whl/${TORCH_INDEX}" \
 && python -c "import torch, os; want = os.environ['CUDA_VERSION'].rsplit('.', 1)[0]; \
assert torch.version.cuda == want, f'torch is built for CUDA {torch.version.cuda}, the image has {want}'"
RUN pip wheel --no-build-isolation --no-deps -w /wheels "flash-attn>=2.5,<3"

# -- stage 2: the serving image ------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-ubuntu22.04
ARG TORCH_INDEX
ARG PYTHON

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        ${PYTHON} ${PYTHON}-venv ${PYTHON}-dev build-essential \
        openmpi-bin libopenmpi-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && ${PYTHON} -m venv /opt/venv

WORKDIR /opt/lmi
# dependencies first: torch from the same index as the builder's (the flash-attn wheel links to it)
COPY pyproject.toml README.md ./
COPY container ./container
COPY handlers ./handlers
COPY engines ./engines
COPY serving.properties.examples ./serving.properties.examples
COPY --from=flash-attn /wheels /tmp/wheels
RUN pip install --upgrade pip \
 && pip install "torch==2.13.0" --index-url "https://download.pytorch.org/whl/${TORCH_INDEX}" \
 && pip install . /tmp/wheels/flash_attn-*.whl \
 && rm -rf /tmp/wheels \
 && python -c "import flash_attn, torch; print('flash-attn', flash_attn.__version__, 'torch', torch.__version__)"

RUN useradd --create-home --uid 1000 lmi \
 && mkdir -p /opt/ml/model /home/lmi/.cache/lmi-serve \
 && chown -R lmi:lmi /opt/ml /home/lmi/.cache
USER lmi
# the load-optimised weight cache (docs/planning.md) and torch.compile's code cache: written on the
# first start, read on later ones; serving.properties keys override them
ENV OPTION_LOAD_CACHE_DIR=/home/lmi/.cache/lmi-serve/load-cache \
    OPTION_COMPILE_CACHE_DIR=/home/lmi/.cache/lmi-serve/compile-cache

EXPOSE 8080
LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true
# SageMaker multi-model endpoints (SAGEMAKER_MULTI_MODEL=true): models come through POST /models (docs/multi-model.md)
LABEL com.amazonaws.sagemaker.capabilities.multi-models=true
ENTRYPOINT ["/opt/lmi/container/serve"]
CMD ["serve"]
