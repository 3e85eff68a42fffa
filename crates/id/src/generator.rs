//! Minting in the application: an in-process generator, and the bookkeeping for blocks
//! of sequence values reserved from a shard's own sequence.
//!
//! Both follow the rule the SQL minter follows (see `docs/ids.md`): a shard's state is
//! one number, `(ms since epoch << sequence_bits) | counter`, that only ever grows. Each
//! ID takes the next value, or jumps forward to the clock when the clock is ahead. IDs
//! are unique because the number never repeats, whatever the clock does; a burst of more
//! than [`Layout::ids_per_ms`] IDs in a millisecond borrows the next milliseconds; a
//! clock that steps back changes nothing.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{Error, Id, Layout, Result};

/// A source of the current time in ms since the Unix epoch.
pub trait Clock: Send + Sync {
    /// The current time, in ms since the Unix epoch.
    fn now_ms(&self) -> i64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        // Not `as_millis()`: its u128 division costs as much as reading the clock.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .ok()
            .and_then(|d| {
                i64::try_from(d.as_secs()).ok()?.checked_mul(1000)?.checked_add(i64::from(d.subsec_millis()))
            })
            .unwrap_or(0)
    }
}

/// The system's wall clock read coarsely (`CLOCK_REALTIME_COARSE`): about five times
/// cheaper than [`SystemClock`], and as fine as the kernel's tick (1 to 4 ms), so IDs'
/// times may trail the truth by that much. For minting hot loops that value speed over
/// the last millisecond.
#[derive(Debug, Clone, Copy, Default)]
pub struct CoarseClock;

impl Clock for CoarseClock {
    fn now_ms(&self) -> i64 {
        match nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME_COARSE) {
            Ok(t) => t.tv_sec().saturating_mul(1000).saturating_add(t.tv_nsec() / 1_000_000),
            Err(_) => SystemClock.now_ms(),
        }
    }
}

/// A clock that says what it is told, for tests (feature `test-util`).
#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Clone, Default)]
pub struct ManualClock(std::sync::Arc<AtomicI64>);

#[cfg(any(test, feature = "test-util"))]
impl ManualClock {
    /// A clock showing `unix_ms`.
    pub fn new(unix_ms: i64) -> Self {
        ManualClock(std::sync::Arc::new(AtomicI64::new(unix_ms)))
    }

    /// Sets the time, forward or back.
    pub fn set(&self, unix_ms: i64) {
        self.0.store(unix_ms, Ordering::SeqCst);
    }

    /// Moves the time by `delta_ms` (negative: a step back).
    pub fn advance(&self, delta_ms: i64) {
        self.0.fetch_add(delta_ms, Ordering::SeqCst);
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// How far ahead of its clock a generator may mint by default, in ms: a burst of
/// 1024 × 1000 IDs on one shard within a millisecond still mints.
pub const DEFAULT_MAX_AHEAD_MS: i64 = 1000;

/// An in-process generator for one logical shard, lock-free.
///
/// It is the only minter of its shard: use it in tests and in single-writer setups. A
/// shard that several processes (or the database) mint for needs one shared source:
/// reserve blocks from the shard's own sequence instead ([`ReservedBlocks`]).
///
/// It never blocks and never sleeps: when a burst would take it more than
/// `max_ahead_ms` ahead of the clock it returns [`Error::TooFarAhead`], and the caller
/// waits (asynchronously) for as long as the error says.
#[derive(Debug)]
pub struct LocalGenerator<C = SystemClock> {
    layout: Layout,
    shard: u32,
    clock: C,
    max_ahead_ms: i64,
    /// The last sequence value handed out; -1 before the first.
    last: AtomicI64,
}

impl LocalGenerator<SystemClock> {
    /// A generator for `shard` on the system clock.
    ///
    /// # Errors
    ///
    /// [`Error::ShardOutOfRange`] when the shard does not fit the layout.
    pub fn new(layout: Layout, shard: u32) -> Result<Self> {
        LocalGenerator::with_clock(layout, shard, SystemClock)
    }
}

impl<C: Clock> LocalGenerator<C> {
    /// A generator for `shard` reading `clock`.
    ///
    /// # Errors
    ///
    /// [`Error::ShardOutOfRange`] when the shard does not fit the layout.
    pub fn with_clock(layout: Layout, shard: u32, clock: C) -> Result<Self> {
        if shard > layout.max_shard() {
            return Err(Error::ShardOutOfRange { shard, max: layout.max_shard() });
        }
        Ok(LocalGenerator {
            layout,
            shard,
            clock,
            max_ahead_ms: DEFAULT_MAX_AHEAD_MS,
            last: AtomicI64::new(-1),
        })
    }

    /// Sets how far ahead of the clock a burst may borrow, in ms (at least 0).
    #[must_use]
    pub fn max_ahead_ms(mut self, ms: i64) -> Self {
        self.max_ahead_ms = ms.max(0);
        self
    }

    /// Continues after `sequence_value` (for example the shard's sequence after a move):
    /// every later ID is greater than the one it stands for.
    #[must_use]
    pub fn starting_after(self, sequence_value: i64) -> Self {
        self.last.store(sequence_value.max(-1), Ordering::SeqCst);
        self
    }

    /// The layout the generator mints with.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Mints the next ID.
    ///
    /// # Errors
    ///
    /// [`Error::TooFarAhead`] when more IDs were asked for than the layout holds per
    /// ms for longer than `max_ahead_ms` (wait `ahead_ms - max_ahead_ms` and retry);
    /// [`Error::BeforeEpoch`] / [`Error::AfterEnd`] when the clock is outside the
    /// layout's range.
    pub fn next_id(&self) -> Result<Id> {
        let now_ms = self.clock.now_ms();
        let now_ticks = self.layout.ticks(now_ms)?;
        let floor = now_ticks << self.layout.sequence_bits();
        let mut old = self.last.load(Ordering::Acquire);
        loop {
            let new = old.saturating_add(1).max(floor);
            if new > self.layout.max_sequence_value() {
                return Err(Error::AfterEnd { unix_ms: now_ms, last_unix_ms: self.layout.last_unix_ms() });
            }
            let ahead_ms = (new >> self.layout.sequence_bits()) - now_ticks;
            if ahead_ms > self.max_ahead_ms {
                return Err(Error::TooFarAhead { ahead_ms, max_ahead_ms: self.max_ahead_ms });
            }
            match self.last.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return self.layout.id_from_sequence_value(new, self.shard),
                Err(current) => old = current,
            }
        }
    }
}

/// Sequence values reserved from a shard's sequence, waiting to become IDs.
///
/// The shard's SQL function `reserve_ids(n)` hands out `n` values of the same sequence
/// that the database's own `next_id()` draws from, as ranges; this holds them and turns
/// them into IDs locally, so IDs minted in the application and in the database come
/// from one source and cannot collide. Pure bookkeeping: the I/O that refills it lives
/// in `shardline-repo`. Not `Clone`: two copies would hand out the same values.
#[derive(Debug)]
pub struct ReservedBlocks {
    layout: Layout,
    shard: u32,
    /// Inclusive ranges, in the order they were reserved, each above the one before.
    ranges: std::collections::VecDeque<(i64, i64)>,
    /// The largest value ever pushed: a range must come above it.
    held: Option<i64>,
}

impl ReservedBlocks {
    /// No values yet, for `shard`.
    ///
    /// # Errors
    ///
    /// [`Error::ShardOutOfRange`] when the shard does not fit the layout.
    pub fn new(layout: Layout, shard: u32) -> Result<Self> {
        if shard > layout.max_shard() {
            return Err(Error::ShardOutOfRange { shard, max: layout.max_shard() });
        }
        Ok(ReservedBlocks { layout, shard, ranges: Default::default(), held: None })
    }

    /// Adds the values `first..=last` reserved from the shard's sequence.
    ///
    /// # Errors
    ///
    /// [`Error::ReservedEmpty`] when `first` is past `last`;
    /// [`Error::SequenceValueOutOfRange`] outside the layout's sequence values;
    /// [`Error::ReservedOutOfOrder`] unless it is above every value pushed before (the
    /// sequence hands its values out in increasing order, so a range at or below one
    /// already held is a range given twice).
    pub fn push(&mut self, first: i64, last: i64) -> Result<()> {
        for v in [first, last] {
            if v < 0 || v > self.layout.max_sequence_value() {
                return Err(Error::SequenceValueOutOfRange {
                    value: v,
                    max: self.layout.max_sequence_value(),
                });
            }
        }
        if first > last {
            return Err(Error::ReservedEmpty { first, last });
        }
        if let Some(held) = self.held
            && first <= held
        {
            return Err(Error::ReservedOutOfOrder { first, last, held });
        }
        self.held = Some(last);
        self.ranges.push_back((first, last));
        Ok(())
    }

    /// How many values are left.
    pub fn remaining(&self) -> u64 {
        self.ranges.iter().fold(0u64, |n, &(a, b)| n.saturating_add((b - a).unsigned_abs().saturating_add(1)))
    }

    /// The next ID, or `None` when every reserved value is used.
    ///
    /// # Errors
    ///
    /// None in practice: values were checked by [`ReservedBlocks::push`].
    pub fn next_id(&mut self) -> Result<Option<Id>> {
        let Some(front) = self.ranges.front_mut() else { return Ok(None) };
        let value = front.0;
        if front.0 == front.1 {
            self.ranges.pop_front();
        } else {
            front.0 += 1;
        }
        self.layout.id_from_sequence_value(value, self.shard).map(Some)
    }

    /// How far ahead of `now_ms` the next ID would be, in ms (0 when it is not ahead,
    /// or when nothing is reserved).
    pub fn ahead_of(&self, now_ms: i64) -> i64 {
        self.ranges.front().map_or(0, |&(v, _)| {
            let unix_ms = self.layout.epoch_ms().saturating_add(v >> self.layout.sequence_bits());
            unix_ms.saturating_sub(now_ms).max(0)
        })
    }
}
