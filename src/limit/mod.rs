//! The limiter: every request that matches an upstream waits here, FIFO within its
//! family, until every limit of its upstream and family admits it at one instant.
//!
//! - [`kinds`]: the limit kinds, pure in `now`.
//! - [`bucket`]: one partition's limits, queues and pauses, and the admission rule.
//! - `plan`: an upstream's limits as one config generation gives them, its shared limits
//!   and metric handles.
//! - `cell`: a partition's cell and the permits it grants. Each (upstream, partition) is
//!   a `Cell`: one mutex over its bucket, so a request takes all its permits under one
//!   lock. Arrivals and releases admit inline; a driver task per cell (alive only while
//!   someone waits) sleeps until the next instant time alone could admit someone.
//!   Admitted waiters get a `Grant` through a oneshot channel; a grant that is never
//!   received gives its permits back, so a waiter that disappears at the moment it is
//!   admitted costs nothing. Permit returns are owned by the limiter: rate limits by the
//!   instants their requests were sent and answered (reported by the request's ticket),
//!   concurrency by the [`Permit`] guard that the response body carries to its end.
//! - `registry`: the partitions in shards; `view`: `/buckets` and the admin summaries.
//! - this module: the [`Limiter`], where a request waits for its grant.
//!
//! The submodules import one another downward (plan, then cell, then registry) and never
//! this module, which imports them all (`scripts/check-layers` fails a cycle).
//!
//! An admitted request is counted from the instant it is handed to its upstream
//! connection, after connecting and TLS, not from its admission: that is when the
//! provider can start counting it. The [`SendHook`] travels inside the request body and
//! reports that instant when hyper takes the request to write it; the pipeline reports
//! the response head. A request that never reached its connection gives its rate
//! permits back.

pub(crate) mod aimd;
pub(crate) mod bucket;
mod cell;
pub(crate) mod costs;
pub(crate) mod error;
pub(crate) mod exposure;
pub(crate) mod kinds;
pub(crate) mod learned;
mod plan;
pub(crate) mod queue;
mod registry;
pub(crate) mod shared;
mod view;

pub(crate) use error::LimitError;

use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use bucket::{Bucket, FamilyRef, Reject};
use kinds::LimitState;

use crate::config::{Config, Limit};
use crate::metrics::Metrics;
use crate::route::Route;
use registry::Registry;
use shared::Store;

pub(crate) use cell::{Cell, Feedback};
use cell::{CellState, Waiter};
pub(crate) use cell::{Correction, Permit, SendHook};
pub use cell::{PARTITION_MEMORY, max_partitions, partition_bytes};
use plan::HINT_EVERY;
pub use plan::Plan;
pub(crate) use plan::Plans;

/// How often idle partitions are looked for and dropped.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(5);

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

/// Builds the plans of every upstream of `config`.
pub fn plans(config: &Config, metrics: &Metrics) -> Plans {
    config
        .upstreams
        .iter()
        .map(|u| Arc::new(Plan::new(u, metrics, max_partitions(u))))
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
    /// Not itself `async`, so that its future is `acquire_priced`'s, not one around it.
    pub(crate) fn acquire_by<'a>(
        &'a self,
        plan: &'a Arc<Plan>,
        route: &'a Route,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Option<Permit>, LimitError>> + 'a {
        self.acquire_priced(plan, route, &costs::Costs::ONE, deadline)
    }

    /// As [`Limiter::acquire_by`], for a request that costs `costs`: every limit takes
    /// its cost in the unit it counts, and its queue's head waits until all of it fits.
    pub(crate) async fn acquire_priced(
        &self,
        plan: &Arc<Plan>,
        route: &Route,
        costs: &costs::Costs,
        deadline: Option<Instant>,
    ) -> Result<Option<Permit>, LimitError> {
        let cell = self.cell(plan, route)?;
        let index = plan.family_index(route.family);
        let at = Place {
            index,
            tenant: route.tenant,
            deadline,
            costs,
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
        at: Place<'_>,
    ) -> Result<Option<Permit>, LimitError> {
        let (index, deadline, costs) = (at.index, at.deadline, at.costs);
        let start = crate::clock::now();
        let Some(mut permit) = self.wait(cell.clone(), plan, at).await? else {
            return Ok(None);
        };
        // A config with global limits always has a cluster; without one, they are
        // counted nowhere rather than blocking.
        let Some(store) = self.store() else {
            return Ok(Some(permit));
        };
        let family = &plan.spec.families[index];
        let admitted = crate::clock::now();
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
                costs,
                deadline.map_or(start + family.max_wait, |d| d.min(start + family.max_wait)),
            )
            .await?;
        plan.metrics[index]
            .cluster_wait
            .observe(admitted.elapsed().as_secs_f64());
        if let Some(r) = reservation {
            permit.hold(r, costs);
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
            costs: &costs::Costs::ONE,
        };
        self.wait(cell, plan, at).await
    }

    async fn wait(
        &self,
        cell: Arc<Cell>,
        plan: &Arc<Plan>,
        at: Place<'_>,
    ) -> Result<Option<Permit>, LimitError> {
        let Place {
            index,
            tenant,
            deadline,
            costs,
        } = at;
        use std::sync::atomic::Ordering;
        if self.closed.load(Ordering::Acquire) {
            return Err(LimitError::ShuttingDown);
        }
        let (mut rx, family, seq, max_wait) = {
            let mut st = cell.lock();
            let now = crate::clock::now();
            if st.catch_up(plan, now) {
                cell.dispatch(&mut st, now);
                cell.wake_driver(&mut st);
            }
            let slot = st.slot(plan, index);
            // No one waits and every limit allows it: admitted without the queue, its
            // channel or a dispatch round. Before the queue's checks, which such a request
            // always passes (an empty queue has room, and its wait is none).
            if let Some(seq) = st.bucket.admit_now(slot, costs, now) {
                let m = st.metrics(slot);
                m.wait.observe(0.0);
                let epoch = st.bucket.epoch();
                let grant = cell.grant(&st, slot, (seq, *costs), now, None, epoch);
                return Ok(grant.into_permit());
            }
            let max_wait = st.bucket.families[slot].spec.max_wait;
            let max_wait =
                deadline.map_or(max_wait, |d| max_wait.min(d.saturating_duration_since(now)));
            if let Err(r) = st.bucket.check_within(slot, tenant, *costs, now, max_wait) {
                let m = st.metrics(slot);
                match r {
                    Reject::QueueFull { .. } => m.queue_full.inc(),
                    Reject::QueueTimeout { .. } => m.queue_timeout.inc(),
                }
                return Err(r.into());
            }
            let (tx, rx) = oneshot::channel();
            let seq = st.bucket.push(slot, tenant, *costs, Waiter { tx }, now);
            st.metrics(slot).queued(costs, true);
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
            for (slot, costs, waiter) in waiters {
                st.metrics(slot).queued(&costs, false);
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
            // The draft's quota unit: requests unless the limit counts a priced unit.
            let unit = spec
                .unit_ref()
                .name
                .as_ref()
                .map_or_else(String::new, |u| format!(";qu=\"{u}\""));
            policy.push(format!(
                "\"{name}\";q={q};w={}{unit}",
                w.ceil().max(1.0) as u64
            ));
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
struct Place<'a> {
    index: usize,
    tenant: Option<bucket::Tenant>,
    deadline: Option<Instant>,
    /// What the request costs: borrowed, so that a request's future does not carry it.
    costs: &'a costs::Costs,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut st = self.cell.lock();
        if let Some((slot, q)) = st.bucket.cancel(self.family, self.seq, self.tenant) {
            st.metrics(slot).queued(&q.costs, false);
            // A head that leaves may unblock the next one in its family.
            self.cell.dispatch(&mut st, Instant::now());
            self.cell.wake_driver(&mut st);
        }
    }
}

#[cfg(test)]
mod tests;
