# The node's image (docs/kubernetes.md). From the repository's root:
#
#   docker build -t slipstream:0.1.0 .
#
# Two stages: the wheel is built with maturin in a Rust image, then
# installed into a virtualenv on Debian's slim base with Debian's own
# Python. The node runs as an unprivileged user and downloads nothing when
# it runs: apps, their files and models arrive through the cluster
# (`slipstream deploy` bundles them into etcd and the store) or on a
# mounted volume.
#
# tests/integration/test_image.py runs the second stage's steps, read from
# this file, in a Debian root made with debootstrap (the same release as
# FROM names) and starts a cluster from that root, each node with the
# command the Helm chart renders; keep to the directives it knows (ARG,
# FROM, RUN, COPY, ENV, USER, WORKDIR, EXPOSE, LABEL, ENTRYPOINT, CMD).
ARG DEBIAN_RELEASE=bookworm

FROM rust:1.95-slim-${DEBIAN_RELEASE} AS wheel
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN python3 -m venv /opt/maturin \
 && /opt/maturin/bin/pip install --no-cache-dir "maturin>=1.8,<2" \
 && /opt/maturin/bin/maturin build --release --locked --out /wheels

FROM debian:${DEBIAN_RELEASE}-slim
LABEL org.opencontainers.image.title="slipstream" \
      org.opencontainers.image.description="Serves multi-stage ML pipelines under a latency SLO" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels /tmp/wheels
RUN python3 -m venv /opt/slipstream \
 && /opt/slipstream/bin/pip install --no-cache-dir /tmp/wheels/slipstream-*.whl \
 && rm -rf /tmp/wheels
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/slipstream --create-home slipstream
ENV PATH=/opt/slipstream/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    SLIPSTREAM_HOST=0.0.0.0
USER 10001:10001
WORKDIR /var/lib/slipstream
# HTTP and gRPC on one port; the data plane between nodes.
EXPOSE 8000 7000
ENTRYPOINT ["slipstream"]
CMD ["--help"]
