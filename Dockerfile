# One image for every role; one Dockerfile for both builds (README "Container image"):
#   make image              online: FROM python:3.11-slim, wheels from PyPI (no build arguments)
#   make image-airgapped    no registry: a Debian base made by debootstrap (deploy/airgapped/base.sh),
#                           wheels resolved on the host into build/wheelhouse, `docker build --network none`
# Roles (the same image; see README for the flags each needs):
#   docker run -p 8080:8080 -p 8081:8081 -v gpubadge:/data -e GPUBADGE_WEBHOOK_SECRET=... gpubadge   # serve
#   docker run -e GPUBADGE_DATABASE_URL=postgresql://... gpubadge db upgrade            # migrations
#   docker run -e GPUBADGE_DATABASE_URL=postgresql://... gpubadge serve --workers 0     # API only
#   docker run -e GPUBADGE_DATABASE_URL=postgresql://... gpubadge worker --metrics-port 9090
#   docker run -v /var/run/docker.sock:/var/run/docker.sock \
#     --group-add "$(stat -c %g /var/run/docker.sock)" gpubadge agent --service URL  # GPUBADGE_AGENT_TOKEN
# Every role runs with `--read-only --tmpfs /tmp` (plus a writable /data for SQLite).
# BASE runs the image; BUILD_BASE (default: the same) makes the venv, and must have its python3 at the
# same path as BASE's, since the venv is copied across (say, BASE plus compilers for a source-only wheel).
ARG BASE=python:3.11-slim
ARG BUILD_BASE=${BASE}

FROM ${BUILD_BASE} AS build
# Empty: pip installs the sources from the index it can reach. A directory (make image-airgapped):
# pip, run from its own wheel there, installs gpubadge's wheel and its dependencies from it, with
# no index at all (the base needs no python3-venv or python3-pip: the venv is made --without-pip).
ARG WHEELHOUSE=
WORKDIR /src
# .dockerignore admits only the package sources, pyproject.toml, README.md and build/wheelhouse.
COPY . .
RUN if [ -n "$WHEELHOUSE" ]; then \
         python3 -m venv --without-pip /opt/gpubadge \
         && /opt/gpubadge/bin/python3 "$(echo "$WHEELHOUSE"/pip-*.whl)/pip" install \
              --no-cache-dir --no-index --find-links "$WHEELHOUSE" gpubadge; \
       else \
         python3 -m venv /opt/gpubadge \
         && /opt/gpubadge/bin/pip install --no-cache-dir . \
         && /opt/gpubadge/bin/python3 -m pip uninstall --yes --quiet pip setuptools; \
       fi \
    # pip comes in as a dependency (sqlite-utils declares it, for its plugin installer): not at run time
    && if /opt/gpubadge/bin/python3 -c 'import pip' 2>/dev/null; then \
         /opt/gpubadge/bin/python3 -m pip uninstall --yes --quiet pip; \
       fi \
    && /opt/gpubadge/bin/gpubadge --help >/dev/null \
    # zstandard ships two backends; CPython imports the C one, the CFFI one (12 MB) is PyPy's fallback
    && rm -f /opt/gpubadge/lib/python3*/site-packages/zstandard/_cffi.*.so \
    && /opt/gpubadge/bin/python3 -c "import zstandard; assert zstandard.backend == 'cext', zstandard.backend"

FROM ${BASE}
RUN groupadd --system --gid 999 gpubadge \
    && useradd --system --uid 999 --gid 999 --home-dir /data --no-create-home --shell /usr/sbin/nologin gpubadge \
    && mkdir -p /data && chown 999:999 /data && chmod 0750 /data
# The venv alone: no wheels, no pip, no pip cache, no compiler (its python3 is the base's).
COPY --from=build /opt/gpubadge /opt/gpubadge
USER 999:999
WORKDIR /data
ENV PATH=/opt/gpubadge/bin:$PATH \
    GPUBADGE_DB=/data/gpubadge.db \
    GPUBADGE_HOST=0.0.0.0 \
    GPUBADGE_PORT=8080 \
    GPUBADGE_INTAKE_PORT=8081 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
EXPOSE 8080 8081
# `gpubadge healthcheck` finds this container's gpubadge process and probes what that role serves,
# on the port its settings and flags say: serve -> /healthz on GPUBADGE_PORT (or --port),
# worker --metrics-port N -> /healthz on N; roles with no port (agent, worker without
# --metrics-port, db, scan, config) have nothing to probe and report healthy while they run.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 CMD ["gpubadge", "healthcheck"]
ENTRYPOINT ["gpubadge"]
CMD ["serve"]
