# kvgate's image: the admission service, the probe and the scaler (one image, three commands).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ext_proc ext_proc
COPY gpu_probe gpu_probe
COPY scaler scaler
COPY sim sim
COPY kvgate kvgate
COPY envoy envoy
RUN pip install --no-cache-dir . && useradd --uid 10001 --no-create-home kvgate
USER 10001
ENTRYPOINT ["kvgate"]
CMD ["extproc", "--config", "/etc/kvgate/kvgate.yaml"]
