# syntax=docker/dockerfile:1
# sluice's container image: built with the toolchain the project uses, shipped on
# distroless cc (glibc, CA-free, no shell), as uid 65532. sluice is PID 1 and handles
# SIGTERM itself (drain, then exit), so no init shim is needed.

ARG RUST_VERSION=1.95

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
ARG REVISION=unknown
# No debug info and no symbols in the shipped binary; the revision goes into
# sluice_build_info.
ENV SLUICE_REVISION=${REVISION} \
    CARGO_PROFILE_RELEASE_DEBUG=0 \
    CARGO_PROFILE_RELEASE_STRIP=symbols
COPY Cargo.toml Cargo.lock ./
COPY benches ./benches
COPY src ./src
RUN cargo build --release --locked --bin sluice

FROM gcr.io/distroless/cc-debian12:nonroot
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="sluice" \
      org.opencontainers.image.description="Rate-limiting forward proxy sidecar for the external APIs a service calls" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE}"
COPY --from=build /src/target/release/sluice /usr/local/bin/sluice
COPY config/container.toml /etc/sluice/sluice.toml
ENV SLUICE_CONFIG=/etc/sluice/sluice.toml
USER 65532:65532
EXPOSE 3128 9901
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["run"]
