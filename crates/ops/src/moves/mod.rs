//! Moving a logical shard between hosts, online, with Postgres's logical replication.
//!
//! A move goes through the [`Step`]s in order, and journals each in the catalog
//! (`shardline.moves`) once it is done, so that a move interrupted anywhere (the mover
//! killed, a host down) is finished by [`resume`] or undone by [`abort`]:
//!
//! 1. [`preflight()`]: everything checked, every problem listed, nothing changed;
//! 2. prepare: the schema built on the target from the same migrations, a publication
//!    of the schema on the source;
//! 3. copy: the target subscribes (the initial copy, then streaming);
//! 4. catch up: until a change on the source reaches the target within `max_lag`;
//! 5. fence: in one transaction on the source, the shard's tables locked and its
//!    schema renamed, so no write lands there again, also from a router with an old
//!    map (it gets 42P01/3F000 and waits for the new map);
//! 6. sync: a marker written by the fence reaches the target, so the target has
//!    everything the source committed;
//! 7. the ID sequence carried above the source's last value;
//! 8. verify: row counts and checksums per table; a mismatch lists the differing keys
//!    and undoes the move;
//! 9. flip: the source decides `flip` on its marker row (only while the fence's lease
//!    runs), then the catalog's map points at the target (routers are notified);
//! 10. clean: subscription, publication, slots dropped. The source's old schema stays,
//!     renamed, until [`gc()`] after a grace period.
//!
//! Only the moving shard's writes pause, from step 5 to step 9.
//!
//! The fence holds a lease on the source (`MoveOptions::lease`), renewed by the mover.
//! If it runs out with nothing decided (the mover died, the fence's reply was lost, the
//! catalog went down), the first router that finds the shard fenced unfences it on its
//! source through `shardline.resolve_fence` ([`engine::RESOLVE_SQL`]); a decided flip is
//! completed through `shardline.complete_flip` ([`engine::COMPLETE_FLIP_SQL`]).

pub mod engine;
pub mod gc;
pub mod journal;
pub mod preflight;
mod subscription;

pub use engine::{
    AbortReport, CHANGES_SQL, DEFAULT_MAX_RATE, HookFn, MARKS_SQL, MoveOptions, MoveProgress, MoveReport,
    ProgressFn, Verification, abort, resume, revert, run,
};
pub(crate) use engine::{CATALOG_HUNG_AFTER, catalog_watched, unless_catalog_hung, unless_hung};
pub use gc::{GcReport, MAX_GRACE, gc};
pub use journal::{
    Detail, MoveRecord, Precheck, Revertible, Reverting, Round, RowsCopied, State, Step, TableCheck, list,
};
pub use preflight::{Preflight, Problem, preflight, preflight_with};
