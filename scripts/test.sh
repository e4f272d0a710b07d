#!/usr/bin/env bash
# The one test command: installs what it needs on a fresh Debian machine that has only
# the Rust toolchain, then runs every level: cargo test, ctest (C++ against the C ABI),
# pytest (Python through ctypes), and the demo as an end-to-end check.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# Each step says how long the one before it took (where the ~15 minutes go).
step() {
  [ -n "${STEP_AT:-}" ] && printf '    (%s: %d s)\n' "$STEP_NAME" $((SECONDS - STEP_AT))
  STEP_AT=$SECONDS STEP_NAME=$*
  printf '\n==> %s\n' "$*"
}

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

step "cargo fmt --check; cargo clippy -D warnings (default and cuda features, every target); cargo doc without warnings"
if command -v rustup >/dev/null; then rustup component add rustfmt clippy >/dev/null 2>&1 || true; fi
cargo fmt --check
cargo clippy --release --all-targets -- -D warnings
cargo clippy --release --features cuda --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet
# The import graph of src/ (rooms on floors, lowest first): no arrow runs back up and no
# circle (the last one, optim <-> ckpt, went with the save hook and key names moving into optim).
python3 scripts/import_graph.py --max-back 0 --max-circles 0

step "cargo test (Rust unit, integration and oracle tests; header freshness)"
cargo test --release --all-targets

step "cmake build + ctest (C++17 tests of the C ABI, find_package(fo) consumer)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)"
ctest --test-dir build --output-on-failure

step "NVRTC 12 and 13 compile the GPU kernels to PTX for sm_80 and sm_90 (--fmad=false, no warnings; no GPU needed)"
# The pinned wheels: CUDA 12's, and CUDA 13's at the version torch 2.15's cu13 wheels pin
# (its only file layout: site-packages/nvidia/cu13/lib/libnvrtc.so.13).
NVRTC_SITE="${HOME}/.cache/fo/nvrtc-12.8.93"
NVRTC12_SO="$NVRTC_SITE/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
[ -f "$NVRTC12_SO" ] ||
  .venv/bin/python -m pip install -q --target "$NVRTC_SITE" nvidia-cuda-nvrtc-cu12==12.8.93
NVRTC13_SITE="${HOME}/.cache/fo/nvrtc-13.2.86"
NVRTC13_SO="$NVRTC13_SITE/nvidia/cu13/lib/libnvrtc.so.13"
[ -f "$NVRTC13_SO" ] ||
  .venv/bin/python -m pip install -q --no-deps --target "$NVRTC13_SITE" nvidia-cuda-nvrtc==13.2.86
.venv/bin/python scripts/nvrtc_check.py "$NVRTC12_SO"
.venv/bin/python scripts/nvrtc_check.py "$NVRTC13_SO"
# The kernels' machine code for sm_90, read without a GPU (cuobjdump + nvdisasm from PyPI,
# 5.5 MB): the static counts docs/gpu.md quotes, and python/tests/test_kernel_sass.py's input.
CUDA_TOOLS_SITE="${HOME}/.cache/fo/cuda-tools-13.5.37"
[ -x "$CUDA_TOOLS_SITE/nvidia/cu13/bin/nvdisasm" ] ||
  .venv/bin/python -m pip install -q --no-deps --target "$CUDA_TOOLS_SITE" \
    nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37
.venv/bin/python scripts/kernel_sass.py "$NVRTC13_SO" --tools "$CUDA_TOOLS_SITE/nvidia/cu13/bin"
export FO_TEST_NVRTC13_LIBRARY="$NVRTC13_SO"

step "pytest (Python ctypes binding and examples)"
export FO_LIBRARY="$ROOT/target/release/libfo.so"
.venv/bin/python -m pytest -q python/tests

step "torch venv (torch==2.15.0 from PyPI, cached in \${FO_TORCH_VENV:-~/.cache/fo/torch-venv})"
TORCH_VENV="${FO_TORCH_VENV:-$HOME/.cache/fo/torch-venv}"
if [ -x "$TORCH_VENV/bin/python" ] && ver=$("$TORCH_VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
  echo "reusing $TORCH_VENV (torch $ver)"
else
  t0=$(date +%s)
  rm -rf "$TORCH_VENV"
  mkdir -p "$(dirname "$TORCH_VENV")"
  python3 -m venv "$TORCH_VENV"
  "$TORCH_VENV/bin/python" -m pip install -q --upgrade pip
  "$TORCH_VENV/bin/python" -m pip install -q torch==2.15.0 -r python/requirements-test.txt
  echo "installed torch into $TORCH_VENV in $(( $(date +%s) - t0 ))s"
fi
"$TORCH_VENV/bin/python" -m pip install -q -r python/requirements-test.txt -r python/requirements-torch.txt

step "NCCL where torch's wheel puts it (site-packages/nvidia/nccl/lib/libnccl.so.2): fo finds the loaded copy and calls ncclGetVersion (no GPU needed; again with the cuda feature at the end)"
NCCL_SO=$(find "$TORCH_VENV" -path '*/nvidia/nccl/lib/libnccl.so.2' -print -quit 2>/dev/null || true)
if [ -z "$NCCL_SO" ]; then # a torch without the NCCL wheel: the pinned wheel, cached
  NCCL_SITE="${HOME}/.cache/fo/nccl-2.32.3"
  [ -f "$NCCL_SITE/nvidia/nccl/lib/libnccl.so.2" ] ||
    .venv/bin/python -m pip install -q --no-deps --target "$NCCL_SITE" nvidia-nccl-cu12==2.32.3
  NCCL_SO="$NCCL_SITE/nvidia/nccl/lib/libnccl.so.2"
fi
FO_TEST_NCCL_LIBRARY="$NCCL_SO" cargo test --release --lib comm::nccl_lib

step "pytest with torch (fo.torch optimizers, FSDP2 + CPUOffloadPolicy on gloo, DCP resharding, every torch test)"
OMP_NUM_THREADS=1 "$TORCH_VENV/bin/python" -m pytest -q python/tests

step "fuzz: 20 s per cargo-fuzz target (header, load) from the committed seed corpus"
# Stable toolchain: RUSTC_BOOTSTRAP=1 lets it take cargo-fuzz's -Z flags. No sanitizer here
# (a quick build; panics, aborts, hangs and OOM are still caught); scripts/fuzz.sh runs long
# fuzzing with AddressSanitizer. New inputs go to a scratch dir, not fuzz/corpus/.
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
# Built first, so a target that does not compile is reported as such, not as a crash.
(cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz build --release -s none --target-dir target/quick) \
  || { echo "the fuzz targets do not build (fuzz/src/lib.rs follows the library's API)" >&2; exit 1; }
fuzz_scratch=$(mktemp -d)
for t in header load; do
  mkdir -p "$fuzz_scratch/$t"
  if ! (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run --release -s none --target-dir target/quick "$t" \
        "$fuzz_scratch/$t" "corpus/$t" -- -max_total_time=20 -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1) >"$fuzz_scratch/$t.log" 2>&1; then
    tail -n 60 "$fuzz_scratch/$t.log"
    echo "fuzz target $t found a crash: see fuzz/artifacts/$t/" >&2
    exit 1
  fi
  grep -E "stat::number_of_executed_units|^Done" "$fuzz_scratch/$t.log" | sed "s/^/$t: /"
done
rm -rf "$fuzz_scratch"

step "the README's main job: fo demo"
cargo run --release --bin fo -- demo

# Last, so it is built once: cargo rebuilds the cdylib and the binary (their file names
# carry no feature hash) whenever the features change, and every step above uses the
# default build (target/release/libfo.so for pytest and cmake).
step "cargo test --features cuda: every unit test of the cuda build, NVRTC through fo's own search and launch code (FO_NVRTC_LIBRARY, a loaded copy, the wheels' site-packages layout, the library path; the embedded kernels compile for sm_80/sm_90 with NVRTC 12 and 13), the NCCL path refusing clearly without a GPU and found in torch's wheel (no GPU needed)"
LD_LIBRARY_PATH="$NVRTC_SITE/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  FO_TEST_NVRTC12_LIBRARY="$NVRTC12_SO" FO_TEST_NVRTC13_LIBRARY="$NVRTC13_SO" \
  FO_TEST_NCCL_LIBRARY="$NCCL_SO" \
  cargo test --release --features cuda --lib --test comm_nccl
step "all tests passed (in $SECONDS s)"
