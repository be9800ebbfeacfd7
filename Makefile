# gpubadge: `make run` starts the main job, `make test` runs every check.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
DEB_PACKAGES := docker-registry skopeo docker.io runc chromium busybox-static postgresql debootstrap gcc g++
# On a shared machine another job may hold dpkg's lock: wait for it (up to 5 min) instead of failing.
APT_LOCK_WAIT := -o DPkg::Lock::Timeout=300
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test deps-system deps-python lint typecheck pytest bench image image-airgapped

# The container image (README "Container image"). Both targets use the daemon DOCKER_HOST names.
IMAGE ?= gpubadge:latest
DOCKER ?= docker

deps-system:  ## Debian packages the tests drive for real (registry, pusher, engine, browser, C compiler)
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; apt-get $(APT_LOCK_WAIT) update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get $(APT_LOCK_WAIT) install -y -qq --no-install-recommends $$missing; \
	fi

deps-python:
	$(PIP) install -q -e '.[test]'

run: deps-system deps-python
	$(PYTHON) -m fixtures.demo

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

typecheck:
	$(PYTHON) -m mypy

# The suite waits on real services much of its time: a worker process per core (at most 4), each test file
# whole in one of them (its module fixtures built once), takes it from 18 to 13 minutes on 2 cores.
PYTEST_WORKERS ?= --numprocesses=auto --maxprocesses=4 --dist=loadfile

pytest:  ## deps-system installed Docker, PostgreSQL, gcc and g++: a test that cannot use them fails, not skips; the 15 slowest are listed
	GPUBADGE_REQUIRE_DOCKER=1 GPUBADGE_REQUIRE_SYSTEM=1 $(PYTHON) -m pytest -q --durations=15 $(PYTEST_WORKERS)

test: deps-system deps-python lint typecheck pytest

bench: deps-system deps-python
	$(PYTHON) -m bench.run

image:  ## online: FROM python:3.11-slim, dependencies from PyPI
	$(DOCKER) build -t $(IMAGE) .

# No container registry (deploy/airgapped/build.sh): the base is debootstrapped from Debian packages,
# the wheels come from the pip index configured on this host (both cached in $$GPUBADGE_CACHE,
# default ~/.cache/gpubadge), and the build itself runs with no network at all.
image-airgapped:
	PYTHON=$(PYTHON) DOCKER="$(DOCKER)" deploy/airgapped/build.sh $(IMAGE)
