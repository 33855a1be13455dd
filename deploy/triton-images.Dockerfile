# The official Triton container for a repository with a raw entry (torchship repo serves one for an image
# model, and for an export made with --tokenizer): its preprocessing model runs in Triton's python backend and
# decodes images with Pillow, or tokenizes text with Hugging Face's tokenizers, which the official image lacks.
# docker build -f deploy/triton-images.Dockerfile -t torchship-triton-images deploy/
FROM nvcr.io/nvidia/tritonserver:26.11-py3

RUN pip install --no-cache-dir pillow==13.0.0 tokenizers==0.23.3

USER 1000:1000
HEALTHCHECK --interval=30s --timeout=5s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4)"]
