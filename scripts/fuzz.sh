#!/usr/bin/env bash
# Fuzzes fo's checkpoint parsers and loader with cargo-fuzz (libFuzzer + AddressSanitizer).
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     default: 600 s, targets header load
# Only a stable toolchain is needed: RUSTC_BOOTSTRAP=1 lets it accept the -Z flags
# cargo-fuzz passes. New inputs go to a scratch corpus (fuzz/corpus/ stays the small,
# committed seed set); a crash is saved under fuzz/artifacts/<target>/ and fails the run.
# Prints each target's executions per second from libFuzzer's final stats.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-600}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(header load)
export RUSTC_BOOTSTRAP=1
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
cargo fuzz build --release
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t"
  log="$scratch/$t.log"
  echo "==> fuzzing $t for ${secs}s"
  if ! cargo fuzz run --release "$t" "$scratch/$t" "corpus/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz target $t FAILED: see fuzz/artifacts/$t/" >&2
    exit 1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  rate=$(grep -o 'exec/s: [0-9]*' "$log" | tail -n 1 | grep -o '[0-9]*$' || echo 0)
  echo "$t: $runs executions in ${secs}s (last reported ${rate} exec/s), 0 crashes"
done
