# The two commands a user needs: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick docs check bench clean

# Python compiles each module the first time a process imports it and keeps the bytecode under
# .venv and src/, so pip need not compile all 19,000 files it installs, most of them modules
# nothing here imports (the install measured side by side on the 2-core machine: 126 s -> 68 s,
# 83 s -> 27 s of CPU). For that the bytecode must be written, whatever the calling shell asks.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dmsc demo

# The data layer is also tested against a real PostgreSQL server (scripts/postgres.sh starts one),
# the dashboard in Debian's headless Chromium (scripts/browser.sh installs it).
# It builds the docs first (`make docs`: a broken link fails the build).
test: docs
	DMSC_TEST_POSTGRES_URL=$$(scripts/postgres.sh) DMSC_TEST_CHROMEDRIVER=$$(scripts/browser.sh) \
	  $(BIN)/pytest -n 2 --dist loadgroup -q --durations=25

# The tests that start no processes (about a minute); `make test` runs them all.
test-quick: $(STAMP)
	$(BIN)/pytest -n 2 -q -m "not integration"

# The reference manual (docs/, mkdocs.yml) into site/. Strict: a broken link or anchor, a page left
# out of the nav or an API reference griffe cannot read fails it. Not -q: mkdocs 1.6 does not count
# the warnings it hides as failures.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

check: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python benchmarks/validate_costmodel.py
	$(BIN)/python benchmarks/estimate_speed.py
	$(BIN)/python benchmarks/gpu_compare.py
	$(BIN)/python benchmarks/planner_optimality.py
	$(BIN)/python benchmarks/sim_reproduce_cba.py
	$(BIN)/python benchmarks/sim_rmsa.py
	$(BIN)/python benchmarks/sim_scale.py
	$(BIN)/python benchmarks/pipeline_vs_torch.py
	$(BIN)/python benchmarks/transport.py
	$(BIN)/python benchmarks/gateway_load.py

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
