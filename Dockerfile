# kvgate's image: the admission service, the probe and the scaler (one image, three commands).
# Built in two stages: the full Python image has the C compiler that intake's structural scan
# (ext_proc/_jsonscan.c) needs; the slim one runs the wheel built there.
FROM python:3.11-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY ext_proc ext_proc
COPY gpu_probe gpu_probe
COPY scaler scaler
COPY sim sim
COPY kvgate kvgate
COPY envoy envoy
# KVGATE_REQUIRE_C: a failed compile fails the build, rather than shipping the slower pure-Python scan
RUN KVGATE_REQUIRE_C=1 pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
WORKDIR /app
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels && python -c "import ext_proc._jsonscan" \
    && useradd --uid 10001 --no-create-home kvgate
USER 10001
ENTRYPOINT ["kvgate"]
CMD ["extproc", "--config", "/etc/kvgate/kvgate.yaml"]
