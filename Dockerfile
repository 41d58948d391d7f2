# The Highwater server as a small image: built with the pinned Rust toolchain, run on Debian
# slim as an unprivileged user. Build: docker build -t highwater .
# Run (the replication token is required on any address but loopback):
#   docker run -p 4848:4848 -v highwater-data:/data \
#     -e HIGHWATER_UPSTREAM=postgres://user:pass@db/app \
#     -e HIGHWATER_REPLICATION_TOKEN=... highwater
# Every `serve` option is also a HIGHWATER_* variable (README, "Commands").

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p highwater-host --bin highwater \
 && strip target/release/highwater

FROM debian:bookworm-slim
# ca-certificates: TLS to Postgres (sslmode=verify-full) and to a primary over wss://.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin highwater \
 && mkdir -p /data \
 && chown highwater /data
COPY --from=build /src/target/release/highwater /usr/local/bin/highwater
USER highwater
VOLUME /data
ENV HIGHWATER_DATA=/data \
    HIGHWATER_HOST=0.0.0.0 \
    HIGHWATER_LOG_FORMAT=json
# Orchestrators probe GET /health (200 while serving; "status" says ok or degraded).
EXPOSE 4848
ENTRYPOINT ["highwater"]
CMD ["serve"]
