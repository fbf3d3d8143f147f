# Two entry points: `make demo` (the whole job on a local S3 server) and `make test`.
# `make demo` installs only what the demo uses: Debian's fuse3, libfuse3-dev and pkg-config (the
# FUSE runtime and pyfuse3's build), and a virtualenv with cachefs and its `server` extra (moto).
# `make test` adds Ceph's mon/osd/mgr/radosgw (tests/store/test_rgw.py runs a throw-away Ceph RGW) and
# the `test` extra (torch CPU, SeaweedFS, rclone, hypothesis, ...). apt runs only as root.
PYTHON ?= python3
VENV   := .venv
DEMO_STAMP := $(VENV)/.demo-installed
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench deps demo-deps clean

demo: $(DEMO_STAMP)
	$(VENV)/bin/cachefs demo

# The FUSE tests that run a second time through the pyfuse3 fallback backend (the differential
# test drives both in one run).
PYFUSE3_TESTS := tests/namespace/test_mount_read.py tests/writeback/test_writeback_mount.py tests/namespace/test_consistency.py \
	tests/control/test_control_mount.py tests/fuse/test_open_deadlock.py tests/packed/test_packed_mount.py \
	tests/namespace/test_empty_prefix.py tests/tiers/test_hedge_mount.py

test: lint
	$(VENV)/bin/pytest -q -ra --durations=25
	CACHEFS_FUSE_BACKEND=pyfuse3 $(VENV)/bin/pytest -q -ra $(PYFUSE3_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(wildcard cachefs warmup packer csi tests benchmarks testing)

bench: $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	$(VENV)/bin/python benchmarks/bench_read.py --quick

demo-deps:
	@$(call apt_install,fuse3 libfuse3-dev pkg-config gcc,)

deps: demo-deps
	@$(call apt_install,ceph-mon ceph-osd ceph-mgr radosgw,--no-install-recommends)

# $(1): Debian packages; $(2): extra apt-get flags. Installs the missing ones (root only).
define apt_install
missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
if [ -n "$$missing" ]; then \
  if [ "$$(id -u)" != 0 ]; then echo "please install:$$missing (as root)"; exit 1; fi; \
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) $$missing; fi
endef

$(DEMO_STAMP): pyproject.toml | demo-deps
	[ -x $(VENV)/bin/pip ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[server]'
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml | deps
	[ -x $(VENV)/bin/pip ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP) $(DEMO_STAMP)

clean:
	rm -rf $(VENV) *.egg-info
