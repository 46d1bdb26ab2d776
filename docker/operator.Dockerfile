# The operator image: kopf + the control plane. It imports neither torch nor the runtime
# (import-linter enforces it), but the package is one distribution, so install it without
# its heavy dependencies and add only what the control plane needs.
FROM python:3.11-slim-bookworm
RUN useradd --uid 10001 --create-home cleave
WORKDIR /opt/cleave
COPY pyproject.toml README.md ./
COPY operator operator
COPY runtime runtime
COPY kv_store kv_store
RUN pip install --no-cache-dir --no-deps . \
    && pip install --no-cache-dir "kopf==1.45.*" "kubernetes==37.0.*" "aiohttp==3.14.*"
USER 10001
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["cleave"]
CMD ["operator", "--standalone", "--all-namespaces"]
