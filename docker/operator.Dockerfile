# The operator image: kopf and the control plane, no torch (docs/images.md). The project is one
# distribution; this image installs it with the `operator` extra alone, which
# tools/check_images.py (`make images`) installs into a fresh venv to run `cleave operator`.
FROM python:3.11-slim-bookworm
RUN useradd --uid 10001 --create-home cleave
WORKDIR /opt/cleave
COPY pyproject.toml README.md ./
COPY common common
COPY autoscaling autoscaling
COPY operator operator
COPY runtime runtime
COPY kv_store kv_store
RUN pip install --no-cache-dir '.[operator]'
USER 10001
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["cleave"]
CMD ["operator", "--standalone", "--all-namespaces"]
