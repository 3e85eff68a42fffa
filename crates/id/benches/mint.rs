//! Minting and decoding IDs, beside the usual rivals, in one process. Prints ns per ID
//! and each rival's time as a ratio of shardline's.
//!
//! ```text
//! cargo bench -p shardline-id --bench mint
//! ```
#![expect(clippy::unwrap_used, clippy::cast_precision_loss, reason = "a benchmark")]

use std::hint::black_box;
use std::time::Instant;

use shardline_id::generator::LocalGenerator;
use shardline_id::{Id, Layout};

const N: usize = 1_000_000;
const ROUNDS: usize = 7;

/// Median ns per call of `f` over `ROUNDS` rounds of `N` calls.
fn ns_per_op(mut f: impl FnMut()) -> f64 {
    let mut per = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let started = Instant::now();
        for _ in 0..N {
            f();
        }
        per.push(started.elapsed().as_nanos() as f64 / N as f64);
    }
    per.sort_by(f64::total_cmp);
    per[ROUNDS / 2]
}

fn table(title: &str, rows: &[(&str, f64)]) {
    let base = rows[0].1;
    println!("{title}");
    println!("  {:<52} {:>9} {:>12}", "", "ns/ID", "vs shardline");
    for (name, ns) in rows {
        println!("  {name:<52} {ns:>9.2} {:>11.2}x", ns / base);
    }
    println!();
}

/// A clock that always says the same instant: isolates the cost of minting from the
/// cost of reading the time.
struct FixedClock;

impl shardline_id::generator::Clock for FixedClock {
    fn now_ms(&self) -> i64 {
        1_700_000_000_000
    }
}

fn main() {
    // A tight loop asks for far more than the 1024 IDs per ms one shard holds; let the
    // generator borrow ahead so the figure is the cost of minting, not of waiting.
    let g = LocalGenerator::new(Layout::INSTAGRAM, 5).unwrap().max_ahead_ms(i64::MAX / 4);
    let coarse = LocalGenerator::with_clock(Layout::INSTAGRAM, 5, shardline_id::generator::CoarseClock)
        .unwrap()
        .max_ahead_ms(i64::MAX / 4);
    let fixed =
        LocalGenerator::with_clock(Layout::INSTAGRAM, 5, FixedClock).unwrap().max_ahead_ms(i64::MAX / 4);
    let mut ulid = ulid::Generator::new();
    let mut snowflake = snowflake::SnowflakeIdGenerator::new(1, 1);
    let mint = [
        (
            "shardline LocalGenerator::next_id",
            ns_per_op(|| {
                black_box(g.next_id().unwrap());
            }),
        ),
        (
            "shardline LocalGenerator on CoarseClock",
            ns_per_op(|| {
                black_box(coarse.next_id().unwrap());
            }),
        ),
        (
            "  of which SystemTime::now() alone",
            ns_per_op(|| {
                black_box(std::time::SystemTime::now());
            }),
        ),
        (
            "  shardline on a fixed clock (no clock read)",
            ns_per_op(|| {
                black_box(fixed.next_id().unwrap());
            }),
        ),
        (
            "uuid v4 (Uuid::new_v4, fast-rng)",
            ns_per_op(|| {
                black_box(uuid::Uuid::new_v4());
            }),
        ),
        (
            "uuid v7 (Uuid::now_v7)",
            ns_per_op(|| {
                black_box(uuid::Uuid::now_v7());
            }),
        ),
        (
            "ulid monotonic (Generator::generate)",
            ns_per_op(|| {
                black_box(ulid.generate().unwrap());
            }),
        ),
        (
            "rs-snowflake real_time_generate (waits at 4096/ms)",
            ns_per_op(|| {
                black_box(snowflake.real_time_generate());
            }),
        ),
        (
            "rs-snowflake lazy_generate",
            ns_per_op(|| {
                black_box(snowflake.lazy_generate());
            }),
        ),
    ];
    table("mint one ID", &mint);

    let id = g.next_id().unwrap();
    let u7 = uuid::Uuid::now_v7();
    let ul = ulid::Ulid::generate();
    let decode = [
        (
            "shardline Layout::decode (time, shard, sequence)",
            ns_per_op(|| {
                black_box(Layout::INSTAGRAM.decode(black_box(id)));
            }),
        ),
        (
            "shardline Id::shard (the routing field)",
            ns_per_op(|| {
                black_box(black_box(id).shard());
            }),
        ),
        (
            "uuid v7 get_timestamp().to_unix()",
            ns_per_op(|| {
                black_box(black_box(u7).get_timestamp().map(|t| t.to_unix()));
            }),
        ),
        (
            "ulid timestamp_ms",
            ns_per_op(|| {
                black_box(black_box(ul).timestamp_ms());
            }),
        ),
    ];
    table("decode one ID", &decode);

    let text = id.to_string();
    let parse = [
        (
            "shardline Id from decimal",
            ns_per_op(|| {
                black_box(black_box(text.as_str()).parse::<Id>().unwrap());
            }),
        ),
        (
            "uuid parse (hyphenated)",
            ns_per_op(|| {
                black_box(uuid::Uuid::parse_str(black_box("0192f3c2-5b7e-7c3a-9f1e-2b4d6a8c0e12")).unwrap());
            }),
        ),
        (
            "ulid from_string",
            ns_per_op(|| {
                black_box(ulid::Ulid::from_string(black_box("01ARZ3NDEKTSV4RRFFQ69G5FAV")).unwrap());
            }),
        ),
    ];
    table("parse one ID from text", &parse);
}
