# streamq worker/gateway/producer image for NVIDIA GPU hosts (vLLM's CUDA build).
# Build: docker build -t streamq .     (the CPU build: --build-arg EXTRAS=cpu)
FROM python:3.11-slim
ARG EXTRAS=cuda
WORKDIR /app
COPY pyproject.toml README.md ./
COPY streamq ./streamq
COPY producer ./producer
COPY worker ./worker
COPY gateway ./gateway
RUN pip install --no-cache-dir ".[${EXTRAS}]"
# Workers and gateways run as an unprivileged user: a flaw in the engine, a tokenizer or
# the HTTP stack does not hand out root in the container. Its home holds the model cache
# (a volume in docker-compose.yml), created here so that the volume is the user's too.
RUN useradd --create-home --uid 10001 --user-group streamq \
    && mkdir -p /home/streamq/.cache/huggingface \
    && chown -R streamq:streamq /home/streamq/.cache
USER streamq
ENV PYTHONUNBUFFERED=1 HOME=/home/streamq
CMD ["python", "-m", "worker", "--help"]
