# gearshift operator image: `gearshift operator` (kopf) and `gearshift-router`, non-root, no build tools.
# Build from the repository root:  docker build -f operator.Dockerfile -t ghcr.io/gearshift/operator:0.1.0 .
FROM python:3.11.13-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml ./
COPY operator ./operator
RUN python -m venv /opt/gearshift \
 && /opt/gearshift/bin/pip install --no-cache-dir .

FROM python:3.11.13-slim-bookworm
COPY --from=build /opt/gearshift /opt/gearshift
RUN groupadd --gid 10001 gearshift \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin gearshift
# The chart mounts an emptyDir at /tmp (read-only root filesystem): HOME and bytecode go nowhere else.
ENV PATH=/opt/gearshift/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080 9090
ENTRYPOINT ["gearshift"]
CMD ["operator", "--help"]
