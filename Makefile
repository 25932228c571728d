# Two commands do everything on a fresh machine:  make demo  |  make test
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	# torch first, pinned exactly: this pin resolves to the CPU wheel kept on disk
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -c constraints.txt -e ".[test,bench,demo]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shardlib run --nproc 4 examples/vit_digits_demo.py

test: $(STAMP)
	$(VPY) -m pytest -q

bench: $(STAMP)
	$(VPY) benchmarks/tp_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
