# GPU image: NGC PyTorch (ships CUDA, Transformer Engine and flash-attn), megatron-core and this package.
#   docker build -t megatron-vlm-packing .
#   docker run --gpus all --rm megatron-vlm-packing                      # the test suite
#   docker run --gpus all --rm megatron-vlm-packing megatron-vlm-packing demo
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/megatron-vlm-packing
COPY pyproject.toml README.md ./
COPY megatron_vlm_packing ./megatron_vlm_packing
COPY tests ./tests
COPY benchmarks ./benchmarks
COPY examples ./examples

# The base image's Transformer Engine satisfies the `te` extra; pip keeps it rather than rebuilding.
RUN python -m pip install --no-cache-dir "megatron-core>=0.16.1" \
 && python -m pip install --no-cache-dir -e ".[te,hf,test]"

CMD ["python", "-m", "pytest", "-q"]
