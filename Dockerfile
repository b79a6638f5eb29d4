# mha-serve: attention_server and attention_client on Debian 12.
#
#   docker build -t mha-serve .
#   docker run --rm -p 50051:50051 -p 9464:9464 mha-serve
#   docker run --rm -p 50051:50051 -v "$PWD/my_models:/models:ro" mha-serve
#
# The server listens on 0.0.0.0 inside the container (gRPC 50051, /metrics 9464) and
# serves the model repository at /models (the repo's deploy/models unless a volume is
# mounted there). Arguments after the image name replace CMD, so they can change the
# ports or the repository; the 0.0.0.0 binds stay (they are in ENTRYPOINT; a later
# --host=... still wins). Everything comes from Debian's packages: no other download.

# ---- build: the -dev packages and the repo's CMake preset -------------------------------
FROM debian:bookworm AS build
COPY scripts/deps.sh /src/scripts/deps.sh
RUN bash /src/scripts/deps.sh build && apt-get clean && rm -rf /var/lib/apt/lists/*
COPY . /src
WORKDIR /src
# Every target of the preset is built; the binaries are picked by path below, so a
# missing target fails here, by name.
RUN cmake --preset container && cmake --build --preset container
# The runtime packages are the ones owning the shared libraries the two binaries load:
# derived from ldd, so a new library dependency cannot be forgotten in the next stage.
RUN set -eu; mkdir -p /out/bin; \
    for bin in build/container/server/attention_server build/container/client/attention_client; do \
      cp "$bin" /out/bin/; \
    done; \
    strip --strip-unneeded /out/bin/*; \
    ldd /out/bin/* > /tmp/ldd.txt; \
    if grep 'not found' /tmp/ldd.txt; then exit 1; fi; \
    awk '$2 == "=>" && $3 ~ /^\// { print $3 }' /tmp/ldd.txt | sort -u > /tmp/libs.txt; \
    : > /tmp/packages.txt; \
    while read -r lib; do \
      owner=$(dpkg -S "*/$(basename "$lib")" 2>/dev/null | head -n 1 | cut -d: -f1); \
      if [ -z "$owner" ]; then echo "no Debian package owns $lib" >&2; exit 1; fi; \
      echo "$owner" >> /tmp/packages.txt; \
    done < /tmp/libs.txt; \
    sort -u /tmp/packages.txt > /out/runtime-packages; \
    echo "runtime packages:" $(cat /out/runtime-packages)

# ---- runtime: bookworm-slim with the runtime libraries only -------------------------
FROM debian:bookworm-slim
COPY --from=build /out/runtime-packages /tmp/runtime-packages
# Besides the libraries: the font attention_client heatmap labels its axes with
# (found through fontconfig at run time, so ldd cannot see it).
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
         $(cat /tmp/runtime-packages) fonts-dejavu-core \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /var/log/apt /var/log/dpkg.log /tmp/runtime-packages \
    && groupadd --system --gid 10001 mha \
    && useradd --system --uid 10001 --gid mha --no-create-home --home-dir /nonexistent \
         --shell /usr/sbin/nologin mha
COPY --from=build /out/bin/ /usr/local/bin/
COPY deploy/models/ /models/

LABEL org.opencontainers.image.title="mha-serve" \
      org.opencontainers.image.description="CPU multi-head attention over gRPC (oneDNN)"

# Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /
# gRPC, KServe v2 HTTP/REST, Prometheus /metrics.
EXPOSE 50051 8000 9464
VOLUME ["/models"]
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["attention_client", "health", "--target=127.0.0.1:50051"]
ENTRYPOINT ["attention_server", "--host=0.0.0.0", "--metrics_host=0.0.0.0"]
CMD ["--port=50051", "--http_port=8000", "--metrics_port=9464", "--model_repository=/models", "--drain_timeout=10s"]
