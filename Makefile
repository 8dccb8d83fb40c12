# Two commands are the whole set-up: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs; `make demo` needs nothing
# beyond Python, `make test` also needs Chromium for the explorer's browser test and
# Slurm (slurmctld, slurmd, munge) for the runner's tests on a real cluster (both
# installed from Debian's packages when run as root, else one line says how).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= -q --disable-pip-version-check
# setuptools prints an informational "Editable installation" notice for every editable
# install of a package that maps folders (ours: faultlens.collectors = collectors/...);
# nothing in pyproject.toml can silence it, so the install steps filter that one message.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

.PHONY: demo test check chromium slurm bench lint typecheck floors clean realjob FORCE

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip setuptools wheel

$(VENV)/.installed-demo: pyproject.toml | $(VENV)/bin/python
	$(QUIET_EDITABLE) $(PY) -m pip install $(PIP_FLAGS) -e '.[all]'
	touch $@

# torch first, pinned, so the [torch] extra below is already met: where pip's find-links hold
# the CPU wheel (this project's machines: /opt/wheels) it takes that one (~190 MB, ~30 s); a
# plain `torch` requirement resolved on PyPI alone takes the 5.5 GB CUDA build. Point
# TORCH_SPEC at another wheel or index, or TORCH_SPEC=none to skip it.
TORCH_SPEC ?= torch==2.13.0
$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	@if [ "$(TORCH_SPEC)" != none ]; then $(PY) -m pip install $(PIP_FLAGS) $(TORCH_SPEC); fi
	$(QUIET_EDITABLE) $(PY) -m pip install $(PIP_FLAGS) -e '.[test]'
	touch $@ $(VENV)/.installed-demo

demo: $(VENV)/.installed-demo
	@echo "faultlens is installed in $(VENV): in a new shell, run '. $(VENV)/bin/activate' first (or call $(VENV)/bin/faultlens)"
	$(VENV)/bin/faultlens demo

# The explorer's browser test drives a real headless Chromium. .ci/run calls this step too.
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing the Debian package chromium for the browser test"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	    || { echo "make test: apt-get could not install chromium; install the package 'chromium' and rerun" >&2; exit 1; }; \
	else \
	  echo "make test needs Chromium: run 'sudo apt-get install chromium' (Debian/Ubuntu) or put chromium on PATH, then rerun" >&2; \
	  exit 1; \
	fi

# The runner's Slurm adapter is tested on a real cluster of four slurmd on localhost
# (tests/test_runner_slurm.py, datasets/slurm_local.py): Debian's slurmctld, slurmd, munge (22.05).
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
slurm:
	@if command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; then \
	  if [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] && command -v sbatch >/dev/null 2>&1; then exit 0; fi; \
	fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing the Debian packages $(SLURM_PACKAGES) for the runner's Slurm tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SLURM_PACKAGES) >/dev/null) \
	    || { echo "make test: apt-get could not install $(SLURM_PACKAGES); install them and rerun" >&2; exit 1; }; \
	else \
	  echo "make test needs Slurm: run 'sudo apt-get install $(SLURM_PACKAGES)' (Debian/Ubuntu), then rerun as root (slurmd starts jobs)" >&2; \
	  exit 1; \
	fi

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

# mypy and import-linter cannot follow pyproject's package-dir mapping (faultlens.collectors =
# collectors/), so both read a tree of links laid out as the installed package is.
PARTS := collectors stream models diagnosis ui datasets
.typecheck: FORCE
	@rm -rf .typecheck && mkdir -p .typecheck/faultlens
	@for f in faultlens/*; do ln -s ../../$$f .typecheck/faultlens/; done
	@for p in $(PARTS); do ln -s ../../$$p .typecheck/faultlens/$$p; done

typecheck: $(VENV)/.installed-test .typecheck
	cd .typecheck && ../$(VENV)/bin/mypy --config-file ../pyproject.toml -p faultlens

# The floors (docs/design.md): import-linter's contracts in pyproject.toml.
floors: $(VENV)/.installed-test .typecheck
	cd .typecheck && PYTHONPATH=. ../$(VENV)/bin/lint-imports ../pyproject.toml

FORCE:

# Static checks first (seconds), then the suite.
test: chromium slurm lint typecheck floors
	$(PY) -m pytest -q --durations=20

# A real PyTorch job (DDP over gloo, virtual nodes, real faults) through the whole pipeline.
# REALJOB=--quick (8 ranks, five faults) or REALJOB= (every fault); root (PID namespaces).
REALJOB ?= --smoke
realjob: $(VENV)/.installed-test
	$(PY) benchmarks/realjob.py $(REALJOB) --workdir realjob-run

bench: $(VENV)/.installed-test
	$(VENV)/bin/faultlens bench --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache
