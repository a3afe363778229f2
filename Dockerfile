# CPU image of atoll: the coordinator and nodes of docker-compose.yml run from it.
# For GPU nodes, build FROM an image with CUDA and install the matching CUDA torch instead of the CPU wheel.
FROM python:3.11-slim
WORKDIR /app
# torch first, the README's pin, as the CPU-only build from PyTorch's own index (from PyPI, Linux x86_64 gets the
# CUDA-enabled build, several GB larger)
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY . /app
RUN pip install --no-cache-dir /app
EXPOSE 7070 7171 9100
ENTRYPOINT []
