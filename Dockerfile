# syntax=docker/dockerfile:1
# One Dockerfile, two images, both installed from uv.lock (the versions the tests ran with):
#   docker build --target api    -t jacobian-api .     # FastAPI + uvicorn (extra `api`), no TensorFlow, no GPU
#   docker build --target worker -t jacobian-worker .  # TensorFlow 2.21 with CUDA (extra `cuda`: pip wheels)
# Both run as the non-root user `app`; dependencies live in /opt/venv, built in a throwaway stage.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app --shell /usr/sbin/nologin app \
 && mkdir -p /srv/var \
 && chown -R app:app /srv
WORKDIR /srv

# Build stage: uv (the version scripts/uv.sh pins), the lock and the project's source. `uv sync`
# creates the virtualenv at the path the runtime images use, with the image's Python, and compiles
# the bytecode (as pip did) so that processes start without compiling TensorFlow's modules.
FROM base AS build
RUN pip install uv==0.13.9
ENV UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_NO_CACHE=1
COPY pyproject.toml uv.lock README.md MANIFEST.in ./
COPY contracts ./contracts
COPY jacobian ./jacobian
COPY app ./app
COPY worker ./worker

FROM build AS build-api
# The API's extra only: the API never imports TensorFlow. --no-editable: /opt/venv holds the project itself.
RUN uv sync --locked --no-dev --no-editable --extra api

FROM build AS build-worker
# The `cuda` extra is the worker's plus tensorflow[and-cuda]: the CUDA 12 / cuDNN 9 runtime as pip
# wheels (nvidia-*-cu12); the host needs only the NVIDIA driver and the NVIDIA container toolkit.
RUN uv sync --locked --no-dev --no-editable --extra worker --extra cuda

# ---------------------------------------------------------------------------------------------
FROM base AS api
COPY --from=build-api /opt/venv /opt/venv
USER app
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status == 200 else 1)"]
CMD ["jacobian", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------------
FROM base AS worker
COPY --from=build-worker /opt/venv /opt/venv
ENV TF_CPP_MIN_LOG_LEVEL=2 \
    TF_FORCE_GPU_ALLOW_GROWTH=true \
    JACOBIAN_WORKER_METRICS_PORT=9100
USER app
EXPOSE 9100
CMD ["jacobian", "worker", "--supervise"]
