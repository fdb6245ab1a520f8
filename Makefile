# The README's two commands: `make demo` and `make test`. Both create .venv if missing and install
# what the project needs. On the project's CPU machines `torch==2.13.0` is the CPU build already on disk;
# an unpinned torch would pull a multi-GB CUDA build. The pin lives here, not in the package metadata.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.onnxgen-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test install lint

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/onnxgen generate --prompt "What is the capital of France?"

# pytest's exit code 5 (no tests collected) is a failure, never a pass. Prints the line coverage of
# src/onnxgen and fails below the floor in pyproject.toml ([tool.coverage.report] fail_under).
test: $(STAMP)
	@$(BIN)/python -m pytest -q -p no:cacheprovider --cov=onnxgen --cov-report=term-missing; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
