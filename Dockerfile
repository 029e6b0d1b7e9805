# The aether image (the chart's `image`): aether-agent, aether-cni, aether-mesh-dns, aether-registrar, aether-controller and the `aether`
# CLI (run in the agent pod: `kubectl exec … -c agent -- aether status`, or cli/kubectl-aether), with the
# tools the agent runs inside pod network namespaces (nsenter, nft) and coreutils for the exec readiness probes.
# The proxy image is proxy/Dockerfile (stock Envoy plus the supervisor).
#
#   docker build -t aether .
#
# Not built by the tests (no container runtime in CI); they run the same binaries from the workspace.
ARG RUST_VERSION=1.94

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p aether-agent -p aether-cni -p aether-mesh-dns -p aether-registrar -p aether-controller -p aether-cli --bins

FROM docker.io/library/debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends nftables util-linux ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/aether-agent /src/target/release/aether-cni \
    /src/target/release/aether-mesh-dns /src/target/release/aether-registrar /src/target/release/aether-controller \
    /src/target/release/aether /usr/local/bin/
# The chart sets each container's command; the image runs nothing by itself.
CMD ["aether-agent", "--help"]
