# ninfer: the two README commands are `make serve` and `make test`.
# PY is the environment everything runs in: the project venv made by `make setup`, or
# (on the GPU machine, no package index) an existing interpreter: `make PY=python3 gpu-test`.
VENV ?= .venv
PY ?= $(VENV)/bin/python
ARCHS ?=
JOBS ?= 0

.PHONY: setup generate build test gpu-test gpu-carry bench serve clean

# A venv with the pinned toolchain (requirements.txt) and ninfer installed editable; re-run only when the pins change.
setup: $(VENV)/.ninfer-setup
$(VENV)/.ninfer-setup: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements.txt
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps "nvidia-cutlass==4.2.0.0"
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

# specs/*.yaml + codegen/templates -> generated/ (translation units + manifest.json); cheap, deterministic.
generate:
	$(PY) -m ninfer.codegen

# NVRTC: generated/ -> cubin cache (build/cubins); ARCHS=sm_90a,sm_80 limits the targets.
build: generate
	$(PY) -m ninfer.runtime.build --archs "$(ARCHS)" --jobs $(JOBS)

test: setup generate
	$(PY) -m pytest -q tests

gpu-test: generate
	$(PY) -m pytest -q -m gpu tests/gpu

# What a device call carries (tests/gpu/h200_run.sh unpacks it): the sm_90a cubins, built afresh (no stale ones)
# and packed, and the GPU tests' oracle fixtures. carry: [".carry/cubins.tgz", ".carry/oracle"]
gpu-carry: setup generate
	rm -rf build/cubins/sm_90a
	$(PY) -m ninfer.runtime.build --archs sm_90a --jobs $(JOBS)
	$(PY) tests/gpu/make_oracle.py .carry/oracle
	tar czf .carry/cubins.tgz -C build/cubins sm_90a

bench: build
	$(PY) -m ninfer.cli.bench ops

serve: setup build
	$(PY) -m ninfer.cli.serve --demo

clean:
	rm -rf generated build .pytest_cache
