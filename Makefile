# Two entry points: `make demo` (the whole job on a local S3 server) and `make test`.
# Both install what they need: Debian's fuse3/libfuse3-dev/pkg-config and Ceph's mon/osd/mgr/radosgw
# (tests/test_rgw.py runs a throw-away Ceph RGW) as root, and a virtualenv.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench deps clean

demo: $(STAMP)
	$(VENV)/bin/cachefs demo

test: lint
	$(VENV)/bin/pytest -q -ra --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check $(wildcard cachefs warmup packer csi tests benchmarks)

bench: $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	$(VENV)/bin/python benchmarks/bench_read.py --quick

deps:
	@$(call apt_install,fuse3 libfuse3-dev pkg-config gcc,)
	@$(call apt_install,ceph-mon ceph-osd ceph-mgr radosgw,--no-install-recommends)

# $(1): Debian packages; $(2): extra apt-get flags. Installs the missing ones (root only).
define apt_install
missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
if [ -n "$$missing" ]; then \
  if [ "$$(id -u)" != 0 ]; then echo "please install:$$missing (as root)"; exit 1; fi; \
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) $$missing; fi
endef

$(STAMP): pyproject.toml | deps
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) *.egg-info
