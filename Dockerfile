# One image for every wakegate component: `wakegate operator|xds|scaler|extproc|agent|scheduler-extender|...`.
# Not built in this project's CI (no container runtime there); see charts/wakegate/README.md.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY control ./control
COPY extproc ./extproc
COPY proto ./proto
COPY envoy ./envoy
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin wakegate
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 10001
ENV PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["wakegate", "--help"]
