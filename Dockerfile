# One image for every role: `docker build -t gpubadge .` then
#   docker run -p 8080:8080 -v gpubadge:/data -e GPUBADGE_WEBHOOK_SECRET=... gpubadge   # serve (SQLite)
#   docker run -e GPUBADGE_DATABASE_URL=postgresql://... gpubadge db upgrade            # migrations
#   docker run -e GPUBADGE_DATABASE_URL=postgresql://... gpubadge serve --workers 0     # API only
#   docker run -e GPUBADGE_DATABASE_URL=postgresql://... gpubadge worker --concurrency 8
#   docker run ... gpubadge agent --service URL        # token from GPUBADGE_AGENT_TOKEN
# (mount /var/run/docker.sock for the agent; NVML comes from the NVIDIA container toolkit).
# With GPUBADGE_DATABASE_URL set no SQLite file is written, so the root filesystem may be read-only.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scanner ./scanner
COPY placement ./placement
COPY web ./web
COPY agent ./agent
COPY gpubadge ./gpubadge
COPY store ./store
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 999 --user-group --home-dir /data --create-home gpubadge \
    && mkdir -p /data && chown gpubadge /data
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER gpubadge
WORKDIR /data
ENV GPUBADGE_DB=/data/gpubadge.db \
    GPUBADGE_HOST=0.0.0.0 \
    GPUBADGE_PORT=8080 \
    PYTHONUNBUFFERED=1
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)" || exit 1
ENTRYPOINT ["gpubadge"]
CMD ["serve"]
