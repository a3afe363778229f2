# CPU image of atoll: the coordinator and nodes of docker-compose.yml run from it.
# For GPU nodes, build FROM an image with CUDA and install the matching CUDA torch instead of the CPU wheel.
FROM python:3.11-slim
WORKDIR /app
# torch first (pinned, as in the README); PyTorch publishes smaller CPU-only wheels on its own index
RUN pip install --no-cache-dir torch==2.13.0
COPY . /app
RUN pip install --no-cache-dir /app
EXPOSE 7070 7171 9100
ENTRYPOINT []
