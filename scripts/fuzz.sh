#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer, through libfuzzer-sys) of every parser of outside
# input:
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]     # default 30
#   scripts/fuzz.sh --replay TARGET FILE     # runs one input again, e.g. a crash's
#
# Targets (fuzz/fuzz_targets/): id_parsers (decimal, compact, JSON, BIGINT bytes, any
# layout), config_loader (the TOML config), connection_urls (sslmode/sslrootcert and
# redaction).
#
# It builds the targets as `cargo fuzz build -a` does (release, debug assertions on so
# integer overflow is a crash, AddressSanitizer, libFuzzer's coverage), with cargo
# itself: installing cargo-fuzz cost CI about a minute and a half on a fresh machine.
#
# FUZZ_SANITIZER=none (CI's choice) builds without AddressSanitizer and its debug info, at
# opt-level 1, as `cargo fuzz build -s none` would: 70 s instead of 135 s (opt-level 1 with
# it) or 183 s (as above) on a 2-core machine (observed). Every crate the targets fuzz
# forbids `unsafe` (`unsafe_code = "forbid"` in the workspace's lints), so what the
# sanitizer alone would catch is in the dependencies; a panic, an overflow (debug
# assertions stay on) or a wrong round trip is found either way. Fuzz for real without it.
# The flags are cargo-fuzz 0.12's (src/project.rs); `cargo fuzz run -a TARGET` works on
# the same fuzz/ directory for whoever has it. libFuzzer needs nightly features:
# RUSTC_BOOTSTRAP=1 lets the one stable toolchain here provide them. Exits non-zero on
# the first crash; the input is kept under fuzz/artifacts/<target>/.
set -euo pipefail
replay=""
if [ "${1:-}" = "--replay" ]; then
  [ $# -eq 3 ] || { echo "usage: scripts/fuzz.sh --replay TARGET FILE" >&2; exit 2; }
  [ -f "$3" ] || { echo "scripts/fuzz.sh: no file $3" >&2; exit 2; }
  # The file as given from where the script was called, before the cd below.
  replay=$(realpath "$3")
else
  seconds="${1:-30}"
  case "${seconds}" in
    ''|*[!0-9]*|0) echo "scripts/fuzz.sh: seconds per target must be a whole number above 0, not '${seconds}'" >&2; exit 2 ;;
  esac
fi
cd "$(dirname "$0")/../fuzz"
export RUSTC_BOOTSTRAP=1
triple=$(rustc -vV | sed -n 's/^host: //p')
flags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cllvm-args=-simplifycfg-branch-fold-threshold=0 \
--cfg fuzzing -Clink-dead-code -Cllvm-args=-sanitizer-coverage-stack-depth -Cdebug-assertions"
case "${FUZZ_SANITIZER:-address}" in
  address)
    export RUSTFLAGS="${flags} -Zsanitizer=address -Ccodegen-units=1"
    export ASAN_OPTIONS="${ASAN_OPTIONS:+${ASAN_OPTIONS}:}detect_odr_violation=0"
    profile=(--config profile.release.debug=true)
    target_dir=target ;;
  none)
    export RUSTFLAGS="${flags}"
    profile=(--config profile.release.opt-level=1)
    target_dir=target/no-sanitizer ;;
  *) echo "scripts/fuzz.sh: FUZZ_SANITIZER must be address or none, not '${FUZZ_SANITIZER}'" >&2; exit 2 ;;
esac
echo "fuzz: sanitizer ${FUZZ_SANITIZER:-address}"
# --target: the flags then reach the targets and not the build scripts.
cargo build --locked --release "${profile[@]}" --target "${triple}" --target-dir "${target_dir}" --bins
bin="${target_dir}/${triple}/release"

if [ -n "${replay}" ]; then
  exec "${bin}/$2" "${replay}"
fi
# The targets fuzz side by side (three libFuzzer processes, one thread each, on the
# machine's cores), then each is judged in turn; a failure stops those still running.
targets=(id_parsers config_loader connection_urls)
for target in "${targets[@]}"; do
  [ -x "${bin}/${target}" ] || { echo "fuzz: ${bin}/${target} was not built" >&2; exit 1; }
done
stop_the_rest() { local left; left=$(jobs -p); [ -z "${left}" ] || { kill ${left} 2>/dev/null || true; wait ${left} 2>/dev/null || true; }; }
declare -A pids=()
for target in "${targets[@]}"; do
  echo "fuzz: ${target} for ${seconds} s"
  mkdir -p "corpus/${target}" "artifacts/${target}" target
  "${bin}/${target}" -artifact_prefix="artifacts/${target}/" -max_total_time="${seconds}" \
    "corpus/${target}" >"target/fuzz-${target}.log" 2>&1 &
  pids[${target}]=$!
done
for target in "${targets[@]}"; do
  log="target/fuzz-${target}.log"
  status=0
  wait "${pids[${target}]}" || status=$?
  echo "fuzz: ${target}"
  grep -E '^Done [0-9]+ runs|panicked|SUMMARY|left:|right:' "${log}" || true
  if [ "${status}" -ne 0 ]; then
    tail -n 40 "${log}" >&2
    stop_the_rest
    echo "fuzz: ${target} crashed (input under fuzz/artifacts/${target}/; replay: ${FUZZ_SANITIZER:+FUZZ_SANITIZER=${FUZZ_SANITIZER} }scripts/fuzz.sh --replay ${target} FILE)" >&2
    exit 1
  fi
  # libFuzzer ends a run of -max_total_time with "Done N runs": without it, nothing ran.
  grep -qE '^Done [0-9]+ runs' "${log}" || { tail -n 20 "${log}" >&2; stop_the_rest; echo "fuzz: ${target} did not run" >&2; exit 1; }
done
