//! Minting IDs in the application from blocks reserved from a shard's own sequence.

use std::time::Duration;

use shardline_id::generator::{Clock, ReservedBlocks, SystemClock};
use shardline_id::{Id, Layout};
use tokio::sync::Mutex;

use shardline_router::{LogicalShard, SchemaPrefix};

use crate::{Error, Result};

/// Values reserved per round trip by default.
pub const DEFAULT_BLOCK: i32 = 1000;

/// How far ahead of the clock an ID may be handed out by default, in ms.
pub const DEFAULT_MAX_AHEAD_MS: i64 = 1000;

/// Mints IDs for one logical shard in the application.
///
/// It reserves `block` values at a time from the shard's sequence with the shard's
/// `reserve_ids(n)` (one round trip) and turns them into IDs locally. The database's own
/// `next_id()` draws from the same sequence, so IDs minted here and there never collide.
///
/// It never blocks a thread: callers wait on an async mutex while a block is fetched,
/// and when the next value would be more than `max_ahead_ms` ahead of the clock (a burst
/// borrowed future milliseconds) it sleeps asynchronously until it is not.
#[derive(Debug)]
pub struct ShardIdGenerator<C = SystemClock> {
    shard: LogicalShard,
    reserve_sql: String,
    block: i32,
    max_ahead_ms: i64,
    clock: C,
    blocks: Mutex<ReservedBlocks>,
}

impl ShardIdGenerator<SystemClock> {
    /// A generator for `shard` of a cluster whose shard schemas are named by `prefix`
    /// (the shard's schema, where its minter is installed, is `prefix.schema(shard)`:
    /// the values reserved there are stamped with `shard`, so the two cannot differ).
    /// [`crate::Cluster::id_generator`] gives one with the cluster's layout and prefix.
    ///
    /// # Errors
    ///
    /// When the shard does not fit the layout.
    pub fn new(layout: Layout, prefix: &SchemaPrefix, shard: LogicalShard) -> Result<Self> {
        ShardIdGenerator::with_clock(layout, prefix, shard, SystemClock)
    }
}

impl<C: Clock> ShardIdGenerator<C> {
    /// As [`ShardIdGenerator::new`], reading `clock`.
    ///
    /// # Errors
    ///
    /// As [`ShardIdGenerator::new`].
    pub fn with_clock(layout: Layout, prefix: &SchemaPrefix, shard: LogicalShard, clock: C) -> Result<Self> {
        Ok(ShardIdGenerator {
            shard,
            reserve_sql: format!(
                "SELECT first_value, last_value FROM {}.reserve_ids($1)",
                prefix.schema(shard).quoted()
            ),
            block: DEFAULT_BLOCK,
            max_ahead_ms: DEFAULT_MAX_AHEAD_MS,
            clock,
            blocks: Mutex::new(ReservedBlocks::new(layout, u32::from(shard.get()))?),
        })
    }

    /// Values to reserve per round trip (1 to 1,000,000).
    #[must_use]
    pub fn block(mut self, n: i32) -> Self {
        self.block = n.clamp(1, shardline_id::sql::MAX_RESERVE);
        self
    }

    /// How far ahead of the clock an ID may be handed out, in ms (at least 0).
    #[must_use]
    pub fn max_ahead_ms(mut self, ms: i64) -> Self {
        self.max_ahead_ms = ms.max(0);
        self
    }

    /// The next ID, reserving a new block through `client` (a connection to the
    /// shard's host) when the current one is used up.
    ///
    /// # Errors
    ///
    /// [`Error::Db`] when the reservation fails (nothing is consumed locally then).
    ///
    /// # Cancel safety
    ///
    /// Cancelling while a block is being reserved may leave those values unused: a gap
    /// in the sequence, never a duplicate.
    pub async fn next_id(&self, client: &tokio_postgres::Client) -> Result<Id> {
        let mut blocks = self.blocks.lock().await;
        if blocks.remaining() == 0 {
            // Unnamed, in one round trip: behind a transaction pooler a named
            // statement's Parse and Bind can reach two server connections, and the Bind
            // then runs another client's statement of that name, or none.
            let rows = client
                .query_typed(&self.reserve_sql, &[(&self.block, tokio_postgres::types::Type::INT4)])
                .await
                .map_err(|e| Error::db(self.shard, "reserving IDs", e))?;
            for row in rows {
                let (first, last): (i64, i64) = (
                    row.try_get(0).map_err(|e| Error::db(self.shard, "reserving IDs", e))?,
                    row.try_get(1).map_err(|e| Error::db(self.shard, "reserving IDs", e))?,
                );
                blocks.push(first, last)?;
            }
        }
        loop {
            let ahead = blocks.ahead_of(self.clock.now_ms());
            if ahead <= self.max_ahead_ms {
                break;
            }
            let wait = u64::try_from(ahead - self.max_ahead_ms).unwrap_or(1);
            tokio::time::sleep(Duration::from_millis(wait)).await;
        }
        blocks.next_id()?.ok_or(Error::EmptyReservation { shard: self.shard })
    }
}
