#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer) of every parser of outside input:
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]     # default 30
#
# Targets (fuzz/fuzz_targets/): id_parsers (decimal, compact, JSON, BIGINT bytes, any
# layout), config_loader (the TOML config), connection_urls (sslmode/sslrootcert and
# redaction). Installs cargo-fuzz if missing. Builds with debug assertions, so integer
# overflow is a crash. libFuzzer needs nightly features: RUSTC_BOOTSTRAP=1 lets the one
# stable toolchain here provide them. Exits non-zero on the first crash; the input is
# kept under fuzz/artifacts/<target>/ and `cargo fuzz run -a <target> <file>` replays it.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-30}"
export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz
fi
cd fuzz
cargo fuzz build -a
for target in id_parsers config_loader connection_urls; do
  echo "fuzz: ${target} for ${seconds} s"
  log="target/fuzz-${target}.log"
  mkdir -p target
  status=0
  cargo fuzz run -a "${target}" -- -max_total_time="${seconds}" >"${log}" 2>&1 || status=$?
  grep -E '^Done [0-9]+ runs|panicked|SUMMARY|left:|right:' "${log}" || true
  if [ "${status}" -ne 0 ]; then
    tail -n 40 "${log}" >&2
    echo "fuzz: ${target} crashed (input under fuzz/artifacts/${target}/)" >&2
    exit 1
  fi
done
