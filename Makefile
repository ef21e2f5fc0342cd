# The README's two commands, and the pieces they are made of. Paths are relative to this folder: from
# elsewhere, run `make -C path/to/specserve test`.
VENV ?= .venv
PY := $(VENV)/bin/python
MANIFEST ?= examples/local-fleet.yaml

.PHONY: setup run test lint crds

setup:
	./scripts/setup.sh

# The main job: a local fleet of real vLLM engines, their sidecars, Prometheus and the controller.
run: setup
	$(VENV)/bin/specserve local up $(MANIFEST)

# Everything: lint, generated files up to date, unit, integration, engine, chart and rule tests.
test: setup lint
	PATH="$(CURDIR)/.cache/bin:$$PATH" $(PY) -m pytest -q -rs --timeout=1800

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Regenerate the CRD from the pydantic models, into crds/ and the chart's copy (tests keep all three in sync).
crds:
	$(VENV)/bin/specserve crd --write crds/
	$(VENV)/bin/specserve crd --write charts/specserve/crds/
	$(VENV)/bin/specserve crd --reference > docs/crd-reference.md
