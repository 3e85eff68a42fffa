//! The shard map: which physical host holds each logical shard.

use std::collections::HashMap;
use std::ops::RangeInclusive;

use shardline_id::{Id, Layout};

use crate::{Error, HostName, LogicalShard, Result, SchemaName, SchemaPrefix, ShardCount};

/// Where a statement goes: the logical shard, its schema, and the host holding it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The logical shard.
    pub shard: LogicalShard,
    /// Its schema.
    pub schema: SchemaName,
    /// The host that holds it.
    pub host: HostName,
}

/// Logical shard → host, with the version it had in the catalog.
///
/// Valid by construction: every shard of the count is mapped exactly once, to one of
/// the map's hosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMap {
    version: i64,
    count: ShardCount,
    hosts: Vec<HostName>,
    /// Index into `hosts`, per shard.
    owner: Vec<usize>,
}

impl ShardMap {
    /// A map from explicit assignments.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidMap`] naming the first shard that is unmapped, mapped twice, out
    /// of range, or mapped to a host that is not in `hosts`; or a host listed twice.
    pub fn new(
        version: i64,
        count: ShardCount,
        hosts: Vec<HostName>,
        assignments: impl IntoIterator<Item = (i64, HostName)>,
    ) -> Result<Self> {
        let mut index = HashMap::new();
        for (i, h) in hosts.iter().enumerate() {
            if index.insert(h.clone(), i).is_some() {
                return Err(Error::InvalidMap { reason: format!("host {h} is listed twice") });
            }
        }
        let mut owner: Vec<Option<usize>> = vec![None; usize::from(count.get())];
        for (shard, host) in assignments {
            let s = LogicalShard::new(shard, count).map_err(|_| Error::InvalidMap {
                reason: format!("shard {shard} is out of range 0..{}", count.get()),
            })?;
            let h = *index.get(&host).ok_or_else(|| Error::InvalidMap {
                reason: format!("shard {shard} is mapped to unknown host {host}"),
            })?;
            let slot = &mut owner[usize::from(s.get())];
            if let Some(previous) = slot {
                return Err(Error::InvalidMap {
                    reason: format!("shard {shard} is mapped twice ({} and {host})", hosts[*previous]),
                });
            }
            *slot = Some(h);
        }
        let owner = owner
            .into_iter()
            .enumerate()
            .map(|(s, o)| {
                o.ok_or_else(|| Error::InvalidMap { reason: format!("shard {s} is not mapped to any host") })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ShardMap { version, count, hosts, owner })
    }

    /// The first placement: contiguous, even ranges over `hosts` in order (the first
    /// `count % hosts` hosts get one shard more), version 1.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidMap`] when `hosts` is empty or lists a host twice.
    pub fn even(count: ShardCount, hosts: Vec<HostName>) -> Result<Self> {
        if hosts.is_empty() {
            return Err(Error::InvalidMap { reason: "there are no hosts to place shards on".into() });
        }
        let n = usize::from(count.get());
        let per = n / hosts.len();
        let extra = n % hosts.len();
        let mut assignments = Vec::with_capacity(n);
        let mut shard = 0i64;
        for (i, h) in hosts.iter().enumerate() {
            let size = per + usize::from(i < extra);
            for _ in 0..size {
                assignments.push((shard, h.clone()));
                shard += 1;
            }
        }
        ShardMap::new(1, count, hosts, assignments)
    }

    /// The catalog version this map had.
    pub fn version(&self) -> i64 {
        self.version
    }

    /// How many logical shards there are.
    pub fn count(&self) -> ShardCount {
        self.count
    }

    /// The hosts, in the order given.
    pub fn hosts(&self) -> &[HostName] {
        &self.hosts
    }

    /// The host holding `shard`.
    ///
    /// # Panics
    ///
    /// When `shard` is not below the map's [`ShardMap::count`], as a slice index would:
    /// check it first ([`ShardCount::within`]) when it comes from outside.
    pub fn host_of(&self, shard: LogicalShard) -> &HostName {
        &self.hosts[self.owner[usize::from(shard.get())]]
    }

    /// The shards each host holds, as contiguous ranges, hosts in order.
    pub fn ranges(&self) -> Vec<(HostName, Vec<RangeInclusive<u16>>)> {
        let mut out: Vec<(HostName, Vec<RangeInclusive<u16>>)> =
            self.hosts.iter().map(|h| (h.clone(), Vec::new())).collect();
        for shard in self.count.shards() {
            let ranges = &mut out[self.owner[usize::from(shard.get())]].1;
            let s = shard.get();
            match ranges.last_mut() {
                Some(r) if *r.end() + 1 == s => *r = *r.start()..=s,
                _ => ranges.push(s..=s),
            }
        }
        out
    }

    /// The shards `host` holds.
    pub fn shards_of<'a>(&'a self, host: &'a HostName) -> impl Iterator<Item = LogicalShard> + 'a {
        self.count.shards().filter(move |&s| self.host_of(s) == host)
    }

    /// Where `shard` lives.
    ///
    /// # Panics
    ///
    /// As [`ShardMap::host_of`].
    pub fn route(&self, shard: LogicalShard, prefix: &SchemaPrefix) -> Route {
        Route { shard, schema: prefix.schema(shard), host: self.host_of(shard).clone() }
    }

    /// Where a user's rows live.
    pub fn route_user(&self, user_id: i64, prefix: &SchemaPrefix) -> Route {
        self.route(self.count.shard_of_user(user_id), prefix)
    }

    /// Where the row with `id` lives: the shard inside the ID.
    ///
    /// # Errors
    ///
    /// [`Error::ShardOutOfRange`] when the ID names a shard this cluster does not have
    /// (it was not minted here).
    pub fn route_id(&self, id: Id, layout: Layout, prefix: &SchemaPrefix) -> Result<Route> {
        let shard = LogicalShard::new(i64::from(layout.shard_of(id)), self.count)?;
        Ok(self.route(shard, prefix))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(n: usize) -> Vec<HostName> {
        (1..=n).map(|i| HostName::new(&format!("pg{i}")).unwrap()).collect()
    }

    #[test]
    fn even_placement_is_contiguous_and_balanced() {
        let map = ShardMap::even(ShardCount::new(2000).unwrap(), hosts(3)).unwrap();
        let r = map.ranges();
        assert_eq!(r[0].1, vec![0..=666]);
        assert_eq!(r[1].1, vec![667..=1333]);
        assert_eq!(r[2].1, vec![1334..=1999]);
        assert_eq!(map.version(), 1);
        let prefix = SchemaPrefix::default();
        let route = map.route_user(31341, &prefix);
        assert_eq!(
            (route.shard.get(), route.schema.as_str(), route.host.as_str()),
            (1341, "shard_1341", "pg3")
        );
    }

    #[test]
    fn routing_by_id_uses_the_shard_inside() {
        let map = ShardMap::even(ShardCount::new(2000).unwrap(), hosts(4)).unwrap();
        let id = Layout::INSTAGRAM.compose(1_700_000_000_000, 1999, 3).unwrap();
        let route = map.route_id(id, Layout::INSTAGRAM, &SchemaPrefix::default()).unwrap();
        assert_eq!((route.shard.get(), route.host.as_str()), (1999, "pg4"));
        let foreign = Layout::INSTAGRAM.compose(1_700_000_000_000, 2000, 3).unwrap();
        assert_eq!(
            map.route_id(foreign, Layout::INSTAGRAM, &SchemaPrefix::default()),
            Err(Error::ShardOutOfRange { shard: 2000, count: 2000 })
        );
    }

    #[test]
    fn invalid_maps_name_the_problem() {
        let count = ShardCount::new(3).unwrap();
        let h = hosts(2);
        let cases: Vec<(Vec<(i64, &str)>, &str)> = vec![
            (vec![(0, "pg1"), (1, "pg2")], "shard 2 is not mapped"),
            (vec![(0, "pg1"), (1, "pg2"), (2, "pg1"), (1, "pg1")], "shard 1 is mapped twice (pg2 and pg1)"),
            (vec![(0, "pg1"), (1, "pg2"), (2, "pg9")], "unknown host pg9"),
            (vec![(0, "pg1"), (1, "pg2"), (2, "pg1"), (3, "pg1")], "shard 3 is out of range 0..3"),
            (vec![(0, "pg1"), (-1, "pg1")], "shard -1 is out of range"),
        ];
        for (assignments, message) in cases {
            let a = assignments.into_iter().map(|(s, n)| (s, HostName::new(n).unwrap()));
            let err = ShardMap::new(2, count, h.clone(), a).unwrap_err().to_string();
            assert!(err.contains(message), "{err}");
        }
        let twice = vec![HostName::new("pg1").unwrap(), HostName::new("pg1").unwrap()];
        assert!(ShardMap::even(count, twice).unwrap_err().to_string().contains("listed twice"));
        assert!(ShardMap::even(count, vec![]).is_err());
    }

    #[test]
    fn negative_users_land_in_range() {
        let count = ShardCount::new(2000).unwrap();
        assert_eq!(count.shard_of_user(-1).get(), 1999);
        assert_eq!(count.shard_of_user(-2000).get(), 0);
        assert_eq!(count.shard_of_user(i64::MIN).get(), u16::try_from(i64::MIN.rem_euclid(2000)).unwrap());
        assert_eq!(count.shard_of_user(4001).get(), 1);
    }

    #[test]
    fn names_are_checked() {
        for bad in ["", "Shard_", "1x", "a-b", "pg_x", "a\"", &"a".repeat(60)] {
            assert!(SchemaPrefix::new(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            SchemaPrefix::new("s")
                .unwrap()
                .schema(LogicalShard::new(7, ShardCount::new(10).unwrap()).unwrap())
                .as_str(),
            "s0007"
        );
        for bad in ["", "pg 1", "pg;1", "pg'1", "pгх", &"a".repeat(64)] {
            assert!(HostName::new(bad).is_err(), "{bad:?}");
        }
        assert!(
            ShardCount::new(0).is_err() && ShardCount::new(8193).is_err() && ShardCount::new(8192).is_ok()
        );
    }

    proptest::proptest! {
        #[test]
        fn every_user_routes_to_a_mapped_host(user in proptest::num::i64::ANY, n in 1i64..=8192, h in 1usize..10) {
            let count = ShardCount::new(n).unwrap();
            let hs = hosts(h);
            let map = ShardMap::even(count, hs.clone()).unwrap();
            let route = map.route_user(user, &SchemaPrefix::default());
            proptest::prop_assert!(i64::from(route.shard.get()) < n);
            proptest::prop_assert!(hs.contains(&route.host));
            proptest::prop_assert_eq!(i64::from(route.shard.get()), user.rem_euclid(n));
        }
    }
}
