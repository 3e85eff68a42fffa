#!/usr/bin/env bash
# What the server alone pays for the SQL shapes a fan-out could send, without shardline:
# a scratch PostgreSQL 15 (the host's binaries, run as `postgres`, fsync off) with 500
# schemas of the example's `photos` (10 rows each), and pgbench (one client, 5 s each)
# on statement shapes over 16 and 64 of them, then on the IDs of 25 shards; then the
# same 16 shards with 100,000 rows each. Prints pgbench's average latency per shape.
# docs/benchmarks.md, "Fan-out at 2000 shards", quotes its output.
#
#   sudo bash scripts/fanout-sql-shapes.sh
#
# Everything lives in a temporary directory, removed at the end (also on failure).
set -euo pipefail
bin=/usr/lib/postgresql/15/bin
dir=$(mktemp -d /tmp/shardline-shapes.XXXXXX)
chmod 777 "${dir}"
port=55444
as_pg() { su postgres -c "$*"; }
cleanup() { as_pg "${bin}/pg_ctl -D ${dir}/data stop -m fast" >/dev/null 2>&1 || true; rm -rf "${dir}"; }
trap cleanup EXIT
as_pg "${bin}/initdb -D ${dir}/data -A trust" >/dev/null
as_pg "${bin}/pg_ctl -D ${dir}/data -o '-p ${port} -k ${dir} -c fsync=off -c max_locks_per_transaction=256' -l ${dir}/log -w start" >/dev/null
psql_() { psql -h "${dir}" -p "${port}" -U postgres -qAt "$@"; }
psql_ -c "DO \$\$ BEGIN FOR i IN 0..499 LOOP
  EXECUTE format('CREATE SCHEMA s%s; CREATE TABLE s%s.photos (id bigint PRIMARY KEY, user_id bigint NOT NULL, url text NOT NULL, caption text NOT NULL DEFAULT ''''); CREATE INDEX ON s%s.photos (user_id, id DESC); INSERT INTO s%s.photos SELECT g * 1000 + %s, g, ''u'', '''' FROM generate_series(1, 10) g', i, i, i, i, i);
END LOOP; END \$\$;"
psql_ -c "VACUUM ANALYZE"

# shapes N HI: the window over N shards, as shipped (a LIMIT in each branch) and flat.
shapes() {
  python3 - "$1" "$2" "${dir}" <<'PY'
import sys
n, hi, d = int(sys.argv[1]), sys.argv[2], sys.argv[3]
cols = '"id", "user_id", "url", "caption"'
head = f"\\set lo 0\n\\set hi {hi}\n\\set n 18\n"
per = " UNION ALL ".join(f'(SELECT {cols} FROM "s{i}"."photos" WHERE "id" BETWEEN :lo AND :hi ORDER BY "id" DESC LIMIT :n)' for i in range(n))
flat = " UNION ALL ".join(f'SELECT {cols} FROM "s{i}"."photos" WHERE "id" BETWEEN :lo AND :hi' for i in range(n))
open(f"{d}/limit_each.sql", "w").write(head + f'SELECT * FROM ({per}) AS w ORDER BY "id" DESC LIMIT :n;\n')
open(f"{d}/flat.sql", "w").write(head + f'SELECT * FROM ({flat}) AS w ORDER BY "id" DESC LIMIT :n;\n')
shards = range(100, 125)
sets = "".join(f"\\set id{i} {5 * 1000 + i}\n" for i in shards)
union = " UNION ALL ".join(f'SELECT {cols} FROM "s{i}"."photos" WHERE "id" = ANY(ARRAY[:id{i}]::bigint[])' for i in shards)
open(f"{d}/many_union.sql", "w").write(sets + union + ";\n")
pipe = "".join(f'SELECT {cols} FROM "s{i}"."photos" WHERE "id" = ANY(ARRAY[:id{i}]::bigint[]);\n' for i in shards)
open(f"{d}/many_pipeline.sql", "w").write(sets + "\\startpipeline\n" + pipe + "\\endpipeline\n")
PY
}
run() { # SCRIPT MODE LABEL
  local avg
  avg=$(as_pg "${bin}/pgbench -h ${dir} -p ${port} -n -M $2 -c 1 -T 5 -f ${dir}/$1.sql postgres" 2>&1 | sed -n 's/^latency average = //p')
  printf '  %-68s %s\n' "$3" "${avg}"
}
for n in 16 64; do
  shapes "${n}" 100000
  echo "window over ${n} shards of 10 rows, unnamed (-M extended):"
  for round in 1 2; do
    run limit_each extended "a LIMIT in each branch (shipped), round ${round}"
    run flat extended "one flat UNION ALL, round ${round}"
  done
done
echo "get_many of one ID in each of 25 shards:"
for round in 1 2; do
  run many_union extended "one UNION ALL statement, unnamed (shipped), round ${round}"
  run many_pipeline extended "25 statements in one pipeline, unnamed, round ${round}"
  run many_pipeline prepared "25 statements in one pipeline, prepared, round ${round}"
done
psql_ -c "DO \$\$ BEGIN FOR i IN 0..15 LOOP EXECUTE format('INSERT INTO s%s.photos SELECT g * 1000 + %s, g, ''u'', '''' FROM generate_series(11, 100000) g', i, i); END LOOP; END \$\$;"
psql_ -c "VACUUM ANALYZE"
shapes 16 100000000
echo "window over 16 shards of 100,000 rows, unnamed (-M extended):"
for round in 1 2; do
  run limit_each extended "a LIMIT in each branch (shipped), round ${round}"
  run flat extended "one flat UNION ALL, round ${round}"
done
