#!/usr/bin/env bash
# The one test command: installs what it needs on a fresh Debian machine that has only
# the Rust toolchain, then runs every level: cargo test, ctest (C++ against the C ABI),
# pytest (Python through ctypes), and the demo as an end-to-end check.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
step() { printf '\n==> %s\n' "$*"; }

step "system tools (cmake, g++, nlohmann-json, python3-venv)"
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
[ -f /usr/include/nlohmann/json.hpp ] || missing+=(nlohmann-json3-dev)
command -v python3 >/dev/null || missing+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

step "python venv (.venv) with numpy, safetensors, pytest, ml_dtypes"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -r python/requirements-test.txt

step "cargo test (Rust unit, integration and oracle tests; header freshness)"
cargo test --release --all-targets

step "cargo test --features cuda (the NCCL path builds without CUDA and refuses clearly)"
cargo test --release --features cuda --test comm_nccl

step "cmake build + ctest (C++17 tests of the C ABI, find_package(fo) consumer)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)"
ctest --test-dir build --output-on-failure

step "NVRTC compiles the GPU kernels to PTX for sm_80 and sm_90 (--fmad=false, no warnings; no GPU needed)"
NVRTC_SITE="${HOME}/.cache/fo/nvrtc-12.8.93"
[ -f "$NVRTC_SITE/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ] ||
  .venv/bin/python -m pip install -q --target "$NVRTC_SITE" nvidia-cuda-nvrtc-cu12==12.8.93
.venv/bin/python scripts/nvrtc_check.py "$NVRTC_SITE/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"

step "pytest (Python ctypes binding and examples)"
export FO_LIBRARY="$ROOT/target/release/libfo.so"
.venv/bin/python -m pytest -q python/tests

step "the README's main job: fo demo"
cargo run --release --bin fo -- demo
step "all tests passed"
