//! What the benchmarks share.

use std::path::Path;

use shardline_router::Config;
use shardline_testkit::Cluster;

/// A boxed error, for `?` everywhere.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A config over every host of `cluster`, database `db`, the catalog on the first host,
/// the repository's `migrations/`.
pub(crate) fn config(cluster: &Cluster, db: &str, shards: u16, dir: &Path) -> Result<Config, BoxError> {
    config_of(cluster, cluster.hosts().len(), db, shards, dir)
}

/// [`config`] over the first `hosts` hosts of `cluster` only.
pub(crate) fn config_of(
    cluster: &Cluster,
    hosts: usize,
    db: &str,
    shards: u16,
    dir: &Path,
) -> Result<Config, BoxError> {
    let mut text = format!(
        "logical_shards = {shards}\nmigrations = \"{}\"\n[catalog]\nurl = \"{}\"\n",
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations").display(),
        cluster.hosts()[0].url(db)
    );
    for (i, h) in cluster.hosts().iter().take(hosts).enumerate() {
        text.push_str(&format!(
            "[[hosts]]\nname = \"pg{}\"\nurl = \"{}\"\npeer_url = \"{}\"\n",
            i + 1,
            h.url(db),
            h.peer_url(db)
        ));
    }
    Ok(Config::from_toml(&text, "bench.toml", dir, &|_| None)?)
}
