//! The partition registry: every live (upstream, partition) [`Cell`], spread over shards
//! so that no lock is ever held over the whole set. A keyed upstream's new partitions are
//! counted against its `max_partitions`. The sweep drops idle partitions shard by shard
//! and, in the same pass, keeps the [`Summary`] the admin views read (the busiest
//! partitions, learned paces, adaptive shares): their cost is that of a few partitions,
//! whatever the number of partitions.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use parking_lot::RwLock;
use tokio::time::Instant;

use super::cell::{Cell, Occupancy};
use crate::route::Partition;

/// Enough shards that one holds about a thousand partitions at a million: the sweep
/// reads one under its read lock for well under a millisecond (a partition's first
/// touch is a cache miss, ~0.7 µs each at that size), and a request that makes a new
/// partition there waits for no longer than that.
const SHARDS: usize = 1024;

/// Up to this many partitions, the summary is taken afresh at each call (its cost is
/// bounded by this number); beyond it, the one the last sweep kept is read.
pub(super) const FRESH_UP_TO: usize = 1024;

/// Partitions per upstream that the summary keeps, those with most requests waiting first.
pub(super) const KEPT: usize = 100;

/// Idle partitions dropped under one write lock of a shard, so that a request for a new
/// partition of that shard waits for at most this many removals.
const REMOVE_AT_ONCE: usize = 256;

pub(super) type CellKey = (Arc<str>, Option<Partition>);
/// foldhash, seeded at random for each map and for the shard choice: a request looks its
/// cell up twice, and SipHash's two passes over the key cost about 450 instructions
/// (docs/BENCHMARKS.md, "CPU per request"). A partition is a hash of what the client
/// sent, so a client can grind keys that collide under an unseeded hash; the seeds keep
/// it from aiming at a shard or a bucket.
type Hasher = foldhash::fast::RandomState;
type Shard = RwLock<HashMap<CellKey, Arc<Cell>, Hasher>>;

/// What the admin views show of the partitions, bounded whatever their number.
#[derive(Default)]
pub(super) struct Summary {
    /// By upstream: at most [`KEPT`] of its partitions, most requests waiting first. Weak,
    /// so that being shown keeps no partition from being swept.
    pub(super) busiest: HashMap<Arc<str>, Vec<Weak<Cell>>>,
    /// By upstream: the slowest pace a partition learned and how many partitions pace now.
    pub(crate) paces: HashMap<Arc<str>, (f64, usize)>,
    /// By (upstream, family): the lowest share of its configured rate a partition may send.
    pub(crate) shares: HashMap<(Arc<str>, String), f64>,
    /// By upstream: its live partitions.
    pub(crate) live: HashMap<Arc<str>, usize>,
}

pub(super) struct Registry {
    shards: Box<[Shard]>,
    hasher: Hasher,
    occupancy: RwLock<HashMap<Arc<str>, Arc<Occupancy>>>,
    swept: RwLock<Arc<Summary>>,
}

/// A new partition would pass its upstream's `max_partitions`.
pub(super) struct Full;

impl Registry {
    pub(super) fn new() -> Registry {
        Registry {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            hasher: Default::default(),
            occupancy: RwLock::default(),
            swept: RwLock::default(),
        }
    }

    fn shard(&self, key: &CellKey) -> &Shard {
        let mut h = self.hasher.build_hasher();
        key.hash(&mut h);
        let i = std::hash::Hasher::finish(&h) as usize % SHARDS;
        &self.shards[i]
    }

    pub(super) fn occupancy(&self, upstream: &Arc<str>) -> Arc<Occupancy> {
        if let Some(o) = self.occupancy.read().get(upstream) {
            return o.clone();
        }
        self.occupancy
            .write()
            .entry(upstream.clone())
            .or_default()
            .clone()
    }

    /// The cell of `key`, made by `make` when there is none. A keyed partition is made
    /// only while its upstream has fewer than `cap` live ones.
    pub(super) fn get_or_make(
        &self,
        key: CellKey,
        cap: usize,
        make: impl FnOnce(Arc<Occupancy>) -> Cell,
    ) -> Result<Arc<Cell>, Full> {
        let shard = self.shard(&key);
        if let Some(c) = shard.read().get(&key) {
            return Ok(c.clone());
        }
        let occupancy = self.occupancy(&key.0);
        let mut map = shard.write();
        if let Some(c) = map.get(&key) {
            return Ok(c.clone());
        }
        // The unkeyed partition is always there to be had: the cap bounds what clients
        // can make, not the upstream itself.
        let keyed = key.1.is_some();
        let taken = occupancy
            .live
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (!keyed || n < cap).then_some(n + 1)
            });
        if taken.is_err() {
            return Err(Full);
        }
        let cell = Arc::new(make(occupancy));
        map.insert(key, cell.clone());
        Ok(cell)
    }

    /// Every live cell, cloned out shard by shard.
    pub(super) fn cells(&self) -> Vec<Arc<Cell>> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            out.extend(shard.read().values().cloned());
        }
        out
    }

    pub(super) fn len(&self) -> usize {
        self.occupancy.read().values().map(|o| o.live()).sum()
    }

    /// The summary: taken now when the partitions are few, else the last sweep's.
    pub(super) fn summary(&self, now: Instant) -> Arc<Summary> {
        if self.len() <= FRESH_UP_TO {
            return Arc::new(self.scan(now, false));
        }
        self.swept.read().clone()
    }

    /// Drops the partitions nobody uses that are back to their initial state, keeps the
    /// summary of those that remain, and returns how many remain.
    pub(super) fn sweep(&self, now: Instant) -> usize {
        let summary = self.scan(now, true);
        let live = summary.live.values().sum();
        *self.swept.write() = Arc::new(summary);
        live
    }

    /// One pass over every shard: the summary, and with `remove`, idle cells dropped.
    /// A shard is read under its read lock (requests for its partitions go on); idle
    /// cells are then removed a few at a time under its write lock.
    fn scan(&self, now: Instant, remove: bool) -> Summary {
        let mut summary = Summary::default();
        let mut busiest: HashMap<Arc<str>, Vec<(usize, Arc<Cell>)>> = HashMap::new();
        for shard in self.shards.iter() {
            let mut idle: Vec<CellKey> = Vec::new();
            for (key, cell) in shard.read().iter() {
                let mut st = cell.lock();
                let waiting = st.bucket.waiting();
                if let Some(l) = st.bucket.learned.as_ref().filter(|l| l.active(now)) {
                    let e = summary
                        .paces
                        .entry(cell.name.clone())
                        .or_insert((f64::INFINITY, 0));
                    *e = (e.0.min(l.rate()), e.1 + 1);
                }
                // The families are another allocation: read only where one adapts.
                for f in st.bucket.families.iter().filter(|_| st.plan.adapts) {
                    if let Some(a) = &f.aimd {
                        let e = summary
                            .shares
                            .entry((cell.name.clone(), f.spec.name.clone()))
                            .or_insert(1.0);
                        *e = e.min(a.rate() / a.configured());
                    }
                }
                // Only the map holds an idle cell: no waiter, driver, permit or grant has
                // a clone. Checked again under the write lock, where no one can take one.
                if remove && Arc::strong_count(cell) == 1 && st.bucket.is_idle(now) {
                    idle.push(key.clone());
                    continue;
                }
                drop(st);
                let top = busiest.entry(cell.name.clone()).or_default();
                top.push((waiting, cell.clone()));
                if top.len() >= 2 * KEPT {
                    keep_busiest(top);
                }
            }
            for chunk in idle.chunks(REMOVE_AT_ONCE) {
                let mut gone = Vec::with_capacity(chunk.len());
                let mut map = shard.write();
                for key in chunk {
                    let still_idle = map
                        .get(key)
                        .is_some_and(|c| Arc::strong_count(c) == 1 && c.lock().bucket.is_idle(now));
                    if still_idle && let Some(c) = map.remove(key) {
                        gone.push(c);
                    }
                }
                drop(map);
                // Freed outside the lock.
                for c in gone {
                    c.occupancy.live.fetch_sub(1, Ordering::Relaxed);
                }
            }
            if remove {
                let mut map = shard.write();
                // Rarely: a shard that emptied after a burst gives its table back.
                if map.capacity() > 64 && map.capacity() > 4 * map.len() {
                    let len = map.len();
                    map.shrink_to(len * 2);
                }
            }
        }
        for (name, mut top) in busiest {
            keep_busiest(&mut top);
            summary
                .busiest
                .insert(name, top.iter().map(|(_, c)| Arc::downgrade(c)).collect());
        }
        for (name, o) in self.occupancy.read().iter() {
            summary.live.insert(name.clone(), o.live());
        }
        summary
    }
}

/// Keeps the [`KEPT`] cells with most requests waiting, in that order.
fn keep_busiest(top: &mut Vec<(usize, Arc<Cell>)>) {
    let by_waiting = |a: &(usize, Arc<Cell>), b: &(usize, Arc<Cell>)| b.0.cmp(&a.0);
    if top.len() > KEPT {
        top.select_nth_unstable_by(KEPT, by_waiting);
        top.truncate(KEPT);
    }
    top.sort_by(by_waiting);
}
