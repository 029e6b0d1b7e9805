# Aether: build, test and CI entry points. `make` lists the targets.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

CARGO ?= cargo
VENV  := $(CURDIR)/.venv
STAMP := .setup-done
# Deferred (=): looked up when a recipe runs, i.e. after setup has installed it.
# ($(wildcard) would answer from make's directory cache, stale once setup has run.)
# The pinned Envoy version (setup installs it; tests and the proxy image use it).
ENVOY_VERSION := $(shell cat proxy/ENVOY_VERSION)
ENVOY_BIN = $(shell ls -1 $(VENV)/lib/python3.*/site-packages/envoy/_bin/envoy 2>/dev/null | head -n1)
# Environment for tests and benches.
RUN_ENV = AETHER_VENV=$(VENV) AETHER_ENVOY_BIN=$(ENVOY_BIN) AETHER_ENVOY_VERSION=$(ENVOY_VERSION) PATH="$(VENV)/bin:$$PATH"
HAVE_NEXTEST := $(shell $(CARGO) nextest --version >/dev/null 2>&1 && echo yes)
# Redo setup when the venv's tools are gone, even if the stamp is there.
SETUP_FORCE := $(if $(and $(wildcard $(VENV)/lib/python3.*/site-packages/envoy/_bin/envoy),$(wildcard $(VENV)/bin/moto_server)),,FORCE)

.PHONY: help setup build test lint fmt bench demo clean FORCE

help: ## list targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-6s %s\n", $$1, $$2}'

setup: $(STAMP) ## install Debian packages (root) and the .venv with Envoy and moto

$(STAMP): Makefile scripts/setup.sh proxy/ENVOY_VERSION $(SETUP_FORCE)
	scripts/setup.sh
	touch $@

build: ## build every crate and target
	$(CARGO) build --workspace --all-targets --locked

test: $(STAMP) ## run all tests (nextest if present) and doc tests
	@test -x "$(ENVOY_BIN)" || { echo "no Envoy binary in $(VENV); run make setup" >&2; exit 1; }
	$(CARGO) build --workspace --bins --locked
	$(RUN_ENV) $(CARGO) test --doc --workspace --locked
ifeq ($(HAVE_NEXTEST),yes)
	$(RUN_ENV) $(CARGO) nextest run --workspace --locked --no-fail-fast
else
	$(RUN_ENV) $(CARGO) test --workspace --locked
endif

lint: ## rustfmt check and clippy with warnings as errors
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

fmt: ## format the code
	$(CARGO) fmt --all

bench: $(STAMP) ## run the benchmarks
	@test -x "$(ENVOY_BIN)" || { echo "no Envoy binary in $(VENV); run make setup" >&2; exit 1; }
	$(CARGO) build --workspace --bins --release --locked
	$(RUN_ENV) $(CARGO) bench --workspace --locked
	$(RUN_ENV) $${CARGO_TARGET_DIR:-target}/release/aether-sim --agents 500,1000 --churn-seconds 20

demo: setup ## bring up one node of the mesh and show it working (root; leaves nothing behind)
	@test "$$(id -u)" = 0 || { echo "make demo needs root (network namespaces, nftables, bridges)" >&2; exit 1; }
	@test -x "$(ENVOY_BIN)" || { echo "no Envoy binary in $(VENV); run make setup" >&2; exit 1; }
	$(CARGO) build --workspace --bins --locked
	$(RUN_ENV) $${CARGO_TARGET_DIR:-target}/debug/aether-demo

clean: ## remove build output, the venv and the setup stamp
	$(CARGO) clean
	rm -rf $(VENV) $(STAMP)
