//! The SQL that mints IDs inside a shard schema, rendered from a [`Layout`].
//!
//! [`ShardSql::install`] creates, in one schema (idempotently):
//!
//! - `shardline_id_seq`, the shard's sequence. Its value is
//!   `(ms since epoch << sequence_bits) | counter`: one `nextval` carries both the time
//!   and the sequence fields, never repeats and never goes back.
//! - `shardline_catch_up_due`, the shard's catch-up backoff (below): not data, and not
//!   granted to application roles.
//! - `next_id()`, for `DEFAULT next_id()`: a PL/pgSQL function of one expression (the
//!   planner sees one function call; its plan is cached per session). When this session
//!   holds a lease (below) valid at the transaction's start (`now()`), it takes `nextval`
//!   and composes the ID; otherwise it calls `shardline_catch_up()`.
//! - `shardline_catch_up()`: the slow path. It catches the sequence up to the
//!   transaction's start when it lags, only forward, while no other transaction can take
//!   a value (see below), mints, and grants the session a lease. It reads the two
//!   sequences and calls [`CATCH_UP_FUNCTION`], made once per database by [`host_install`] (part of
//!   the install), which does the work for every schema: a session compiles and plans
//!   it once, not once per schema it inserts into.
//! - `id_parts(bigint)`: the decoder, `(unix_ms, shard, sequence)`.
//! - `reserve_ids(n)`: `n` values of the same sequence, as ranges, for minting in the
//!   application ([`crate::generator::ReservedBlocks`]).
//!
//! # Why catching up cannot duplicate
//!
//! Postgres has no compare-and-set on a sequence: `setval` after reading `last_value`
//! races with concurrent `nextval`s. So the catch-up first takes the sequence's
//! `SHARE ROW EXCLUSIVE` lock (by a no-op `ALTER SEQUENCE ... OWNED BY NONE`, which does
//! not rewrite the sequence). That lock conflicts with the `ROW EXCLUSIVE` lock every
//! `nextval` takes and holds to the end of its transaction, so once it is granted no
//! other transaction has taken or can take a value: `last_value` is exact, and `setval`
//! moves the sequence forward only. Every ID is a `nextval`, so IDs are unique and, in
//! the order `nextval` handed them out, increasing. The lock is taken in a
//! subtransaction that is then rolled back, which releases it at once (the
//! non-transactional `setval` stays). It waits at most [`CATCH_UP_LOCK_TIMEOUT_MS`] for
//! minting transactions to finish, then gives way: the ID comes from the lagging
//! sequence (unique, just older).
//!
//! # Why IDs stay fresh under concurrency
//!
//! The catch-up must not wait while its own transaction holds nextval's lock: two such
//! transactions wait for each other (a deadlock), and with many clients arriving after
//! an idle gap all of them did, gave way, and minted stale IDs for seconds (issue 21).
//! So `next_id()` decides before it takes a value:
//!
//! - **Lease.** The slow path, having minted `v` at most `max_lag_ms` behind `now()`,
//!   sets the session's `shardline.lease_<schema>` to `(v >> sequence_bits) +
//!   max_lag_ms`. Any later `nextval` is above `v`, so while `now()` (in ms since the
//!   epoch) is at most the lease, the fast path's ID is at most `max_lag_ms` behind
//!   `now()`. The lease is about freshness only; uniqueness never depends on it.
//! - **Catching up without holding nextval's lock.** The slow path reads `last_value`
//!   with a plain `SELECT` (`ACCESS SHARE`: waits for no one). When it lags by more than
//!   half the bound, one session at a time (`pg_try_advisory_xact_lock` on the
//!   sequence's OID) catches up as above; the others wait for it on the same advisory
//!   key in shared mode (granted to all at once when it ends), not on the sequence one
//!   by one. A one-statement transaction reaches the slow path before it took any value,
//!   so it holds no `ROW EXCLUSIVE` lock while it waits. A transaction that already took
//!   a value here (the slow path marks it in the transaction-local
//!   `shardline.minted_<schema>`) holds that lock: it neither catches up nor waits for
//!   one, it mints from the sequence as it is.
//! - **Giving way.** A catch-up that gives way while the lag is under half the bound
//!   costs nothing (the value is still within it), and the next slow path tries again.
//!   Only when a catch-up a session made or waited for left its value beyond the bound
//!   does the shard stop trying: until the clock's next multiple of
//!   [`CATCH_UP_RETRY_MS`] after the first such failure, doubling with each failure in a
//!   row up to [`CATCH_UP_RETRY_MAX_MS`] (so an open transaction that minted long ago
//!   does not stall every statement on the lock, and a short stall costs a short lag).
//!   That state is the shard's, in its own small sequence (`shardline_catch_up_due`, set
//!   with `setval`: no lock that another `setval` or a reader waits for, and kept when a
//!   transaction aborts), so
//!   one failed attempt holds off every session of the shard, and a success resets it.
//!   The values minted meanwhile do not push the next attempt back: before issue 21's
//!   second round they did (the state was then each session's), so a session that kept
//!   inserting after one failed catch-up never tried again, and a 32-session burst in CI
//!   minted 1,888 of 5,760 IDs up to 1.2 s behind.
//!
//! So an ID is more than `max_lag_ms` behind its transaction's start only when the
//! catch-up could not get the sequence's lock: another transaction that minted from the
//! shard stayed open (or unscheduled) longer than [`CATCH_UP_LOCK_TIMEOUT_MS`] past the
//! moment the sequence fell half the bound behind, or the caller's own transaction had
//! minted before. The fast path takes no lock beyond `nextval`'s own, so a move's fence
//! (which takes the same `SHARE ROW EXCLUSIVE` lock and caps `MAXVALUE`) still waits for
//! every minting transaction, and `nextval` past a capped `MAXVALUE` fails.
//!
//! # The price of the wait
//!
//! While a catch-up waits for the sequence's lock, new `nextval`s on the shard queue
//! behind it. So a transaction that minted and stays open stalls the shard's inserts for
//! up to [`CATCH_UP_LOCK_TIMEOUT_MS`] once per catch-up attempt: every `max_lag_ms / 2`
//! under steady load; after failed ones, on the multiples of the backoff, which doubles
//! from [`CATCH_UP_RETRY_MS`] to [`CATCH_UP_RETRY_MAX_MS`] while they keep failing,
//! for every session of the shard. The wait was 20 ms
//! until the idle-burst test, run on the container backend
//! while two builds starved the containers of CPU, saw most catch-ups fail: 4,126 of
//! 5,760 IDs of a 32-session burst more than 100 ms behind, the worst 2 s. At 200 ms the
//! same run had 460–559 late, the worst 311–373 ms (observed, `SHARDLINE_TEST_BACKEND=
//! docker cargo test -p shardline-tests --test it -- after_an_idle_gap`). It stays below
//! Postgres's default `deadlock_timeout` (1 s), so the catch-up gives way before a
//! deadlock check could abort anyone else's transaction.

use crate::{Error, Layout, Result};

/// How far the sequence may lag the transaction's start before `next_id()` catches it
/// up, by default: at most one catch-up per 100 ms under steady load.
pub const DEFAULT_MAX_LAG_MS: i64 = 100;

/// How long a catch-up waits for other minting transactions to finish, in ms. Below
/// Postgres's default `deadlock_timeout` (1 s): see the module doc for its price.
pub const CATCH_UP_LOCK_TIMEOUT_MS: i64 = 200;

/// How long a session waits for another session's catch-up to end, in ms: that one waits
/// at most [`CATCH_UP_LOCK_TIMEOUT_MS`] for its lock, so this is only ever reached when
/// it was descheduled.
pub const CATCH_UP_WAIT_TIMEOUT_MS: i64 = 1000;

/// The minter's functions in a shard's schema that run under their caller's
/// `search_path` by design: `next_id()` is on every insert's path, where a `SET` clause
/// would cost a settings change per call, and every name it calls is qualified. Every
/// other PL/pgSQL function it installs sets its own.
pub const ON_CALLERS_PATH: &[&str] = &["next_id"];

/// The high 32 bits of the advisory lock key that serializes catch-ups of one shard (the
/// low 32 bits are the sequence's OID): `SHLN` in ASCII.
pub const ADVISORY_LOCK_CLASS: i64 = 0x5348_4c4e;

/// After a catch-up a session made or waited for could not get its lock, how long the
/// shard's sessions mint from the lagging sequence before one tries again, in ms (to the
/// clock's next multiple of this). It doubles with each failure in a row, up to [`CATCH_UP_RETRY_MAX_MS`], and
/// starts over after a fresh ID.
pub const CATCH_UP_RETRY_MS: i64 = 100;

/// The longest a shard waits between catch-up attempts that keep failing, in ms: then a
/// transaction that minted and stays open stalls the shard's inserts for
/// [`CATCH_UP_LOCK_TIMEOUT_MS`] in every 1.6 s, an eighth of the time (more while the
/// backoff grows).
pub const CATCH_UP_RETRY_MAX_MS: i64 = 1600;

/// The backoff's last step: [`CATCH_UP_RETRY_MS`] doubled `CATCH_UP_MAX_STEP - 1` times
/// is [`CATCH_UP_RETRY_MAX_MS`]. The step is kept in the due sequence's 3 low bits.
const CATCH_UP_MAX_STEP: u32 = (CATCH_UP_RETRY_MAX_MS / CATCH_UP_RETRY_MS).ilog2() + 1;
const _: () = assert!(
    CATCH_UP_RETRY_MS > 0
        && CATCH_UP_RETRY_MS << (CATCH_UP_MAX_STEP - 1) == CATCH_UP_RETRY_MAX_MS
        && CATCH_UP_MAX_STEP <= 7,
    "the catch-up's backoff doubles from CATCH_UP_RETRY_MS to CATCH_UP_RETRY_MAX_MS in at most 7 steps"
);

/// The largest `n` one `reserve_ids(n)` call hands out.
pub const MAX_RESERVE: i32 = 1_000_000;

/// The schema of the minter's parts shared by every shard schema of a database.
pub const SHARED_SCHEMA: &str = "shardline_minter";

/// The catch-up shared by every shard schema of a database, with its argument types
/// (versioned: a change gets a new name, so installs never replace it under a running
/// one). Each schema's `shardline_catch_up()` calls it with the schema's sequence and
/// constants.
pub const CATCH_UP_FUNCTION: &str = "shardline_minter.catch_up_v3";

/// `CATCH_UP_FUNCTION`'s argument types, as `to_regprocedure` wants them.
const CATCH_UP_ARGS: &str =
    "regclass, regclass, bigint, bigint, text, integer, integer, bigint, bigint, bigint, bigint";

/// The SQL that makes the minter's shared parts in a database when they are missing:
/// the schema [`SHARED_SCHEMA`] (usable by every role) and the catch-up
/// [`CATCH_UP_FUNCTION`]. [`ShardSql::install`] includes it. Safe to run from many
/// sessions at once: one makes them, the others find them made, or wait for that
/// session's transaction and then find them. So run it on its own (its own short
/// transaction) before installs that run in long transactions beside each other, as
/// `init`, `migrate` and moves do: otherwise they wait for the first one's whole
/// transaction, under its `lock_timeout`.
///
/// It refuses (SQLSTATE 42501) a schema [`SHARED_SCHEMA`], or a catch-up function in it
/// (any version and overload: `catch_up_v*`), owned by
/// a role that may not act as the current one (`pg_has_role(owner, current_user,
/// 'MEMBER')`: itself, a superuser, a member of it), and refuses to make the function
/// when a shard's wrapper is owned by a role the current one may not act as: each
/// schema's wrapper runs the function as the wrapper's owner, so whoever controls the
/// function (or its schema) runs code with that owner's rights. Install every shard of a
/// database as the same role.
///
/// The function is `SECURITY INVOKER`: it alters, reads and sets the sequence it is given
/// with its caller's rights. Each schema's `shardline_catch_up()` is `SECURITY DEFINER`
/// (its owner owns the sequence) and is the only caller shardline makes; a role that
/// calls it directly can do no more than its own rights allow.
pub fn host_install() -> String {
    format!(
        r#"DO $shardline_minter$
DECLARE
    untrusted text;
    schema_owner oid;
BEGIN
    -- A schema there already: its owner first (to_regprocedure needs USAGE on it). See
    -- the last check for why.
    SELECT nspowner INTO schema_owner FROM pg_namespace WHERE nspname = '{SHARED_SCHEMA}';
    IF schema_owner IS NOT NULL AND NOT pg_has_role(schema_owner, current_user, 'MEMBER') THEN
        RAISE EXCEPTION 'schema {SHARED_SCHEMA} is owned by %, a role that may not act as %: shardline will not run its functions (install every shard of a database as the same role)', schema_owner::regrole, current_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF to_regprocedure('{catch_up_fn}({CATCH_UP_ARGS})') IS NULL THEN
        -- Every shard's SECURITY DEFINER wrapper (beside the shard's sequence, owned by
        -- the same role; not in a session's temporary schema) will run what is made here
        -- as its owner: make it only as a role that may act as each of them.
        SELECT string_agg(DISTINCT p.proowner::regrole::text, ', ') INTO untrusted
        FROM pg_proc AS p
        JOIN pg_namespace AS n ON n.oid = p.pronamespace
        JOIN pg_class AS c ON c.relnamespace = p.pronamespace AND c.relname = 'shardline_id_seq'
            AND c.relkind = 'S' AND c.relowner = p.proowner
        WHERE p.proname = 'shardline_catch_up' AND p.prosecdef
            AND n.nspname !~ '^pg_(toast_)?temp_'
            AND NOT pg_has_role(current_user, p.proowner, 'MEMBER');
        IF untrusted IS NOT NULL THEN
            RAISE EXCEPTION '{catch_up_fn} is missing, and % may not make it: the minters of role(s) % would run it as their own; run this as one of them (install every shard of a database as the same role)', current_user, untrusted
                USING ERRCODE = 'insufficient_privilege';
        END IF;
        BEGIN
            IF to_regnamespace('{SHARED_SCHEMA}') IS NULL THEN
                CREATE SCHEMA {SHARED_SCHEMA} AUTHORIZATION CURRENT_USER;
                GRANT USAGE ON SCHEMA {SHARED_SCHEMA} TO PUBLIC;
            END IF;
            -- `read` is the sequence's last value as the caller read it with a plain
            -- SELECT (an ACCESS SHARE lock: it waits for no one and blocks no one).
            -- pg_sequence_last_value() would take nextval's ROW EXCLUSIVE lock for the
            -- rest of the transaction, and a session waiting below for another's
            -- catch-up must not hold it: that catch-up waits for every holder.
            -- `due` is the shard's catch-up state as the caller read it from `due_seq`
            -- (the same way): 0, or (the clock's ms before which no session of the
            -- shard tries again) * 8 + the backoff's step (1 to 5).
            CREATE FUNCTION {catch_up_fn}(seq regclass, due_seq regclass, read bigint, due bigint,
                tag text, shard integer, seq_bits integer, epoch bigint, clock_offset bigint,
                lag bigint, last_ticks bigint)
                RETURNS bigint
            LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
            DECLARE
                now_ms bigint := floor(extract(epoch FROM now()) * 1000)::bigint + clock_offset;
                now_ticks bigint := now_ms - epoch;
                -- Catch up once the sequence lags by more than half the bound, so a lease
                -- granted here is good for at least half the bound.
                catch_up_lag bigint := lag / 2;
                target bigint;
                last bigint := read;
                -- The backoff's step (0: none; k: {retry_ms} ms doubled k - 1 times), and
                -- the clock's ms before which no session of the shard tries again.
                step integer := CASE WHEN due > 0 THEN (due % 8)::integer ELSE 0 END;
                -- A due time further off than the longest backoff (plus the attempt)
                -- was not set here: ignored.
                retry_at bigint := CASE WHEN due > 0 AND due % 8 > 0 AND due / 8 <= now_ms + {retry_max_ms} + {lock_timeout}
                    THEN due / 8 END;
                backoff bigint;
                clock_ms bigint;
                attempted boolean := false;
                -- Set (transaction-local) once this transaction took a value here: it then
                -- holds nextval's ROW EXCLUSIVE lock, so it must not wait for a catch-up or
                -- do one.
                minted text := current_setting('shardline.minted_' || tag, true);
                lock_key bigint := (seq::oid::bigint) | (CAST({lock_class} AS bigint) << 32);
                v bigint;
            BEGIN
                IF now_ticks > last_ticks THEN
                    RAISE EXCEPTION 'shard %: the ID layout ends at % ms since the Unix epoch', shard, last_ticks + epoch
                        USING ERRCODE = 'numeric_value_out_of_range';
                END IF;
                target := greatest(now_ticks, 0) << seq_bits;
                IF (last >> seq_bits) < now_ticks - catch_up_lag
                    AND coalesce(minted, '') = ''
                    AND (retry_at IS NULL OR retry_at <= now_ms) THEN
                    -- This call catches up or waits for the session that does.
                    attempted := true;
                    BEGIN
                        IF pg_try_advisory_xact_lock(lock_key) THEN
                            -- This session catches up; the others wait for it below.
                            -- Every lock it waits for from here waits at most this long.
                            PERFORM set_config('lock_timeout', '{lock_timeout}ms', true);
                            -- It may take nextval's lock now (the same read; NULL while
                            -- the sequence's is_called is false, when it holds 0): no one
                            -- waits for it while it holds it.
                            last := coalesce(pg_sequence_last_value(seq), 0);
                            IF (last >> seq_bits) < now_ticks - catch_up_lag THEN
                                -- SHARE ROW EXCLUSIVE: granted once no other transaction
                                -- holds nextval's ROW EXCLUSIVE lock, and it keeps new ones
                                -- out. No rewrite: setval sticks.
                                EXECUTE format('ALTER SEQUENCE %s OWNED BY NONE', seq);
                                last := coalesce(pg_sequence_last_value(seq), 0);
                                IF target > last THEN
                                    PERFORM setval(seq, target);
                                END IF;
                            END IF;
                        ELSE
                            -- Another session is catching up: wait for it (a shared lock,
                            -- granted to every waiter at once when it ends) rather than
                            -- queue on the sequence one by one.
                            PERFORM set_config('lock_timeout', '{wait_timeout}ms', true);
                            PERFORM pg_advisory_xact_lock_shared(lock_key);
                        END IF;
                        -- Roll the subtransaction back: that releases the locks now.
                        RAISE SQLSTATE 'SLC01';
                    EXCEPTION
                        WHEN SQLSTATE 'SLC01' THEN NULL;
                        -- Another transaction that minted holds nextval's lock
                        -- (lock_timeout), or is itself catching up while holding it (a
                        -- deadlock Postgres reports): give way and mint from the lagging
                        -- sequence. Below half the bound behind, that value is still
                        -- within it, and the next call tries again.
                        WHEN lock_not_available OR deadlock_detected THEN NULL;
                    END;
                END IF;
                v := nextval(seq);
                PERFORM set_config('shardline.minted_' || tag, '1', true);
                IF attempted AND (v >> seq_bits) < now_ticks - lag THEN
                    -- Gave way (or waited for a catch-up that did): mint from the lagging
                    -- sequence for a while rather than stall every statement on the
                    -- sequence's lock. Only an attempt sets the time of the next one:
                    -- the values minted meanwhile do not push it back.
                    -- The next attempt falls on the clock's next multiple of the backoff
                    -- (the clock, not now(): the attempt itself took a while). The due
                    -- time is the shard's (its own small sequence, set with setval: no
                    -- lock anyone waits for, and kept when this transaction aborts), so
                    -- every session of the shard waits for it: one stall per backoff.
                    step := least(step + 1, {max_step});
                    backoff := ({retry_ms}::bigint) << (step - 1);
                    clock_ms := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint + clock_offset;
                    PERFORM setval(due_seq, ((clock_ms / backoff + 1) * backoff) * 8 + step);
                ELSIF step > 0 THEN
                    -- Fresh again after an attempt, or by the clock (a long transaction's
                    -- now() would call a lagging value fresh): the next failure starts the
                    -- backoff over.
                    clock_ms := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint + clock_offset;
                    IF attempted OR (v >> seq_bits) >= clock_ms - epoch - lag THEN
                        PERFORM setval(due_seq, 0);
                    END IF;
                END IF;
                -- A lease: while this session's clock (now()) is at most this, any later
                -- nextval (> v) is at most lag ms behind it, so next_id() need not look.
                IF (v >> seq_bits) >= now_ticks - lag THEN
                    PERFORM set_config('shardline.lease_' || tag, ((v >> seq_bits) + lag)::text, false);
                END IF;
                RETURN v;
            END
            $fn$;
            GRANT EXECUTE ON FUNCTION {catch_up_fn}({CATCH_UP_ARGS}) TO PUBLIC;
        EXCEPTION WHEN unique_violation OR duplicate_schema OR duplicate_function THEN
            -- Another session made them at the same time, and has committed.
            NULL;
        END;
    END IF;
    -- The checks below read the catalog in this transaction's snapshot; what another
    -- session made after it began (found above by name, outside the snapshot) they
    -- would not see. Refuse rather than pass it unchecked.
    IF (to_regnamespace('{SHARED_SCHEMA}') IS NOT NULL
            AND NOT EXISTS (SELECT FROM pg_namespace WHERE nspname = '{SHARED_SCHEMA}'))
        OR (to_regprocedure('{catch_up_fn}({CATCH_UP_ARGS})') IS NOT NULL
            AND NOT EXISTS (SELECT FROM pg_proc WHERE oid = to_regprocedure('{catch_up_fn}({CATCH_UP_ARGS})'))) THEN
        RAISE EXCEPTION 'schema {SHARED_SCHEMA} or {catch_up_fn} was made by another session after this transaction began, and cannot be checked in it: run the install again'
            USING ERRCODE = 'serialization_failure';
    END IF;
    -- Checked after making, so a schema another session made first is checked too. The
    -- schema and every catch-up function in it (each version a shard's wrapper may still
    -- call, and each overload its call could resolve to: all are named catch_up_v*) must
    -- be owned by a role that may act as this one (itself, a superuser, or a member of
    -- it): each wrapper runs the function as its owner, and whoever owns the schema or
    -- such a function could run code with that owner's rights.
    SELECT string_agg(DISTINCT owner::regrole::text, ', ') INTO untrusted FROM (
        SELECT nspowner AS owner FROM pg_namespace WHERE nspname = '{SHARED_SCHEMA}'
        UNION ALL
        -- By name first (a range of pg_proc's index on name, arguments, schema): only a
        -- catch-up function is called by a wrapper. Every shard's install runs this, so
        -- a scan of pg_proc, which grows with the shards, made `init` of 2000 shards
        -- quadratic (about 6 ms a shard at 500).
        SELECT p.proowner FROM pg_proc AS p
        WHERE p.proname >= 'catch_up_v' AND p.proname < 'catch_up_w'
          AND p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = '{SHARED_SCHEMA}')
    ) AS o WHERE NOT pg_has_role(o.owner, current_user, 'MEMBER');
    IF untrusted IS NOT NULL THEN
        RAISE EXCEPTION 'schema {SHARED_SCHEMA} or a catch-up function in it is owned by %, a role that may not act as %: shardline will not run its functions (install every shard of a database as the same role)', untrusted, current_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NOT has_schema_privilege('public', '{SHARED_SCHEMA}', 'USAGE')
        AND pg_has_role(current_user, (SELECT nspowner FROM pg_namespace WHERE nspname = '{SHARED_SCHEMA}'), 'USAGE') THEN
        GRANT USAGE ON SCHEMA {SHARED_SCHEMA} TO PUBLIC;
    END IF;
END
$shardline_minter$;"#,
        catch_up_fn = CATCH_UP_FUNCTION,
        lock_timeout = CATCH_UP_LOCK_TIMEOUT_MS,
        wait_timeout = CATCH_UP_WAIT_TIMEOUT_MS,
        lock_class = ADVISORY_LOCK_CLASS,
        retry_ms = CATCH_UP_RETRY_MS,
        retry_max_ms = CATCH_UP_RETRY_MAX_MS,
        max_step = CATCH_UP_MAX_STEP,
    )
}

/// The library the native minter's `next_id()` is in, as `CREATE FUNCTION ... LANGUAGE c`
/// names it: found in the server's `dynamic_library_path` (by default its `$libdir`).
/// Built from `crates/id/native/shardline_minter.c` by `scripts/native-minter.sh`.
pub const NATIVE_LIBRARY: &str = "shardline_minter";

/// The native minter's C symbol in [`NATIVE_LIBRARY`], versioned with the contract
/// between it and the install's SQL (`shardline_minter_params()`'s columns): a library
/// without it fails the install (`CREATE FUNCTION`), not an insert.
pub const NATIVE_SYMBOL: &str = "shardline_next_id_v1";

/// Which `next_id()` a shard's schema gets. Both mint the same IDs from the same
/// sequence, with the same lease and the same catch-up (`shardline_catch_up()`, in
/// PL/pgSQL): they differ only in what runs on every insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[non_exhaustive]
pub enum Minter {
    /// A PL/pgSQL function: runs on any PostgreSQL, managed services included, and any
    /// role that owns the schema installs it. One-row inserts ran at 0.66–0.91× the
    /// throughput of `bigserial`'s at 8 and 32 clients (observed: docs/benchmarks.md).
    #[default]
    PlPgSql,
    /// The same fast path in C ([`NATIVE_LIBRARY`]): one-row inserts at 0.96–1.05× the
    /// throughput of `bigserial`'s at 8 and 32 clients (observed: docs/benchmarks.md). Needs
    /// the library on every host (`scripts/native-minter.sh` builds and installs it), and
    /// a superuser to install it (Postgres lets only a superuser create a C function).
    Native,
}

impl Minter {
    /// The name a config gives it: `plpgsql` or `native`.
    pub fn name(self) -> &'static str {
        match self {
            Minter::PlPgSql => "plpgsql",
            Minter::Native => "native",
        }
    }

    /// The minter a config's name stands for (`plpgsql` or `native`), or `None`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "plpgsql" => Some(Minter::PlPgSql),
            "native" => Some(Minter::Native),
            _ => None,
        }
    }
}

impl std::fmt::Display for Minter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The minter of one logical shard, as SQL for its schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSql {
    layout: Layout,
    schema: String,
    shard: u32,
    max_lag_ms: i64,
    clock_offset_ms: i64,
    minter: Minter,
}

impl ShardSql {
    /// The minter of `shard`, installed in `schema`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSchemaName`] unless `schema` is 1–63 bytes of `[a-z0-9_]` starting
    /// with a letter or `_`; [`Error::ShardOutOfRange`] when the shard does not fit.
    pub fn new(layout: Layout, schema: &str, shard: u32) -> Result<Self> {
        check_identifier(schema)?;
        if shard > layout.max_shard() {
            return Err(Error::ShardOutOfRange { shard, max: layout.max_shard() });
        }
        Ok(ShardSql {
            layout,
            schema: schema.to_owned(),
            shard,
            max_lag_ms: DEFAULT_MAX_LAG_MS,
            clock_offset_ms: 0,
            minter: Minter::PlPgSql,
        })
    }

    /// How far (ms, 0 to a day) the sequence may lag the transaction's start time before
    /// `next_id()` catches it up. Smaller keeps ID times closer to the truth and catches
    /// up more often. A value outside that range is taken as its nearest end (the
    /// lease adds it to a time in `bigint`, where a larger one would overflow).
    #[must_use]
    pub fn max_lag_ms(mut self, ms: i64) -> Self {
        self.max_lag_ms = ms.clamp(0, 86_400_000);
        self
    }

    /// Shifts the clock the SQL reads by `ms` (negative: back). For tests that show a
    /// clock stepping back changes nothing; production leaves it at 0.
    #[must_use]
    pub fn clock_offset_ms(mut self, ms: i64) -> Self {
        self.clock_offset_ms = ms;
        self
    }

    /// Which `next_id()` the install makes ([`Minter::PlPgSql`] unless told). Installing
    /// the other over a schema's existing one replaces it in place: its columns'
    /// `DEFAULT next_id()` keep working, and running sessions take the new one at their
    /// next statement.
    #[must_use]
    pub fn minter(mut self, minter: Minter) -> Self {
        self.minter = minter;
        self
    }

    /// The layout the SQL mints with.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The schema, quoted for SQL.
    pub fn quoted_schema(&self) -> String {
        crate::ident::quote(&self.schema)
    }

    /// The sequence, schema-qualified and quoted.
    pub fn sequence(&self) -> String {
        format!("{}.shardline_id_seq", self.quoted_schema())
    }

    /// The shard's catch-up state, schema-qualified and quoted: a sequence set with
    /// `setval` after a catch-up failed (when the shard's sessions may try again, and the
    /// backoff's step) and back to 0 after one succeeded. Not part of the shard's data: a
    /// move does not carry it.
    pub fn due_sequence(&self) -> String {
        format!("{}.shardline_catch_up_due", self.quoted_schema())
    }

    /// The statements that install (or update) the minter in the schema, which must
    /// exist. Idempotent: run it again to change the layout's options; the sequence is
    /// only ever moved forward. It begins with [`host_install`]: the catch-up shared by
    /// every schema of the database, made when missing.
    ///
    /// They run no function: the first `next_id()` catches the sequence up. (A session
    /// that ran each schema's PL/pgSQL catch-up keeps its plans, and every later DDL
    /// statement in it walks them all: `init` of 2000 shards went from 12 s to over 5
    /// minutes.)
    pub fn install(&self) -> String {
        let s = self.quoted_schema();
        let seq = self.sequence();
        let due_seq = self.due_sequence();
        let l = self.layout;
        let (epoch, seq_bits, ts_shift) = (l.epoch_ms(), l.sequence_bits(), l.timestamp_shift());
        let (max_seq, shard_part) = (l.max_sequence(), i64::from(self.shard) << l.shard_shift());
        let max_value = l.max_sequence_value();
        let offset = self.clock_offset_ms;
        let lag = self.max_lag_ms;
        let shard = self.shard;
        let lease_guc = format!("shardline.lease_{}", self.schema);
        // Every shift is on bigint: `x << 23` on an int wraps silently in Postgres.
        let compose = |v: &str| {
            format!("((({v} >> {seq_bits}) << {ts_shift}) | {shard_part}::bigint | ({v} & {max_seq}))")
        };
        // `next_id()` and `id_parts()` run under their caller's `search_path`: every
        // function and operator they call is named in `pg_catalog`, so one of the same
        // name in a schema on that path (`public.nextval(text)` wins over
        // `pg_catalog.nextval(regclass)` for a quoted name) is never called instead.
        // (A `SET search_path` on the function would cost every insert a GUC change.)
        let op = |o: &str| format!("OPERATOR(pg_catalog.{o})");
        let (shr, shl, or, and) = (op(">>"), op("<<"), op("|"), op("&"));
        let (plus, minus, times, le, cat) = (op("+"), op("-"), op("*"), op("<="), op("||"));
        let now_ticks = format!(
            "((pg_catalog.date_part('epoch', pg_catalog.now()) {times} 1000)::bigint {plus} ({offset}) {minus} {epoch})"
        );
        let seq_arg = format!("'{seq}'::pg_catalog.regclass");
        // nextval first, then currval for the same value: Postgres evaluates an
        // operator's arguments left to right.
        let fast = format!(
            "((((pg_catalog.nextval({seq_arg}) {shr} {seq_bits}) {shl} {ts_shift}) {or} {shard_part}::bigint) {or} (pg_catalog.currval({seq_arg}) {and} {max_seq}))"
        );
        // The lease, or -1 without one: unset is NULL, and a setting whose transaction
        // rolled back is '' ('0' put before it reads as 0: a lease that ended at the
        // epoch, so in effect none; NULLIF would look `=` up on the path).
        let lease =
            format!("coalesce(('0' {cat} pg_catalog.current_setting('{lease_guc}', true))::bigint, -1)");
        let slow_compose = compose("v");
        let next_id = match self.minter {
            Minter::PlPgSql => format!(
                r#"CREATE OR REPLACE FUNCTION {s}.next_id() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    RETURN CASE WHEN {now_ticks} {le} {lease}
        THEN {fast}
        ELSE {s}.shardline_catch_up()
    END;
END
$fn$;"#
            ),
            Minter::Native => native_next_id(&s),
        };
        format!(
            r#"CREATE SEQUENCE IF NOT EXISTS {seq} AS bigint MINVALUE 0 MAXVALUE {max_value} START 0 CACHE 1 NO CYCLE;
CREATE SEQUENCE IF NOT EXISTS {due_seq} AS bigint MINVALUE 0 START 0 CACHE 1 NO CYCLE;
COMMENT ON SEQUENCE {due_seq} IS 'shardline: when the shard''s sessions may next try to catch its id sequence up, after failed tries (0: now); not part of the shard''s data';
COMMENT ON SEQUENCE {seq} IS 'shardline id sequence: (ms since epoch << {seq_bits}) | counter; layout {ts}/{sb}/{seq_bits}, epoch {epoch} ms, shard {shard}';

{host_part}

CREATE OR REPLACE FUNCTION {s}.shardline_catch_up() RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v bigint;
    due bigint;
BEGIN
    -- Plain reads (ACCESS SHARE: wait for no one, block no one).
    SELECT s.last_value, d.last_value INTO v, due FROM {seq} AS s, {due_seq} AS d;
    -- Every argument typed: the call resolves to exactly the function's signature.
    v := {catch_up_fn}('{seq}'::regclass, '{due_seq}'::regclass, v, due, '{tag}'::text,
        {shard}::integer, {seq_bits}::integer, ({epoch})::bigint, ({offset})::bigint,
        ({lag})::bigint, ({last_ticks})::bigint);
    RETURN {slow_compose};
END
$fn$;

-- What the native minter reads once per session (see crates/id/native): the constants
-- the PL/pgSQL next_id() is written with. In both minters' installs, so a shard holds
-- the same objects with either (a move carries their privileges one for one), and
-- switching back and forth replaces functions, never drops one.
CREATE OR REPLACE FUNCTION {s}.shardline_minter_params(OUT seq regclass, OUT catch_up regprocedure,
    OUT lease_guc text, OUT shard_part bigint, OUT seq_bits integer, OUT ts_shift integer,
    OUT epoch_ms bigint, OUT offset_ms bigint)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
SELECT {seq_arg}, '{s}.shardline_catch_up()'::pg_catalog.regprocedure, '{lease_guc}'::text,
    ({shard_part})::bigint, {seq_bits}::integer, {ts_shift}::integer, ({epoch})::bigint, ({offset})::bigint
$fn$;
-- Every role that inserts calls it (once per session), as it calls next_id().
GRANT EXECUTE ON FUNCTION {s}.shardline_minter_params() TO PUBLIC;

{next_id}

CREATE OR REPLACE FUNCTION {s}.id_parts(id bigint, OUT unix_ms bigint, OUT shard integer, OUT sequence integer)
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
SELECT (id {shr} {ts_shift}) {plus} {epoch}, ((id {shr} {shard_shift}) {and} {max_shard})::integer, (id {and} {max_seq})::integer
$fn$;

CREATE OR REPLACE FUNCTION {s}.reserve_ids(n integer) RETURNS TABLE (first_value bigint, last_value bigint)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
    IF n IS NULL OR n < 1 OR n > {max_reserve} THEN
        RAISE EXCEPTION 'reserve_ids: n must be between 1 and {max_reserve}, not %', n
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    SELECT min(v), max(v) FROM (
        SELECT v, v - row_number() OVER (ORDER BY v) AS run
        FROM (SELECT ((id >> {ts_shift}) << {seq_bits}) | (id & {max_seq}) AS v
              FROM (SELECT {s}.next_id() AS id FROM generate_series(1, n)) AS minted) AS values_
    ) AS runs
    GROUP BY run ORDER BY 1;
END
$fn$;
"#,
            ts = l.timestamp_bits(),
            sb = l.shard_bits(),
            host_part = host_install(),
            catch_up_fn = CATCH_UP_FUNCTION,
            tag = self.schema,
            last_ticks = l.last_unix_ms() - epoch,
            shard_shift = l.shard_shift(),
            max_shard = l.max_shard(),
            max_reserve = MAX_RESERVE,
        )
    }

    /// Instagram's original `next_id()` (PL/pgSQL, `nextval() % 1024` beside the
    /// clock), as `instagram_next_id()` in the schema with its own sequence: only for
    /// benchmarks and tests that show what it gets wrong.
    pub fn instagram_original(&self) -> String {
        let s = self.quoted_schema();
        format!(
            r#"CREATE SEQUENCE IF NOT EXISTS {s}.instagram_seq;
CREATE OR REPLACE FUNCTION {s}.instagram_next_id(OUT result bigint) AS $fn$
DECLARE
    our_epoch bigint := {epoch};
    seq_id bigint;
    now_millis bigint;
    shard_id int := {shard};
BEGIN
    SELECT nextval('{s}.instagram_seq') % 1024 INTO seq_id;
    SELECT FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) INTO now_millis;
    result := (now_millis - our_epoch) << 23;
    result := result | (shard_id << 10);
    result := result | (seq_id);
END;
$fn$ LANGUAGE plpgsql;
"#,
            epoch = self.layout.epoch_ms(),
            shard = self.shard,
        )
    }
}

/// The native minter's `next_id()` in schema `s` (quoted): the C function of
/// [`NATIVE_LIBRARY`], made only by a superuser, with errors that name what is missing.
fn native_next_id(s: &str) -> String {
    format!(
        r#"DO $native$
BEGIN
    IF NOT (SELECT r.rolsuper FROM pg_catalog.pg_roles AS r WHERE r.rolname OPERATOR(pg_catalog.=) current_user) THEN
        RAISE EXCEPTION 'the native minter is a C function, which only a superuser may create, and % is not one: install it as a superuser, or use the PL/pgSQL minter (id.minter = "plpgsql")', current_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    EXECUTE 'CREATE OR REPLACE FUNCTION {s}.next_id() RETURNS bigint LANGUAGE c VOLATILE AS ''{lib}'', ''{symbol}''';
EXCEPTION WHEN undefined_file THEN
    RAISE EXCEPTION 'the native minter''s library {lib} is not on this server (%): build and install it on every host with scripts/native-minter.sh, or use the PL/pgSQL minter (id.minter = "plpgsql")', SQLERRM
        USING ERRCODE = 'undefined_file';
END
$native$;"#,
        lib = NATIVE_LIBRARY,
        symbol = NATIVE_SYMBOL,
    )
}

/// The prefix of the columns shardline's own statements add to the rows they return
/// (the shard a row of a statement over several schemas came from, the part of a batch
/// insert a row belongs to). No entity's column may start with it, so no table column
/// can be taken for one of them: `#[derive(Entity, NewRow)]` refuses such a column at
/// compile time, and `shardline-repo` before it builds a statement.
pub const RESERVED_COLUMN_PREFIX: &str = "shardline_";

/// Why `name` is not a plain SQL identifier, or `None` when it is one: 1 to 63 bytes
/// (Postgres's limit), a lowercase ASCII letter or `_` first, then lowercase ASCII
/// letters, digits and `_`. Quoting such a name is exact (no quote to double, no case to
/// fold, no truncation).
///
/// The one rule for every name shardline puts in SQL text: schemas
/// ([`check_identifier`]), and tables and columns, checked by `#[derive(Entity, NewRow)]`
/// at compile time and by `shardline-repo` before it builds a statement.
pub fn plain_identifier_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() || name.len() > 63 {
        Some("must be 1 to 63 bytes")
    } else if !name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_') {
        Some("must start with a lowercase ASCII letter or an underscore")
    } else if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        Some("may hold only lowercase ASCII letters, digits and underscores")
    } else {
        None
    }
}

/// Checks that `name` is a plain lowercase Postgres identifier (so quoting it is exact)
/// that may name a schema: [`plain_identifier_problem`], and not `pg_...`.
///
/// # Errors
///
/// [`Error::InvalidSchemaName`] with the reason.
pub fn check_identifier(name: &str) -> Result<()> {
    let bad = |reason| Err(Error::InvalidSchemaName { name: name.to_owned(), reason });
    if let Some(reason) = plain_identifier_problem(name) {
        return bad(reason);
    }
    if name.starts_with("pg_") {
        return bad("names starting with pg_ are reserved by Postgres");
    }
    Ok(())
}
