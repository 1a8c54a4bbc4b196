FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY proxy ./proxy
RUN pip install ".[otel]" \
    && useradd --create-home --uid 10001 ctxproxy \
    && mkdir -p /data \
    && chown ctxproxy:ctxproxy /data

USER ctxproxy
VOLUME ["/data"]
WORKDIR /data
EXPOSE 4000

# Data lives in the /data volume (storage.data_dir defaults to ./ctxproxy-data under it).
CMD ["ctxproxy", "serve", "--host", "0.0.0.0"]
