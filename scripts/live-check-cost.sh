#!/usr/bin/env bash
# What the check every read of the repository carries costs the server
# (`AND "schema".shardline_live()`, shardline_repo::LIVE_CHECK): a scratch PostgreSQL
# 15 (the host's binaries, run as `postgres`, fsync off), one schema of the example's
# `photos` with 100,000 rows and the function as `init` makes it on a shard's own copy,
# then the get by ID with and without the check:
#   - 50,000 of each in a PL/pgSQL loop of `EXECUTE` (each parsed and planned, as an
#     unnamed statement is), three times: the server's time per statement;
#   - pgbench, one client, 5 s each, alternating, 5 rounds, unnamed (`-M extended`) and
#     kept (`-M prepared`): the paired ratio of each round (with / without).
# docs/benchmarks.md, "The live check", quotes its output.
#
#   sudo bash scripts/live-check-cost.sh
#   sudo LIVE_FN='LANGUAGE plpgsql STABLE AS $f$ BEGIN RETURN true; END $f$' bash scripts/live-check-cost.sh
#
# LIVE_FN replaces what follows `RETURNS boolean` in the function's definition (the
# losing variants the doc records).
#
# Everything lives in a temporary directory, removed at the end (also on failure).
set -euo pipefail
bin=/usr/lib/postgresql/15/bin
dir=$(mktemp -d /tmp/shardline-live.XXXXXX)
chmod 777 "${dir}"
port=55445
as_pg() { su postgres -c "$*"; }
cleanup() { as_pg "${bin}/pg_ctl -D ${dir}/data stop -m fast" >/dev/null 2>&1 || true; rm -rf "${dir}"; }
trap cleanup EXIT
as_pg "${bin}/initdb -D ${dir}/data -A trust" >/dev/null
as_pg "${bin}/pg_ctl -D ${dir}/data -o '-p ${port} -k ${dir} -c fsync=off' -l ${dir}/log -w start" >/dev/null
psql_() { psql -h "${dir}" -p "${port}" -U postgres -qAt "$@"; }
psql_ -c "CREATE SCHEMA s1;
  CREATE TABLE s1.photos (id bigint PRIMARY KEY, user_id bigint NOT NULL, url text NOT NULL, caption text NOT NULL DEFAULT '');
  INSERT INTO s1.photos SELECT g, g % 100, 'https://cdn/' || g, '' FROM generate_series(1, 100000) g;
  CREATE FUNCTION s1.shardline_live() RETURNS boolean ${LIVE_FN:-LANGUAGE sql STABLE PARALLEL SAFE RETURN true};"
psql_ -c "VACUUM ANALYZE s1.photos"

get='SELECT "id", "user_id", "url", "caption" FROM "s1"."photos" WHERE "id" ='
echo "server time per statement, parsed and planned each time (50,000 each; µs):"
for run in 1 2 3; do
  line="  run ${run}:"
  for check in "" ' AND "s1".shardline_live()'; do
    ms=$(psql_ -c '\timing on' -c "DO \$\$ DECLARE r record; BEGIN FOR i IN 1..50000 LOOP
           EXECUTE '${get//\'/\'\'} \$1${check//\'/\'\'}' INTO r USING i; END LOOP; END \$\$" \
         | sed -n 's/^Time: \([0-9.]*\) ms.*/\1/p')
    line+=$(python3 -c "import sys; print(' %s %.1f' % (sys.argv[1], float(sys.argv[2]) * 1000 / 50000))" \
      "$([ -z "${check}" ] && echo without || echo with)" "${ms}")
  done
  echo "${line}"
done

printf '\\set id random(1, 100000)\n%s :id;\n' "${get}" >"${dir}/plain.sql"
printf '\\set id random(1, 100000)\n%s :id AND "s1".shardline_live();\n' "${get}" >"${dir}/live.sql"
chmod a+r "${dir}"/*.sql
tps() {
  as_pg "${bin}/pgbench -h ${dir} -p ${port} -n -M $1 -c 1 -T 5 -f ${dir}/$2.sql postgres" 2>/dev/null \
    | sed -n 's/^tps = \([0-9.]*\) .*/\1/p'
}
for mode in extended prepared; do
  ratios=()
  for _ in 1 2 3 4 5; do
    without=$(tps "${mode}" plain)
    with=$(tps "${mode}" live)
    ratios+=("$(python3 -c "import sys; print('%.3f' % (float(sys.argv[2]) / float(sys.argv[1])))" "${without}" "${with}")")
  done
  median=$(printf '%s\n' "${ratios[@]}" | sort -n | sed -n 3p)
  echo "pgbench -M ${mode}, tps with the check / without, per round: ${ratios[*]} (median ${median})"
done
