//! The limiter: every request that matches an upstream waits here, FIFO within its
//! family, until every limit of its upstream and family admits it at one instant.
//!
//! - [`kinds`]: the four limit kinds, pure in `now`.
//! - [`bucket`]: one partition's limits, queues and pauses, and the admission rule.
//! - this module: the async side. Each (upstream, partition) is a [`Cell`]: one mutex
//!   over its [`Bucket`], so a request takes all its permits under one lock. Arrivals and
//!   releases admit inline; a driver task per cell (alive only while someone waits)
//!   sleeps until the next instant time alone could admit someone. Admitted waiters get
//!   a [`Grant`] through a oneshot channel; a grant that is never received gives its
//!   permits back, so a waiter that disappears at the moment it is admitted costs nothing.
//!   Permit returns are owned by the limiter: rate limits by the instants their requests
//!   were sent and answered (reported by the request's [`Ticket`]), concurrency by the
//!   [`Permit`] guard that the response body carries to its end.
//!
//! An admitted request is counted from the instant it is handed to its upstream
//! connection, after connecting and TLS, not from its admission: that is when the
//! provider can start counting it. The [`SendHook`] travels inside the request body and
//! reports that instant when hyper takes the request to write it; the pipeline reports
//! the response head. A request that never reached its connection gives its rate
//! permits back.

pub(crate) mod aimd;
pub(crate) mod bucket;
pub(crate) mod error;
pub(crate) mod exposure;
pub(crate) mod kinds;
pub(crate) mod learned;
pub(crate) mod queue;
mod registry;
pub(crate) mod shared;

pub(crate) use error::LimitError;

use parking_lot::{Mutex, MutexGuard, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use prometheus::{Histogram, IntCounter, IntGauge};
use serde_json::json;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use bucket::{Admitted, Bucket, FamilyRef, FamilySpec, LimitRef, PartitionSpec, Reject};
use kinds::{Id, LimitState};

use crate::config::units::fmt_duration;
use crate::config::{Adaptive, Config, Limit, Priority, Upstream};
use crate::metrics::Metrics;
use crate::route::{Partition, Route};
use registry::Registry;
use shared::{GlobalLimit, Reservation, Store, StorePartition};

/// The queue of CONNECT tunnels in `/buckets`; not a valid family name, so it cannot clash.
const TUNNEL: &str = "(tunnel)";

/// How often idle partitions are looked for and dropped.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// Metric handles of one (upstream, family), resolved once so the hot path does no
/// label lookups.
struct FamilyMetrics {
    wait: Histogram,
    depth: IntGauge,
    queue_full: IntCounter,
    queue_timeout: IntCounter,
    partition_limit: IntCounter,
    edge_429: IntCounter,
    cluster_wait: Histogram,
    /// When the last edge-429 hint was logged, so that it is logged once a minute.
    last_hint: Mutex<Option<Instant>>,
}

/// How often the edge-429 hint may be logged per upstream and family.
const HINT_EVERY: Duration = Duration::from_secs(60);

/// An upstream's limits as one config generation has them, with its metric handles.
/// A request keeps the plan of the config it was routed with.
pub struct Plan {
    name: Arc<str>,
    /// Later plans have larger numbers: a partition still on an older plan than a
    /// request's moves to the request's first.
    generation: u64,
    /// Whether CONNECT tunnels to this upstream pay anything (its concurrency limits).
    tunnels: bool,
    spec: PartitionSpec,
    metrics: Arc<[Arc<FamilyMetrics>]>,
    /// By family index: the limits shared through `[cluster]` that its requests pay
    /// (the upstream's and the family's), left out of the local bucket.
    global: Vec<Arc<[Arc<GlobalLimit>]>>,
    /// Keyed partitions it may have live at once (see [`max_partitions`]).
    max_partitions: usize,
    /// Whether any of its queues adapts its rate (`adaptive`).
    adapts: bool,
}

/// The memory the partitions of one keyed upstream may take by default: its default
/// `max_partitions` is as many of its partitions as fit in this.
pub const PARTITION_MEMORY: usize = 64 << 20;

/// Bytes one partition of `u` takes with one request sent: its cell, one queue per
/// family (and one for requests of no family, one for tunnels), its limits' states,
/// its registry entry, and the allocator's share of each. Queued requests, sliding
/// windows' logs and learned or adaptive state add to it as they are used.
pub fn partition_bytes(u: &Upstream) -> usize {
    use std::mem::size_of;
    let local = |limits: &[Limit]| limits.iter().filter(|l| !l.is_global()).count();
    let families = u.families.len() + 2;
    let limits = local(&u.limits) + u.families.iter().map(|f| local(&f.limits)).sum::<usize>();
    // The cell and the families' vector, then one vector of states per level with any.
    let allocations = 2
        + usize::from(local(&u.limits) > 0)
        + u.families.iter().filter(|f| local(&f.limits) > 0).count();
    // A hash table entry (key, value, control byte) at a typical 5/8 load.
    let entry = (size_of::<(Arc<str>, Option<Partition>)>() + size_of::<usize>() + 1) * 8 / 5;
    // The Arc's counts, and about 16 bytes of allocator header and rounding each.
    16 + size_of::<Cell>()
        + families * size_of::<bucket::FamilyBucket<Waiter>>()
        + limits * size_of::<LimitState>()
        + entry
        + 16 * allocations
}

/// The keyed partitions `u` may have live at once: its `max_partitions`, else as many as
/// [`PARTITION_MEMORY`] holds.
pub fn max_partitions(u: &Upstream) -> usize {
    u.max_partitions.map_or_else(
        || PARTITION_MEMORY / partition_bytes(u).max(1),
        |n| n as usize,
    )
}

impl Plan {
    pub(crate) fn new(u: &Upstream, metrics: &Metrics) -> Plan {
        let local = |limits: &[Limit]| -> Vec<Limit> {
            limits.iter().filter(|l| !l.is_global()).cloned().collect()
        };
        let upstream_global: Vec<Arc<GlobalLimit>> = u
            .limits
            .iter()
            .enumerate()
            .filter_map(|(i, l)| GlobalLimit::new(format!("u{i}.{}", l.kind_letter()), l))
            .map(Arc::new)
            .collect();
        let mut global: Vec<Arc<[Arc<GlobalLimit>]>> = u
            .families
            .iter()
            .map(|f| {
                let own = f.limits.iter().enumerate().filter_map(|(i, l)| {
                    GlobalLimit::new(format!("f.{}.{i}.{}", f.name, l.kind_letter()), l)
                });
                upstream_global
                    .iter()
                    .cloned()
                    .chain(own.map(Arc::new))
                    .collect()
            })
            .collect();
        // Requests of no family pay the upstream's; tunnels pay no rate limit.
        global.push(upstream_global.into());
        global.push(Arc::from(Vec::new()));
        // What `adaptive` adapts below: the tightest rate the requests pay, and its period.
        let adapts = |adaptive: Option<Adaptive>, own: &[Limit]| {
            let (rate, every) = own
                .iter()
                .chain(&u.limits)
                .filter_map(|l| Some((l.rate_per_second()?, l.period()?)))
                .min_by(|a, b| a.0.total_cmp(&b.0))?;
            adaptive.map(|spec| aimd::Adapts { spec, rate, every })
        };
        let mut families: Vec<Arc<FamilySpec>> = u
            .families
            .iter()
            .map(|f| {
                Arc::new(FamilySpec {
                    name: f.name.clone(),
                    priority: f.priority,
                    limits: local(&f.limits),
                    max_queue: f.policy.max_queue,
                    max_wait: f.policy.max_wait,
                    concurrency_only: false,
                    adaptive: adapts(f.adaptive, &f.limits),
                    fair: f.tenant.is_some(),
                })
            })
            .collect();
        // Two queues of our own: requests of no family, and CONNECT tunnels.
        for (name, concurrency_only) in [("-", false), (TUNNEL, true)] {
            families.push(Arc::new(FamilySpec {
                name: name.into(),
                priority: Priority::Normal,
                limits: Vec::new(),
                max_queue: u.policy.max_queue,
                max_wait: u.policy.max_wait,
                concurrency_only,
                adaptive: adapts(u.adaptive, &[]).filter(|_| !concurrency_only),
                fair: false,
            }));
        }
        let handles = families
            .iter()
            .map(|f| Arc::new(FamilyMetrics::new(metrics, &u.name, &f.name)))
            .collect();
        let adapts = families.iter().any(|f| f.adaptive.is_some());
        static GENERATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Plan {
            name: Arc::from(u.name.as_str()),
            generation: GENERATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            tunnels: u
                .limits
                .iter()
                .any(|l| matches!(l, Limit::Concurrency { .. })),
            spec: PartitionSpec {
                upstream_limits: local(&u.limits).into(),
                families,
            },
            metrics: handles,
            global,
            max_partitions: max_partitions(u),
            adapts,
        }
    }

    /// The shared limits a request of family `index` pays.
    fn global(&self, index: usize) -> &Arc<[Arc<GlobalLimit>]> {
        &self.global[index]
    }

    /// The queue index of a route's family: its own, or the one for requests of none.
    fn family_index(&self, family: Option<usize>) -> usize {
        family.unwrap_or(self.spec.families.len() - 2)
    }

    fn tunnel_index(&self) -> usize {
        self.spec.families.len() - 1
    }
}

impl FamilyMetrics {
    fn new(metrics: &Metrics, upstream: &str, family: &str) -> FamilyMetrics {
        // Tunnels match no family: they count under family="-".
        let family = if family == TUNNEL { "-" } else { family };
        let l = [upstream, family];
        FamilyMetrics {
            wait: metrics.queue_wait.with_label_values(&l),
            depth: metrics.queue_depth.with_label_values(&l),
            queue_full: metrics
                .rejections
                .with_label_values(&[upstream, family, "queue_full"]),
            queue_timeout: metrics.rejections.with_label_values(&[
                upstream,
                family,
                "queue_timeout",
            ]),
            partition_limit: metrics.rejections.with_label_values(&[
                upstream,
                family,
                "partition_limit",
            ]),
            edge_429: metrics.edge_429.with_label_values(&l),
            cluster_wait: metrics.cluster_wait.with_label_values(&l),
            last_hint: Mutex::new(None),
        }
    }
}

/// A request waiting in a queue: where to send its grant.
struct Waiter {
    tx: oneshot::Sender<Grant>,
}

struct CellState {
    bucket: Bucket<Waiter>,
    driver: bool,
    /// The plan the bucket is configured from; its families are the bucket's first slots.
    plan: Arc<Plan>,
    /// Metric handles of retired slots (after the plan's families), from their own plan.
    retired: Vec<Arc<FamilyMetrics>>,
}

impl CellState {
    fn metrics(&self, slot: usize) -> &FamilyMetrics {
        let n = self.plan.metrics.len();
        if slot < n {
            &self.plan.metrics[slot]
        } else {
            &self.retired[slot - n]
        }
    }

    /// The slot for family `index` of `plan`. A request routed by an older or newer
    /// config than the cell's finds its family by name; one the cell does not know waits
    /// with the requests of no family.
    fn slot(&self, plan: &Arc<Plan>, index: usize) -> usize {
        if Arc::ptr_eq(plan, &self.plan) {
            return index;
        }
        self.bucket
            .slot_named(&plan.spec.families[index].name)
            .unwrap_or(self.plan.family_index(None))
    }

    /// Moves the bucket to `plan` if it is newer than the one it has (a reload that has
    /// not reached this partition yet); returns whether it did.
    fn catch_up(&mut self, plan: &Arc<Plan>, now: Instant) -> bool {
        if plan.generation <= self.plan.generation {
            return false;
        }
        self.reconfigure(plan, now);
        true
    }

    /// Moves the bucket to `plan` (a reload).
    fn reconfigure(&mut self, plan: &Arc<Plan>, now: Instant) {
        let kept = self.bucket.reconfigure(&plan.spec, now);
        let retired = kept
            .iter()
            .map(|&i| {
                let n = self.plan.metrics.len();
                if i < n {
                    self.plan.metrics[i].clone()
                } else {
                    self.retired[i - n].clone()
                }
            })
            .collect();
        // The slots before `kept` are now the new plan's, in its order.
        self.retired = retired;
        self.plan = plan.clone();
    }
}

/// A partition's side of a store, and the store it was made by.
type OnStore = (std::sync::Weak<dyn Store>, Arc<dyn StorePartition>);

/// One (upstream, partition): its bucket under one lock, and the driver's wake-up.
pub(crate) struct Cell {
    name: Arc<str>,
    partition: Option<Partition>,
    state: Mutex<CellState>,
    notify: Notify,
    /// Where the partition's driver runs; the caller's runtime when unset.
    timers: Option<tokio::runtime::Handle>,
    /// What this replica knows of the partition's shared limits, once one is paid.
    /// Made by the store it names, and made again when the store changes.
    shared: Mutex<Option<OnStore>>,
    /// Its upstream's count of live partitions, which it leaves when swept.
    occupancy: Arc<registry::Occupancy>,
}

impl Cell {
    fn shared(&self, store: &Arc<dyn Store>) -> Arc<dyn StorePartition> {
        let mut shared = self.shared.lock();
        match &*shared {
            Some((of, p)) if std::sync::Weak::ptr_eq(of, &Arc::downgrade(store)) => p.clone(),
            _ => {
                let p = store.clone().partition(&self.name, self.partition);
                *shared = Some((Arc::downgrade(store), p.clone()));
                p
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, CellState> {
        // parking_lot's locks do not poison: nothing panics while holding this one, and if
        // something did, the state is consistent at every await-free step.
        self.state.lock()
    }

    /// Admits whoever can go now and hands them their grants. A grant whose waiter is
    /// already gone is undone on the spot, which may let the next one in.
    fn dispatch(self: &Arc<Self>, st: &mut CellState, now: Instant) {
        if st.bucket.waiting() == 0 {
            return;
        }
        let mut admitted: Vec<Admitted<Waiter>> = Vec::new();
        loop {
            st.bucket.dispatch(now, &mut admitted);
            if admitted.is_empty() {
                return;
            }
            let mut undone = false;
            let epoch = st.bucket.epoch();
            for a in admitted.drain(..) {
                let m = st.metrics(a.family);
                m.depth.dec();
                m.wait.observe((a.at - a.since).as_secs_f64());
                let grant = self.grant(st, a.family, a.seq, a.at, a.edge, epoch);
                let family = st.bucket.family_ref(a.family);
                if let Err(mut g) = a.waiter.tx.send(grant) {
                    g.disarm();
                    st.bucket.undo(family, epoch);
                    undone = true;
                }
            }
            if !undone {
                return;
            }
        }
    }

    /// The grant of a request of `slot` admitted as `seq` at `at`.
    fn grant(
        self: &Arc<Self>,
        st: &CellState,
        slot: usize,
        seq: u64,
        at: Instant,
        edge: Option<LimitRef>,
        epoch: u64,
    ) -> Grant {
        let family = st.bucket.family_ref(slot);
        let ticket = st.bucket.pays_rate(slot).then(|| {
            Arc::new(Ticket {
                cell: self.clone(),
                family,
                id: seq,
                epoch,
                phase: AtomicU8::new(ADMITTED),
                admitted: at,
                sent_after: AtomicU64::new(0),
                edge,
                global: None,
            })
        });
        Grant {
            permit: Some(Permit {
                cell: self.clone(),
                family,
                epoch,
                holds: st.bucket.holds_concurrency(slot),
                adapts: st.bucket.adapts(slot).then_some(at),
                ticket,
            }),
        }
    }

    /// The provider answered 429 to a request that `limit` admitted at its edge, at
    /// `admitted`: the provider still counted a request that sluice believed had left
    /// its window. Counted, hinted in the log (once a minute per upstream and family)
    /// with a margin that would have held the request back past its answer, and, where
    /// `margin_max` allows, the limit's margin in this partition grows to it.
    fn refused_at_edge(
        &self,
        st: &mut CellState,
        family: FamilyRef,
        limit: LimitRef,
        admitted: Instant,
        now: Instant,
    ) {
        let Some(slot) = st.bucket.find(family) else {
            return;
        };
        let family_name = st.bucket.families[slot].spec.name.clone();
        let Some((spec, state)) = st.bucket.limit(family, limit) else {
            return;
        };
        let (Some(span), Some(margin)) = (spec.span(), state.margin()) else {
            return;
        };
        let late = now.saturating_duration_since(admitted);
        // Long after the edge, the refusal has another cause (another client of the key).
        if late > (span / 2).max(Duration::from_secs(1)) {
            return;
        }
        // The provider may have counted the request whose permit this one reused as late
        // as that request's answer; the slowest answer beyond the margin says how late
        // that can be. Failing that, hold the refused request back past its own answer.
        // Whole tens of milliseconds, rounded up.
        let needed = state.slowest_answer().max(margin + late);
        let suggested = Duration::from_millis(needed.as_millis().div_ceil(10) as u64 * 10);
        let grown = spec.margin_max().map(|max| {
            let to = suggested.min(max);
            state.grow_margin(to);
            to
        });
        let limit_text = spec.to_string();
        let m = st.metrics(slot);
        m.edge_429.inc();
        let mut last = m.last_hint.lock();
        if last.is_some_and(|t| now.saturating_duration_since(t) < HINT_EVERY) {
            return;
        }
        *last = Some(now);
        let family = if family_name == TUNNEL {
            "-"
        } else {
            &family_name
        };
        match grown {
            Some(to) => tracing::warn!(
                upstream = &*self.name, family, limit = %limit_text,
                margin = %fmt_duration(margin), grown_to = %fmt_duration(to),
                "the provider refused a request admitted at the edge of this limit; its margin grows (margin_max)"
            ),
            None => tracing::warn!(
                upstream = &*self.name, family, limit = %limit_text,
                margin = %fmt_duration(margin), suggested_margin = %fmt_duration(suggested),
                "the provider refused a request admitted at the edge of this limit: its window ends later than sluice believed; \
                 a margin of at least suggested_margin would have held the request back (or another client shares the key)"
            ),
        }
    }

    /// After a change to the bucket: admit who can go, and let the driver look again.
    fn changed(self: &Arc<Self>, st: &mut CellState, now: Instant) {
        self.dispatch(st, now);
        self.wake_driver(st);
    }

    /// After a change that may matter to time-based waiting, make sure a driver looks.
    fn wake_driver(self: &Arc<Self>, st: &mut CellState) {
        if st.bucket.waiting() == 0 {
            return;
        }
        if st.driver {
            self.notify.notify_one();
        } else {
            st.driver = true;
            match &self.timers {
                Some(rt) => drop(rt.spawn(drive(self.clone()))),
                None => drop(tokio::spawn(drive(self.clone()))),
            }
        }
    }
}

/// Sleeps until time alone could admit a waiter, admits, and repeats; ends when nobody
/// waits. It owns the timing of every permit that comes back with time.
async fn drive(cell: Arc<Cell>) {
    loop {
        let next = {
            let mut st = cell.lock();
            let now = Instant::now();
            cell.dispatch(&mut st, now);
            if st.bucket.waiting() == 0 {
                st.driver = false;
                return;
            }
            st.bucket.next_wakeup(now)
        };
        match next {
            Some(at) => tokio::select! {
                _ = tokio::time::sleep_until(at) => {}
                _ = cell.notify.notified() => {}
            },
            None => cell.notify.notified().await,
        }
    }
}

/// Permits in transit from the limiter to a waiter. Dropped unreceived, it gives them back.
pub(crate) struct Grant {
    permit: Option<Permit>,
}

impl Grant {
    /// The permit will not be used and is being given back by the caller.
    fn disarm(&mut self) {
        if let Some(mut p) = self.permit.take() {
            p.holds = false;
            p.ticket = None;
        }
    }

    fn into_permit(mut self) -> Option<Permit> {
        self.permit.take()
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let Some(mut permit) = self.permit.take() else {
            return;
        };
        permit.holds = false;
        permit.ticket = None;
        let cell = permit.cell.clone();
        let mut st = cell.lock();
        st.bucket.undo(permit.family, permit.epoch);
        cell.changed(&mut st, Instant::now());
    }
}

/// An admitted request's hold on its permits. Rate permits follow the request through
/// its [`Ticket`]; concurrency permits are released on drop: when the response body has
/// been sent, or the request ended any other way (error, client gone, panic). Dropped
/// before the request reached its upstream connection, it gives its rate permits back.
pub struct Permit {
    cell: Arc<Cell>,
    family: FamilyRef,
    /// The reload epoch it was taken in: a limit created later was never paid.
    epoch: u64,
    holds: bool,
    /// When it was admitted, if its family adapts its rate (`adaptive`).
    adapts: Option<Instant>,
    /// While the request pays limits counted in time and has not been answered.
    ticket: Option<Arc<Ticket>>,
}

/// What an adaptive family is told of an answer (see [`Permit::feedback`]).
pub(crate) struct Feedback {
    cell: Arc<Cell>,
    family: FamilyRef,
    admitted: Instant,
}

impl Feedback {
    /// The answer arrived: `refused` when it was a 429 that classification retries or
    /// cools down (the provider's limit is lower than the configured one), otherwise a
    /// success.
    pub(crate) fn report(self, refused: bool) {
        let mut st = self.cell.lock();
        let now = Instant::now();
        let rates = st.bucket.adapt(self.family, refused, self.admitted, now);
        // Named only for the log line of a cut, the rarer outcome.
        let cut = rates
            .filter(|(before, after)| after < before)
            .zip(st.bucket.find(self.family))
            .map(|(rates, slot)| (rates, st.bucket.families[slot].spec.name.clone()));
        self.cell.changed(&mut st, now);
        drop(st);
        if let Some(((b, a), family)) = cut {
            tracing::info!(
                upstream = &*self.cell.name,
                family,
                from_per_s = b,
                to_per_s = a,
                "429 the provider did not announce: the family's effective rate is lowered (adaptive)"
            );
        }
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("upstream", &&*self.cell.name)
            .field("family", &self.family)
            .field("holds", &self.holds)
            .field("ticket", &self.ticket.as_ref().map(|t| t.id))
            .finish()
    }
}

impl Permit {
    /// Whether the permit must travel with the response body.
    pub(crate) fn holds_concurrency(&self) -> bool {
        self.holds
    }

    /// Follows the request's shared limits too: its send and answer reach them.
    fn hold(&mut self, hold: Box<dyn Reservation>) {
        let ticket = self.ticket.get_or_insert_with(|| {
            // Its local limits count nothing in time: a ticket for the shared ones only.
            Arc::new(Ticket {
                cell: self.cell.clone(),
                family: self.family,
                id: Id::MAX,
                epoch: self.epoch,
                phase: AtomicU8::new(ADMITTED),
                admitted: Instant::now(),
                sent_after: AtomicU64::new(0),
                edge: None,
                global: None,
            })
        });
        // Nobody else holds the ticket before its send hook is made.
        if let Some(t) = Arc::get_mut(ticket) {
            t.global = Some(hold);
        }
    }

    /// For a family that adapts its rate: what to tell it of the answer, kept apart
    /// from the permit, which travels on with the response body.
    pub(crate) fn feedback(&self) -> Option<Feedback> {
        self.adapts.map(|admitted| Feedback {
            cell: self.cell.clone(),
            family: self.family,
            admitted,
        })
    }

    /// What the request body carries to report the instant the request is handed to its
    /// upstream connection; `None` when no limit counted in time was paid.
    pub fn send_hook(&self) -> Option<SendHook> {
        self.ticket.clone().map(SendHook)
    }

    /// The response announced the provider's budget for this partition
    /// (`learn = "headers"`): it may set or lift the partition's learned pace.
    pub(crate) fn learn(&self, a: crate::policy::announced::Announced) {
        let mut st = self.cell.lock();
        let now = Instant::now();
        let before = st.bucket.learned.as_ref().is_some_and(|l| l.active(now));
        let aligned = st.bucket.learn(a, now);
        let after = st.bucket.learned.as_ref().map(|l| l.rate());
        self.cell.changed(&mut st, now);
        drop(st);
        if aligned {
            tracing::info!(
                upstream = &*self.cell.name,
                reset_s = a.reset.as_secs(),
                source = a.source,
                "the provider's window ends elsewhere than this limit's clock edges: they follow the reset it announced"
            );
        }
        match (before, after) {
            (false, Some(rate)) => tracing::info!(
                upstream = &*self.cell.name,
                remaining = a.remaining,
                reset_s = a.reset.as_secs(),
                pace_per_s = rate,
                source = a.source,
                "the provider has fewer requests left than this partition's limits allow (another client spends the key): pacing to its budget until its reset"
            ),
            (true, None) => tracing::info!(
                upstream = &*self.cell.name,
                remaining = a.remaining,
                source = a.source,
                "the provider's budget is back within this partition's limits: learned pace lifted"
            ),
            _ => {}
        }
    }

    /// The response head, with `status`, arrived now: the provider had counted the
    /// request by then.
    pub fn answered(&mut self, status: u16) {
        if let Some(t) = self.ticket.take() {
            let mut st = t.cell.lock();
            let now = Instant::now();
            let mut sent = None;
            match t.phase.load(Ordering::Relaxed) {
                phase @ (ADMITTED | UNSENT) => {
                    // A response without a reported send: it was sent by now at the latest.
                    let epoch = (phase == ADMITTED).then_some(t.epoch);
                    st.bucket.sent(t.family, t.id, epoch, now);
                    st.bucket.answered(t.family, t.id, now, Duration::ZERO);
                    sent = Some((now, Duration::ZERO));
                }
                SENT => {
                    let took = now.saturating_duration_since(t.sent_at());
                    st.bucket.answered(t.family, t.id, now, took);
                    sent = Some((t.sent_at(), took));
                }
                _ => {}
            }
            t.phase.store(ANSWERED, Ordering::Relaxed);
            // After a reload the limit it waited for may be another one: no hint then.
            if status == 429
                && let Some(limit) = t.edge
                && t.epoch == st.bucket.epoch()
            {
                t.cell
                    .refused_at_edge(&mut st, t.family, limit, t.admitted, now);
            }
            t.cell.changed(&mut st, now);
            drop(st);
            if let (Some(g), Some((at, took))) = (&t.global, sent) {
                g.answered(at, now, took);
            }
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let ticket = self.ticket.take();
        if !self.holds && ticket.is_none() {
            return;
        }
        let mut st = self.cell.lock();
        let mut unsent = None;
        if let Some(t) = ticket
            && t.phase.load(Ordering::Relaxed) == ADMITTED
        {
            // Never handed to a connection: the provider did not see it.
            st.bucket.unsent(t.family, t.epoch);
            t.phase.store(UNSENT, Ordering::Relaxed);
            unsent = Some(t);
        }
        if self.holds {
            st.bucket.release(self.family, self.epoch);
        }
        self.cell.changed(&mut st, Instant::now());
        drop(st);
        if let Some(g) = unsent.as_ref().and_then(|t| t.global.as_ref()) {
            g.unsent();
        }
    }
}

const ADMITTED: u8 = 0;
const SENT: u8 = 1;
const ANSWERED: u8 = 2;
/// Given back before it was sent (the request failed or left first).
const UNSENT: u8 = 3;

/// One admission's way through the limits counted in time, shared by its [`Permit`] and
/// its [`SendHook`]. `phase` changes only under the cell's lock, so a send that races the
/// request's cancellation is settled there, one way or the other.
pub(crate) struct Ticket {
    cell: Arc<Cell>,
    family: FamilyRef,
    id: Id,
    epoch: u64,
    phase: AtomicU8,
    admitted: Instant,
    /// Nanoseconds from admission to send, once sent.
    sent_after: AtomicU64,
    /// The rate limit it waited for: it was admitted at that limit's edge.
    edge: Option<LimitRef>,
    /// Its shared limits, to be told of its send and answer too.
    global: Option<Box<dyn Reservation>>,
}

impl Ticket {
    fn sent_at(&self) -> Instant {
        self.admitted + Duration::from_nanos(self.sent_after.load(Ordering::Relaxed))
    }
}

/// Reports the instant a request is handed to its upstream connection (see
/// `upstream::outbound::Outbound`), once.
pub struct SendHook(Arc<Ticket>);

impl SendHook {
    pub fn fire(self) {
        let t = &self.0;
        let mut st = t.cell.lock();
        let now = Instant::now();
        let epoch = match t.phase.load(Ordering::Relaxed) {
            ADMITTED => Some(t.epoch),
            // Its permit was already given back, but the provider will see it: count it.
            UNSENT => None,
            _ => return,
        };
        st.bucket.sent(t.family, t.id, epoch, now);
        let after = now.saturating_duration_since(t.admitted).as_nanos();
        t.sent_after
            .store(u64::try_from(after).unwrap_or(u64::MAX), Ordering::Relaxed);
        t.phase.store(SENT, Ordering::Relaxed);
        t.cell.changed(&mut st, now);
        drop(st);
        if let Some(g) = &t.global
            && epoch.is_some()
        {
            g.sent(now);
        }
    }
}

/// All partitions of all upstreams, and the plans new partitions are built from.
pub struct Limiter {
    /// Set at the end of the drain: queued and new requests are refused.
    closed: std::sync::atomic::AtomicBool,
    /// The live config's plans, by upstream index.
    current: RwLock<Plans>,
    registry: Registry,
    /// The runtime partition drivers run on, when not the requests' own (see
    /// [`Limiter::drive_on`]).
    timers: std::sync::OnceLock<tokio::runtime::Handle>,
    /// Where shared limits are decided (`[cluster]`), as the live config says.
    store: RwLock<Option<Arc<dyn Store>>>,
}

/// One config generation's plans, by upstream index.
pub(crate) type Plans = Arc<[Arc<Plan>]>;

/// Builds the plans of every upstream of `config`.
pub fn plans(config: &Config, metrics: &Metrics) -> Plans {
    config
        .upstreams
        .iter()
        .map(|u| Arc::new(Plan::new(u, metrics)))
        .collect()
}

impl Limiter {
    pub fn new(config: &Config, metrics: &Metrics) -> Limiter {
        Limiter {
            closed: std::sync::atomic::AtomicBool::new(false),
            current: RwLock::new(plans(config, metrics)),
            registry: Registry::new(),
            timers: std::sync::OnceLock::new(),
            store: RwLock::new(None),
        }
    }

    /// The cluster shared limits go through from now on (`None`: no `[cluster]`).
    pub(crate) fn set_store(&self, store: Option<Arc<dyn Store>>) {
        *self.store.write() = store;
    }

    fn store(&self) -> Option<Arc<dyn Store>> {
        self.store.read().clone()
    }

    /// The plans new partitions are built from.
    pub fn plans(&self) -> Plans {
        self.current.read().clone()
    }

    /// A reload: every live partition of an upstream that `plans` has moves to its new
    /// limits in place (see [`Bucket::reconfigure`]), and new partitions use them. Those of
    /// upstreams it no longer has are left as they are, to drain and be swept.
    pub fn reload(&self, plans: Plans) {
        // From here on new partitions are built from `plans`; every partition that exists
        // is in the registry by the time its shard is read (a partition is made under its
        // shard's lock, from the plans current then). The registry is not held while they
        // are moved one by one, so requests keep flowing; one that reaches a partition
        // first moves it itself.
        *self.current.write() = plans.clone();
        let cells = self.registry.cells();
        for cell in cells {
            let Some(plan) = plans.iter().find(|p| p.name == cell.name) else {
                continue;
            };
            let mut st = cell.lock();
            let now = Instant::now();
            if st.catch_up(plan, now) {
                // A raised limit admits at once; a changed one may move the next wake-up.
                cell.dispatch(&mut st, now);
                cell.wake_driver(&mut st);
            }
        }
    }

    /// Runs the partitions' drivers (the tasks that sleep until a queued request is
    /// due) on `rt` from now on. With one event loop per worker, a driver on a busy
    /// worker's loop wakes as late as that loop gets round to its timers; on a quiet
    /// runtime it wakes on time and hands the permit across.
    pub(crate) fn drive_on(&self, rt: tokio::runtime::Handle) {
        let _ = self.timers.set(rt);
    }

    /// The route's partition, made if it is new and its upstream has room for it.
    fn cell(&self, plan: &Arc<Plan>, route: &Route) -> Result<Arc<Cell>, LimitError> {
        let key = (plan.name.clone(), route.partition);
        let made = self
            .registry
            .get_or_make(key, plan.max_partitions, |occupancy| {
                // Built from the live plan, even for a request routed just before a reload,
                // so no partition is born with limits that are already gone.
                let current = self.current.read();
                let plan = current
                    .iter()
                    .find(|p| p.name == plan.name)
                    .unwrap_or(plan)
                    .clone();
                Cell {
                    name: plan.name.clone(),
                    partition: route.partition,
                    state: Mutex::new(CellState {
                        bucket: Bucket::new(&plan.spec, Instant::now()),
                        driver: false,
                        plan,
                        retired: Vec::new(),
                    }),
                    notify: Notify::new(),
                    timers: self.timers.get().cloned(),
                    shared: Mutex::new(None),
                    occupancy,
                }
            });
        made.map_err(|registry::Full| self.refuse_partition(plan, route))
    }

    /// A new partition beyond its upstream's `max_partitions`: counted, logged once a
    /// minute, refused.
    fn refuse_partition(&self, plan: &Arc<Plan>, route: &Route) -> LimitError {
        let index = plan.family_index(route.family);
        plan.metrics[index].partition_limit.inc();
        let occupancy = self.registry.occupancy(&plan.name);
        let now = Instant::now();
        let mut warned = occupancy.warned.lock();
        if warned.is_none_or(|t| now.duration_since(t) >= HINT_EVERY) {
            *warned = Some(now);
            tracing::warn!(
                upstream = %plan.name,
                max_partitions = plan.max_partitions,
                "new partitions refused: the upstream has max_partitions live ones; \
                 raise max_partitions if its key really has that many values in use"
            );
        }
        LimitError::PartitionLimit {
            retry_after: SWEEP_EVERY,
        }
    }

    /// Waits, FIFO within the route's family, until every limit admits the request.
    /// `plan` is the route's upstream in the config the route came from.
    /// Dropping the future while it waits leaves the queue and takes nothing.
    pub async fn acquire(
        &self,
        plan: &Arc<Plan>,
        route: &Route,
    ) -> Result<Option<Permit>, LimitError> {
        self.acquire_by(plan, route, None).await
    }

    /// As [`Limiter::acquire`], for a request that waits no later than `deadline` (the
    /// client's `sluice-max-wait`) if that comes before its family's `max_wait` runs out.
    pub(crate) async fn acquire_by(
        &self,
        plan: &Arc<Plan>,
        route: &Route,
        deadline: Option<Instant>,
    ) -> Result<Option<Permit>, LimitError> {
        let cell = self.cell(plan, route)?;
        let index = plan.family_index(route.family);
        let at = Place {
            index,
            tenant: route.tenant,
            deadline,
        };
        if plan.global(index).is_empty() {
            return self.wait(cell, plan, at).await;
        }
        // Boxed: shared limits are the rarer path, and their future would otherwise
        // size every request's.
        Box::pin(self.wait_shared(cell, plan, at)).await
    }

    /// Whether a request of `route` pays any limit, local or shared: only then does its
    /// response say how long it waited.
    pub(crate) fn limited(plan: &Plan, route: &Route) -> bool {
        let index = plan.family_index(route.family);
        !plan.spec.upstream_limits.is_empty()
            || !plan.spec.families[index].limits.is_empty()
            || !plan.global(index).is_empty()
    }

    /// Local limits first, FIFO in the family's queue; then the shared ones, through the
    /// cluster (see `cluster`), one request of the family at a time.
    async fn wait_shared(
        &self,
        cell: Arc<Cell>,
        plan: &Arc<Plan>,
        at: Place,
    ) -> Result<Option<Permit>, LimitError> {
        let (index, deadline) = (at.index, at.deadline);
        let start = Instant::now();
        let Some(mut permit) = self.wait(cell.clone(), plan, at).await? else {
            return Ok(None);
        };
        // A config with global limits always has a cluster; without one, they are
        // counted nowhere rather than blocking.
        let Some(store) = self.store() else {
            return Ok(Some(permit));
        };
        let family = &plan.spec.families[index];
        let admitted = Instant::now();
        let shared = cell.shared(&store);
        // The family's shared limits in the partition's live plan (it follows every
        // reload), those of the plan it was routed under if a reload removed the family.
        let routed = plan.global(index).clone();
        let live = || {
            let st = cell.lock();
            st.plan
                .spec
                .families
                .iter()
                .position(|f| f.name == family.name)
                .map_or_else(|| routed.clone(), |i| st.plan.global(i).clone())
        };
        let reservation = shared
            .admit(
                &family.name,
                &live,
                deadline.map_or(start + family.max_wait, |d| d.min(start + family.max_wait)),
            )
            .await?;
        plan.metrics[index]
            .cluster_wait
            .observe(admitted.elapsed().as_secs_f64());
        if let Some(r) = reservation {
            permit.hold(r);
        }
        Ok(Some(permit))
    }

    /// A CONNECT tunnel's permit: one of the upstream's concurrency limits for as long as
    /// the tunnel is open, or nothing when it has none.
    pub(crate) async fn acquire_tunnel(
        &self,
        plan: &Arc<Plan>,
        route: &Route,
    ) -> Result<Option<Permit>, LimitError> {
        if !plan.tunnels {
            return Ok(None);
        }
        let cell = self.cell(plan, route)?;
        let at = Place {
            index: plan.tunnel_index(),
            tenant: None,
            deadline: None,
        };
        self.wait(cell, plan, at).await
    }

    async fn wait(
        &self,
        cell: Arc<Cell>,
        plan: &Arc<Plan>,
        at: Place,
    ) -> Result<Option<Permit>, LimitError> {
        let Place {
            index,
            tenant,
            deadline,
        } = at;
        use std::sync::atomic::Ordering;
        if self.closed.load(Ordering::Acquire) {
            return Err(LimitError::ShuttingDown);
        }
        let (mut rx, family, seq, max_wait) = {
            let mut st = cell.lock();
            let now = Instant::now();
            if st.catch_up(plan, now) {
                cell.dispatch(&mut st, now);
                cell.wake_driver(&mut st);
            }
            let slot = st.slot(plan, index);
            let max_wait = st.bucket.families[slot].spec.max_wait;
            let max_wait =
                deadline.map_or(max_wait, |d| max_wait.min(d.saturating_duration_since(now)));
            if let Err(r) = st.bucket.check_within(slot, tenant, now, max_wait) {
                let m = st.metrics(slot);
                match r {
                    Reject::QueueFull { .. } => m.queue_full.inc(),
                    Reject::QueueTimeout { .. } => m.queue_timeout.inc(),
                }
                return Err(r.into());
            }
            // No one waits and every limit allows it: admitted without the queue, its
            // channel or a dispatch round.
            if let Some(seq) = st.bucket.admit_now(slot, now) {
                let m = st.metrics(slot);
                m.wait.observe(0.0);
                let epoch = st.bucket.epoch();
                let grant = cell.grant(&st, slot, seq, now, None, epoch);
                return Ok(grant.into_permit());
            }
            let (tx, rx) = oneshot::channel();
            let seq = st.bucket.push(slot, tenant, Waiter { tx }, now);
            st.metrics(slot).depth.inc();
            let family = st.bucket.family_ref(slot);
            cell.dispatch(&mut st, now);
            cell.wake_driver(&mut st);
            (rx, family, seq, max_wait)
        };
        if let Ok(grant) = rx.try_recv() {
            return Ok(grant.into_permit());
        }
        let mut guard = Queued {
            cell: &cell,
            family,
            seq,
            tenant,
            armed: true,
        };
        match tokio::time::timeout(max_wait, &mut rx).await {
            Ok(Ok(grant)) => {
                guard.armed = false;
                Ok(grant.into_permit())
            }
            // The sender went away without a grant: the queues were emptied at the end of
            // the drain.
            Ok(Err(_)) => {
                guard.armed = false;
                Err(LimitError::ShuttingDown)
            }
            Err(_) => {
                let retry_after = {
                    let mut st = cell.lock();
                    let slot = st.bucket.find(family);
                    if let Some(slot) = slot {
                        st.metrics(slot).queue_timeout.inc();
                    }
                    slot.map_or(Duration::from_secs(1), |slot| {
                        st.bucket.timeout_hint(slot, seq, tenant, Instant::now())
                    })
                };
                drop(guard);
                // Admitted in the same instant the wait ran out: `rx` drops the grant,
                // which gives the permits back.
                Err(LimitError::QueueTimeout { retry_after })
            }
        }
    }

    /// End of the drain: every queued request, and any that arrives from now on, is
    /// refused with `ShuttingDown`. Requests already admitted are not touched.
    pub(crate) fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        for cell in self.registry.cells() {
            let mut st = cell.lock();
            let waiters = st.bucket.take_all_waiters();
            for (slot, waiter) in waiters {
                st.metrics(slot).depth.dec();
                // Dropping the sender wakes the waiter with nothing: it answers 503.
                drop(waiter);
            }
        }
    }

    /// Pauses a route's family (`family = true`) or its whole upstream, for this
    /// partition, until `until`: the 429 cool-down hook.
    pub(crate) fn pause(&self, plan: &Arc<Plan>, route: &Route, family: bool, until: Instant) {
        // Its request made the partition; it is gone only if it has been idle since.
        let Ok(cell) = self.cell(plan, route) else {
            return;
        };
        let mut st = cell.lock();
        let now = Instant::now();
        if st.catch_up(plan, now) {
            cell.dispatch(&mut st, now);
            cell.wake_driver(&mut st);
        }
        let f = family.then(|| st.slot(plan, plan.family_index(route.family)));
        st.bucket.pause(f, until);
        cell.wake_driver(&mut st);
    }

    /// Drops partitions nobody uses that are back to their initial state, and keeps
    /// what the admin views show of the rest; returns how many remain. Memory is thus
    /// bounded by the partitions active recently, and by `max_partitions`.
    pub fn sweep(&self) -> usize {
        self.registry.sweep(Instant::now())
    }

    /// By upstream name: its live partitions, as of the last sweep (or now, when few).
    pub(crate) fn live_partitions(&self) -> HashMap<Arc<str>, usize> {
        self.registry.summary(Instant::now()).live.clone()
    }

    /// The rate limits a request of `route` pays, as the IETF draft's fields describe
    /// quotas (`ratelimit_headers`): `RateLimit-Policy` with each limit's quota `q` in
    /// a window of `w` seconds, and `RateLimit` with the permits `r` free now and the
    /// whole seconds `t` until one more is. Items are named after the upstream, or
    /// `upstream/family`, with `.N` when a level has several rate limits.
    pub(crate) fn ratelimit_fields(
        &self,
        plan: &Arc<Plan>,
        route: &Route,
    ) -> Option<(String, String)> {
        let cell = self.cell(plan, route).ok()?;
        let mut st = cell.lock();
        let now = Instant::now();
        let slot = st.slot(plan, plan.family_index(route.family));
        let (mut policy, mut current) = (Vec::new(), Vec::new());
        let b = &mut st.bucket;
        let family = b.families[slot].spec.clone();
        let named = |level: String, n: usize, i: usize| {
            if n > 1 { format!("{level}.{i}") } else { level }
        };
        let mut describe = |name: String, spec: &Limit, state: &mut LimitState| {
            // A window's quota, or a bucket's burst and the time it takes to refill.
            let (q, w) = match (spec.window_limit(), spec.burst(), spec.rate_per_second()) {
                (Some((permits, window)), ..) => (u64::from(permits), window.as_secs_f64()),
                (None, Some(burst), Some(rate)) => (u64::from(burst), f64::from(burst) / rate),
                _ => return,
            };
            let r = state.available(now);
            let t = state
                .ready_at(r + 1, now)
                .map_or(0.0, |at| at.saturating_duration_since(now).as_secs_f64())
                .ceil() as u64;
            policy.push(format!("\"{name}\";q={q};w={}", w.ceil().max(1.0) as u64));
            current.push(format!("\"{name}\";r={r};t={t}"));
        };
        let up_specs = b.upstream_spec.clone();
        let n = up_specs.len();
        for (i, (spec, state)) in up_specs.iter().zip(b.upstream.iter_mut()).enumerate() {
            if family.concurrency_only {
                break;
            }
            describe(named(cell.name.to_string(), n, i), spec, state);
        }
        let level = format!("{}/{}", cell.name, family.name);
        let n = family.limits.len();
        let fb = &mut b.families[slot];
        for (i, (spec, state)) in family.limits.iter().zip(fb.limits.iter_mut()).enumerate() {
            describe(named(level.clone(), n, i), spec, state);
        }
        (!policy.is_empty()).then(|| (policy.join(", "), current.join(", ")))
    }

    /// By upstream name: the slowest pace a partition learned from the provider and how
    /// many partitions pace now (`learn = "headers"`), as the summary has it.
    pub(crate) fn learned_paces(&self) -> HashMap<Arc<str>, (f64, usize)> {
        self.registry.summary(Instant::now()).paces.clone()
    }

    /// By (upstream, family) name: the lowest share of its configured rate that an
    /// adaptive family's partition may send now (1 when none is slowed), as the summary
    /// has it.
    pub(crate) fn adaptive_shares(&self) -> HashMap<(Arc<str>, String), f64> {
        self.registry.summary(Instant::now()).shares.clone()
    }

    pub fn partitions(&self) -> usize {
        self.registry.len()
    }

    /// The buckets for `/buckets`: one entry for each partition's upstream limits and one
    /// per family, with available permits, queue depth and remaining pause. Every
    /// partition while they are few (up to [`registry::FRESH_UP_TO`]); beyond that the
    /// [`registry::KEPT`] with most requests waiting of each upstream, as of the last
    /// sweep. Also how many partitions are left out.
    pub(crate) fn snapshot(&self) -> (serde_json::Value, usize) {
        let now = Instant::now();
        let store = self.store();
        let all = self.registry.len();
        let cells: Vec<Arc<Cell>> = if all <= registry::FRESH_UP_TO {
            self.registry.cells()
        } else {
            let summary = self.registry.summary(now);
            summary
                .busiest
                .values()
                .flatten()
                .filter_map(Weak::upgrade)
                .collect()
        };
        let omitted = all.saturating_sub(cells.len());
        let mut out = Vec::new();
        for cell in cells {
            out.extend(cell_entries(&cell, now, store.as_ref()));
        }
        (serde_json::Value::Array(out), omitted)
    }

    /// For the status page, by upstream name: its `top` partitions with the most requests
    /// waiting (as `/buckets` describes them), and how many others it has.
    pub(crate) fn busiest(&self, top: usize) -> HashMap<Arc<str>, (Vec<serde_json::Value>, usize)> {
        let now = Instant::now();
        let store = self.store();
        let summary = self.registry.summary(now);
        summary
            .busiest
            .iter()
            .map(|(name, cells)| {
                let shown: Vec<serde_json::Value> = cells
                    .iter()
                    .filter_map(Weak::upgrade)
                    .take(top)
                    .map(|c| serde_json::Value::from(cell_entries(&c, now, store.as_ref())))
                    .collect();
                let live = summary.live.get(name).copied().unwrap_or(0);
                let others = live.saturating_sub(shown.len());
                (name.clone(), (shown, others))
            })
            .collect()
    }
}

/// One partition as `/buckets` shows it: an entry for its upstream's limits, then one
/// per family that has limits or waiters.
fn cell_entries(
    cell: &Arc<Cell>,
    now: Instant,
    store: Option<&Arc<dyn Store>>,
) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    let mut st = cell.lock();
    let st = &mut *st;
    let partition = cell
        .partition
        .map_or_else(|| "-".to_string(), |p| p.short());
    let b = &mut st.bucket;
    let paused = |t: Option<Instant>| t.filter(|t| *t > now).map(|t| (t - now).as_secs_f64());
    let spec = b.upstream_spec.clone();
    let mut entry = json!({
        "upstream": &*cell.name,
        "family": null,
        "partition": partition,
        "limits": limits_json(&spec, &mut b.upstream, now),
        "queue_depth": b.waiting(),
        "paused_for_seconds": paused(b.paused_until),
    });
    if let Some(l) = b.learned.as_ref().filter(|l| l.active(now))
        && let Some(o) = entry.as_object_mut()
    {
        o.insert(
            "learned".into(),
            json!({
                "source": l.announced.source,
                "announced_remaining": l.announced.remaining,
                "left": l.left,
                "resets_in_seconds": (l.reset - now).as_secs_f64(),
                "pace_per_second": l.rate(),
            }),
        );
    }
    if let Some(o) = entry.as_object_mut() {
        shared_json(cell, &st.plan, store, o);
    }
    out.push(entry);
    let ours = st.plan.family_index(None);
    let live = st.plan.spec.families.len();
    for (i, fb) in b.families.iter_mut().enumerate() {
        // Our own queues (no family, tunnels) are shown only while they hold some.
        if (ours..live).contains(&i) && fb.queue.is_empty() {
            continue;
        }
        let f = fb.spec.clone();
        let mut v = json!({
            "upstream": &*cell.name,
            "family": f.name,
            "partition": partition,
            "priority": f.priority,
            "limits": limits_json(&f.limits, &mut fb.limits, now),
            "queue_depth": fb.queue.len(),
            "oldest_wait_seconds": fb.queue.oldest().map(|t| (now - t).as_secs_f64()),
            "paused_for_seconds": paused(fb.paused_until),
        });
        if i >= live
            && let Some(o) = v.as_object_mut()
        {
            // Removed by a reload; its queued requests finish under these limits.
            o.insert("retired".into(), true.into());
        }
        if let Some(n) = fb.queue.tenants()
            && let Some(o) = v.as_object_mut()
        {
            o.insert("tenants_waiting".into(), n.into());
        }
        if let Some(a) = &fb.aimd
            && let Some(o) = v.as_object_mut()
        {
            o.insert(
                "adaptive".into(),
                json!({
                    "rate_per_second": a.rate(),
                    "configured_per_second": a.configured(),
                }),
            );
        }
        out.push(v);
    }
    out
}

/// The partition's shared limits (the upstream's and its families'), how they are decided
/// now, and what this replica has of them; nothing when it pays none.
fn shared_json(
    cell: &Cell,
    plan: &Plan,
    store: Option<&Arc<dyn Store>>,
    o: &mut serde_json::Map<String, serde_json::Value>,
) {
    let mut shared: Vec<&Arc<GlobalLimit>> = Vec::new();
    for l in plan.global.iter().flat_map(|g| g.iter()) {
        if !shared.iter().any(|s| s.id == l.id) {
            shared.push(l);
        }
    }
    if shared.is_empty() {
        return;
    }
    let limits: Vec<serde_json::Value> = shared
        .iter()
        .map(|l| {
            let mut v = serde_json::to_value(&l.spec).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert("id".into(), l.id.to_string().into());
                o.insert("margin".into(), fmt_duration(l.margin).into());
            }
            v
        })
        .collect();
    o.insert("shared_limits".into(), limits.into());
    if let Some(c) = store {
        o.insert("cluster".into(), c.describe());
    }
    if let Some((_, sh)) = &*cell.shared.lock() {
        o.insert("this_replica".into(), sh.describe());
    }
}

fn limits_json(specs: &[Limit], states: &mut [LimitState], now: Instant) -> serde_json::Value {
    specs
        .iter()
        .zip(states.iter_mut())
        .map(|(spec, state)| {
            let mut v = serde_json::to_value(spec).unwrap_or(serde_json::Value::Null);
            if let Some(o) = v.as_object_mut() {
                o.insert("available".into(), state.available(now).into());
                if let Some(m) = state.margin() {
                    // The margin in force, written or default.
                    o.insert("margin".into(), fmt_duration(m).into());
                    // Admitted, still connecting: their permits have no return time yet.
                    o.insert("unsent".into(), state.unsent_count().into());
                }
                if let Some((next, slack)) = state.clock_edges(now) {
                    let next = Duration::from_millis(next.as_millis() as u64);
                    o.insert("next_edge_in".into(), fmt_duration(next).into());
                    let from = if slack.is_zero() {
                        "clock"
                    } else {
                        "announced reset"
                    };
                    o.insert("edges_from".into(), from.into());
                }
            }
            v
        })
        .collect()
}

/// A waiter's place in a queue; leaving scope without a grant removes it.
struct Queued<'a> {
    cell: &'a Arc<Cell>,
    family: FamilyRef,
    seq: u64,
    tenant: Option<bucket::Tenant>,
    armed: bool,
}

/// Where a request waits: its family's queue, as which tenant, and until when at most
/// (the client's `sluice-max-wait`).
#[derive(Clone, Copy)]
struct Place {
    index: usize,
    tenant: Option<bucket::Tenant>,
    deadline: Option<Instant>,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut st = self.cell.lock();
        if let Some((slot, _)) = st.bucket.cancel(self.family, self.seq, self.tenant) {
            st.metrics(slot).depth.dec();
            // A head that leaves may unblock the next one in its family.
            self.cell.dispatch(&mut st, Instant::now());
            self.cell.wake_driver(&mut st);
        }
    }
}

#[cfg(test)]
mod tests;
