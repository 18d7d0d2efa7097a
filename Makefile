# geo3k-rl: `make test` and `make train` install the pinned CPU stack into .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# SGLang 0.5.23's released source, unpacked from its wheel (read by tests/test_sglang_real.py,
# never installed): fetched once, git-ignored.
SGLANG_SRC := .cache/sglang-0.5.23

# Some machines set PYTHONDONTWRITEBYTECODE: with the install's --no-compile, every process
# (test workers, the multi-process tests' children) would then compile torch from source again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install sglang-src test test-fast test-all train train-jax train-quick train-quick-jax clean

install: $(STAMP)

$(STAMP): requirements-cpu.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Every pip call carries the pins as constraints: an unpinned torch would pull a CUDA build.
	# --no-compile: Python compiles a module when it is first imported and caches it (about
	# 80 s of the install went to compiling every file of torch, jax and transformers, most
	# never imported).
	$(PY) -m pip install -q --no-compile -c requirements-cpu.txt -r requirements-cpu.txt
	$(PY) -m pip install -q --no-compile -c requirements-cpu.txt --no-build-isolation -e .
	touch $(STAMP)

# The tests also need requirements-test.txt (trl, for Qwen's published chat templates; libtpu, the
# TPU compiler of `python -m geo3k_jax.aot`).
$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(PY) -m pip install -q --no-compile -c requirements-cpu.txt -c requirements-test.txt -r requirements-test.txt
	touch $(TEST_STAMP)

# scripts/fetch_sglang.py downloads the wheel (pip download --no-deps, about 40 MB, a few
# seconds) and unpacks it with msgspec beside it; the folder appears only once complete, so an
# existing one is never fetched again (make clean removes it: its msgspec is built for .venv's
# Python).
sglang-src: $(SGLANG_SRC)

$(SGLANG_SRC): | $(STAMP)
	$(PY) scripts/fetch_sglang.py $@

# Two workers (pytest-xdist), one test file each at a time: the suite's modules build their own
# fixtures, so a file never splits across workers. `test` leaves out the `heavy` runs (end-to-end
# runs of minutes; the 8-device and multi-process equivalence runs, a minute each); `test-all`
# runs them too; `test-fast` leaves out every test over a few seconds.
test: $(TEST_STAMP) $(SGLANG_SRC)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 -m "not heavy" tests

test-fast: $(TEST_STAMP) $(SGLANG_SRC)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not heavy" tests

test-all: $(TEST_STAMP) $(SGLANG_SRC)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests

# The CPU default: GRPO makes a tiny Qwen3-VL, pretrained on the task's labels, answer from the figures and use the
# feedback; its held-out accuracy rises past chance and elimination (docs/results.md): 40-55 min on one core with the
# torch learner, the first time including the 9-minute build of the tiny checkpoint.
train: install
	$(PY) -m geo3k_torch.main --config=configs/cpu_perception.py

train-jax: install
	$(PY) -m geo3k_jax.train --config=configs/cpu_perception.py

# The quick run: every piece of the loop in about 2 minutes; the tiny model learns the tool-call
# protocol, not the figures (its accuracy stays at chance).
train-quick: install
	$(PY) -m geo3k_torch.main --config=configs/cpu.py

train-quick-jax: install
	$(PY) -m geo3k_jax.train --config=configs/cpu.py

clean:
	rm -rf $(VENV) $(SGLANG_SRC) runs build *.egg-info
