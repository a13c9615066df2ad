# make demo: install everything, then run the main job on the embedded defaults.
# make test: install everything, then run the test suite.
.PHONY: setup demo test bench bench-all

.venv/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

setup: .venv/.installed

demo: setup
	HF_HUB_OFFLINE=1 .venv/bin/conceptlens demo

test: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q

bench: setup
	HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/capture.py
	HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/kmeans.py
	HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/sae.py
	.venv/bin/python benchmarks/report.py
	HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/steer.py

bench-all: setup
	HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/run_all.py --quick
