//! Shards full of photos, likes and comments, for the benchmarks that move them.

use crate::common::BoxError;

/// Fills shard `shard` (of `count`), on the host `c` is connected to, with `n` photos,
/// a like and a comment on each.
pub(crate) async fn fill(c: &tokio_postgres::Client, shard: i64, count: i64, n: i64) -> Result<(), BoxError> {
    let s = format!("shard_{shard:04}");
    c.batch_execute(&format!(
        "INSERT INTO {s}.photos (user_id, url, caption)
           SELECT {count} * (g % 5000) + {shard}, 'https://cdn.example/photos/' || g || '.jpg', 'caption number ' || g
             FROM generate_series(1, {n}) g;
         INSERT INTO {s}.likes (photo_id, user_id) SELECT id, user_id + 1 FROM {s}.photos;
         INSERT INTO {s}.comments (photo_id, user_id, body) SELECT id, user_id + 2, 'a comment on ' || id FROM {s}.photos;
         ANALYZE {s}.photos, {s}.likes, {s}.comments;"
    ))
    .await?;
    Ok(())
}
