# streamq worker/producer image for NVIDIA GPU hosts (vLLM's CUDA build).
# Build: docker build -t streamq .     (the CPU build: --build-arg EXTRAS=cpu)
FROM python:3.11-slim
ARG EXTRAS=cuda
WORKDIR /app
COPY pyproject.toml README.md ./
COPY producer ./producer
COPY worker ./worker
RUN pip install --no-cache-dir ".[${EXTRAS}]"
ENV PYTHONUNBUFFERED=1
CMD ["python", "-m", "worker", "--help"]
