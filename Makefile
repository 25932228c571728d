# Two commands do everything on a fresh machine:  make demo  |  make test
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	# torch first, at its pin in constraints.txt: that version resolves to the CPU wheel kept on disk
	$(VPY) -m pip install -q -c constraints.txt torch
	$(VPY) -m pip install -q -c constraints.txt -e ".[test,bench,demo]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shardlib run --nproc 4 examples/vit_digits_demo.py

test: $(STAMP)
	$(VPY) -m pytest -q

bench: $(STAMP)
	$(VPY) benchmarks/step_anatomy.py --quick
	$(VPY) benchmarks/step_anatomy.py --throughput
	$(VPY) benchmarks/step_anatomy.py --lengths sst2 --quick
	$(VPY) benchmarks/train_throughput.py --quick
	$(VPY) benchmarks/plot_train_throughput.py --out benchmarks/results/train_throughput_quick --img-dir benchmarks/results/img
	$(VPY) benchmarks/zero_memory.py --quick --dps-bytes 2 --dps 2 --rss-stages 0,3
	$(VPY) benchmarks/experts.py --quick
	$(VENV)/bin/shardlib run --nproc 2 benchmarks/pipeline.py --quick --wait-idle 0
	$(VPY) benchmarks/plan_accuracy.py --quick
	$(VPY) benchmarks/checkpoint_io.py --quick --wait-idle 0
	$(VPY) benchmarks/kernels.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
