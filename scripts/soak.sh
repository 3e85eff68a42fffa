#!/usr/bin/env bash
# The soak: the example application's workload through the repository API, with moves,
# rebalances and a migration running, under faults drawn from a seed (hosts killed,
# paused, restarted; links cut between the application and a host, the application and
# the catalog, a host and its peers; connections reset; the mover killed). At the end
# everything is healed, moves finished, gc run, and a checker compares every write's
# outcome with what the hosts hold (docs/reliability.md, "The soak").
#
#   scripts/soak.sh [MINUTES] [SEED]     # default 2 minutes, a seed drawn and printed
#
# The backend is SHARDLINE_TEST_BACKEND's (docker or local; unset: docker when an engine
# answers). Exits 1 on any violation, printing the seed and where the history is: the
# same seed replays the same schedule of faults (timing still varies with the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
minutes="${1:-2}"
case "${minutes}" in ''|*[!0-9]*) echo "soak.sh: MINUTES must be a whole number, got ${minutes}" >&2; exit 2;; esac
seconds=$(( minutes * 60 ))
# SOAK_BIN: a soak binary already built (CI passes the one `cargo test --workspace` built,
# which `cargo run -p shardline-tests` would build again with other features).
if [ -n "${SOAK_BIN:-}" ]; then
  exec "${SOAK_BIN}" "${seconds}" ${2:+"$2"}
fi
exec cargo run -q -p shardline-tests --bin soak --locked -- "${seconds}" ${2:+"$2"}
