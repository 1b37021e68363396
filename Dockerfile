# syntax=docker/dockerfile:1.18.0@sha256:dabfc0969b935b2080555ace70ee69a5261af8a8f1b4df97b9e7fbcf6722eddf
# sluice's container image: built with the toolchain the project uses, shipped on
# distroless cc (glibc, CA-free, no shell), as uid 65532. sluice is PID 1 and handles
# SIGTERM itself (drain, then exit), so no init shim is needed.
#
# The Dockerfile frontend (the syntax line) and both base images are pinned by digest,
# so a rebuild starts from the bytes that were reviewed; docs/kubernetes.md ("The image")
# says how to move them to a newer digest.

FROM docker.io/library/rust:1.95-bookworm@sha256:6258907abe69656e41cd992e0b705cdcfabcbbe3db374f92ed2d47121282d4a1 AS build
WORKDIR /src
# No debug info and no symbols in the shipped binary.
ENV CARGO_PROFILE_RELEASE_DEBUG=0 \
    CARGO_PROFILE_RELEASE_STRIP=symbols
# The workspace: its manifest, lock file and every member (cargo reads them all before
# it builds one binary), the bench target the manifest declares, and the build flags in
# .cargo/config.toml. scripts/check-image builds this stage's layout without a container
# engine.
COPY Cargo.toml Cargo.lock ./
COPY .cargo ./.cargo
COPY benches ./benches
COPY crates ./crates
COPY src ./src
# The revision comes after the copies: a new one rebuilds only sluice's own crate.
ARG REVISION=unknown
ENV SLUICE_REVISION=${REVISION}
# Cached between builds: the downloaded crates and the compiled dependencies, so that a
# source change recompiles sluice alone. The binary leaves the cache by a copy. Locked:
# two builds at once (the platforms of a multi-platform build) take turns instead of
# writing one cache together; the compiled crates are kept per target platform.
ARG TARGETPLATFORM
RUN --mount=type=cache,id=sluice-cargo-registry,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,id=sluice-target-${TARGETPLATFORM},target=/src/target,sharing=locked \
    cargo build --release --locked --bin sluice \
    && cp target/release/sluice /usr/local/bin/sluice

FROM gcr.io/distroless/cc-debian12:nonroot@sha256:9dac0a79194e45a7da0158a9c6da57b217585af0786db3845d1f0ec1a0dd182f
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="sluice" \
      org.opencontainers.image.description="Rate-limiting forward proxy sidecar for the external APIs a service calls" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /usr/local/bin/sluice /usr/local/bin/sluice
COPY LICENSE /usr/share/doc/sluice/LICENSE
COPY config/container.toml /etc/sluice/sluice.toml
ENV SLUICE_CONFIG=/etc/sluice/sluice.toml
USER 65532:65532
EXPOSE 3128 9901
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["run"]
