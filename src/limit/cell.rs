//! A partition's cell and its permits. The cell is one mutex over the partition's
//! bucket, so that a request takes all its permits under one lock; arrivals and releases
//! admit inline, and a driver task (alive only while someone waits) sleeps until the next
//! instant time alone could admit someone. Admitted waiters get a grant through a oneshot
//! channel; one never received gives its permits back. What an admitted request holds is
//! its permit (the concurrency slot the response body carries to its end) and the ticket
//! through which its send and answer reach the limits counted in time and its shared
//! reservation.

use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::bucket::{Admitted, Bucket, FamilyRef, LimitRef};
use super::costs::Costs;
use super::kinds::{Id, LimitState};

use crate::config::units::fmt_duration;
use crate::config::{Limit, Upstream};
use crate::route::Partition;

use super::bucket::FamilyBucket;
use super::plan::{FamilyMetrics, HINT_EVERY, Plan, TUNNEL};
use super::shared::{Reservation, Store, StorePartition};
use std::sync::atomic::AtomicUsize;

/// A request waiting in a queue: where to send its grant.
pub(super) struct Waiter {
    pub(super) tx: oneshot::Sender<Grant>,
}

pub(super) struct CellState {
    pub(super) bucket: Bucket<Waiter>,
    pub(super) driver: bool,
    /// The plan the bucket is configured from; its families are the bucket's first slots.
    pub(super) plan: Arc<Plan>,
    /// Metric handles of retired slots (after the plan's families), from their own plan.
    pub(super) retired: Vec<Arc<FamilyMetrics>>,
}

impl CellState {
    pub(super) fn metrics(&self, slot: usize) -> &FamilyMetrics {
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
    pub(super) fn slot(&self, plan: &Arc<Plan>, index: usize) -> usize {
        if Arc::ptr_eq(plan, &self.plan) {
            return index;
        }
        self.bucket
            .slot_named(&plan.spec.families[index].name)
            .unwrap_or(self.plan.family_index(None))
    }

    /// Moves the bucket to `plan` if it is newer than the one it has (a reload that has
    /// not reached this partition yet); returns whether it did.
    pub(super) fn catch_up(&mut self, plan: &Arc<Plan>, now: Instant) -> bool {
        if plan.generation <= self.plan.generation {
            return false;
        }
        self.reconfigure(plan, now);
        true
    }

    /// Moves the bucket to `plan` (a reload).
    pub(super) fn reconfigure(&mut self, plan: &Arc<Plan>, now: Instant) {
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
pub(super) type OnStore = (std::sync::Weak<dyn Store>, Arc<dyn StorePartition>);

/// One (upstream, partition): its bucket under one lock, and the driver's wake-up.
pub(crate) struct Cell {
    pub(super) name: Arc<str>,
    pub(super) partition: Option<Partition>,
    pub(super) state: Mutex<CellState>,
    pub(super) notify: Notify,
    /// Where the partition's driver runs; the caller's runtime when unset.
    pub(super) timers: Option<tokio::runtime::Handle>,
    /// What this replica knows of the partition's shared limits, once one is paid.
    /// Made by the store it names, and made again when the store changes.
    pub(super) shared: Mutex<Option<OnStore>>,
    /// Its upstream's count of live partitions, which it leaves when swept.
    pub(super) occupancy: Arc<Occupancy>,
}

impl Cell {
    pub(super) fn shared(&self, store: &Arc<dyn Store>) -> Arc<dyn StorePartition> {
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

    pub(super) fn lock(&self) -> MutexGuard<'_, CellState> {
        // parking_lot's locks do not poison: nothing panics while holding this one, and if
        // something did, the state is consistent at every await-free step.
        self.state.lock()
    }

    /// Admits whoever can go now and hands them their grants. A grant whose waiter is
    /// already gone is undone on the spot, which may let the next one in.
    pub(super) fn dispatch(self: &Arc<Self>, st: &mut CellState, now: Instant) {
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
                m.queued(&a.costs, false);
                let waited = (a.at - a.since).as_secs_f64();
                m.wait.observe(waited);
                for (i, c) in &m.wait_cost {
                    c.inc_by(waited * a.costs.of(*i) as f64);
                }
                let grant = self.grant(st, a.family, (a.seq, a.costs), a.at, a.edge, epoch);
                let family = st.bucket.family_ref(a.family);
                if let Err(mut g) = a.waiter.tx.send(grant) {
                    g.disarm();
                    st.bucket.undo(family, &a.costs, epoch);
                    undone = true;
                }
            }
            if !undone {
                return;
            }
        }
    }

    /// The grant of a request of `slot` admitted as `seq` at `at`.
    pub(super) fn grant(
        self: &Arc<Self>,
        st: &CellState,
        slot: usize,
        (seq, costs): (u64, Costs),
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
                costs,
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
    pub(super) fn refused_at_edge(
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
    pub(super) fn changed(self: &Arc<Self>, st: &mut CellState, now: Instant) {
        self.dispatch(st, now);
        self.wake_driver(st);
    }

    /// After a change that may matter to time-based waiting, make sure a driver looks.
    pub(super) fn wake_driver(self: &Arc<Self>, st: &mut CellState) {
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
pub(super) async fn drive(cell: Arc<Cell>) {
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
    pub(super) permit: Option<Permit>,
}

impl Grant {
    /// The permit will not be used and is being given back by the caller.
    pub(super) fn disarm(&mut self) {
        if let Some(mut p) = self.permit.take() {
            p.holds = false;
            p.ticket = None;
        }
    }

    pub(super) fn into_permit(mut self) -> Option<Permit> {
        self.permit.take()
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let Some(mut permit) = self.permit.take() else {
            return;
        };
        permit.holds = false;
        let cell = permit.cell.clone();
        let mut st = cell.lock();
        // Rate limits took what its ticket says it cost; without one it paid
        // concurrency only, which counts requests.
        let costs = permit.ticket.take().map_or(Costs::ONE, |t| t.costs);
        st.bucket.undo(permit.family, &costs, permit.epoch);
        cell.changed(&mut st, Instant::now());
    }
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
        + families * size_of::<FamilyBucket<Waiter>>()
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

/// The live partitions of one upstream (by name: a reload keeps the count).
#[derive(Default)]
pub(super) struct Occupancy {
    pub(super) live: AtomicUsize,
    /// When a refusal at the cap was last logged, so that it is logged once a minute.
    pub(super) warned: Mutex<Option<Instant>>,
}

impl Occupancy {
    pub(super) fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
}

/// An admitted request's hold on its permits. Rate permits follow the request through
/// its [`Ticket`]; concurrency permits are released on drop: when the response body has
/// been sent, or the request ended any other way (error, client gone, panic). Dropped
/// before the request reached its upstream connection, it gives its rate permits back.
pub struct Permit {
    pub(super) cell: Arc<Cell>,
    pub(super) family: FamilyRef,
    /// The reload epoch it was taken in: a limit created later was never paid.
    pub(super) epoch: u64,
    pub(super) holds: bool,
    /// When it was admitted, if its family adapts its rate (`adaptive`).
    pub(super) adapts: Option<Instant>,
    /// While the request pays limits counted in time and has not been answered.
    pub(super) ticket: Option<Arc<Ticket>>,
}

/// What an adaptive family is told of an answer (see [`Permit::feedback`]).
pub(crate) struct Feedback {
    pub(super) cell: Arc<Cell>,
    pub(super) family: FamilyRef,
    pub(super) admitted: Instant,
}

impl Feedback {
    /// The answer arrived: `refused` when it was a 429 that classification retries or
    /// cools down (the provider's limit is lower than the configured one), otherwise a
    /// success.
    pub(crate) fn report(self, refused: bool) {
        let mut st = self.cell.lock();
        let now = crate::clock::now();
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
    pub(super) fn hold(&mut self, hold: Box<dyn Reservation>, costs: &Costs) {
        let ticket = self.ticket.get_or_insert_with(|| {
            // Its local limits count nothing in time: a ticket for the shared ones only.
            Arc::new(Ticket {
                cell: self.cell.clone(),
                family: self.family,
                id: Id::MAX,
                epoch: self.epoch,
                phase: AtomicU8::new(ADMITTED),
                admitted: crate::clock::now(),
                sent_after: AtomicU64::new(0),
                edge: None,
                costs: *costs,
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
    #[cfg(test)]
    pub(crate) fn learn(&self, a: crate::policy::announced::Announced) {
        self.learn_in(a, super::costs::REQUESTS);
    }

    /// As `learn`, for a budget the provider announces in the upstream's unit `unit`
    /// (tokens, points): it paces what admissions cost in that unit.
    pub(crate) fn learn_in(&self, a: crate::policy::announced::Announced, unit: u8) {
        if unit != super::costs::REQUESTS {
            let mut st = self.cell.lock();
            let now = Instant::now();
            st.bucket.learn_in(a, unit, now);
            self.cell.changed(&mut st, now);
            return;
        }
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

    /// What corrects the limits this request paid once its response says what it really
    /// cost; `None` when it paid none counted in time.
    pub(crate) fn correction(&self) -> Option<Correction> {
        self.ticket.clone().map(Correction)
    }

    /// The response head, with `status`, arrived at `now` (a reading just taken): the
    /// provider had counted the request by then.
    pub fn answered(&mut self, status: u16, now: Instant) {
        if let Some(t) = self.ticket.take() {
            let mut st = t.cell.lock();
            let mut sent = None;
            match t.phase.load(Ordering::Relaxed) {
                phase @ (ADMITTED | UNSENT) => {
                    // A response without a reported send: it was sent by now at the latest.
                    let epoch = (phase == ADMITTED).then_some(t.epoch);
                    st.bucket.sent(t.family, t.id, &t.costs, epoch, now);
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
            st.bucket.unsent(t.family, &t.costs, t.epoch);
            t.phase.store(UNSENT, Ordering::Relaxed);
            unsent = Some(t);
        }
        if self.holds {
            st.bucket.release(self.family, self.epoch);
        }
        self.cell.changed(&mut st, crate::clock::now());
        drop(st);
        if let Some(g) = unsent.as_ref().and_then(|t| t.global.as_ref()) {
            g.unsent();
        }
    }
}

pub(super) const ADMITTED: u8 = 0;
pub(super) const SENT: u8 = 1;
pub(super) const ANSWERED: u8 = 2;
/// Given back before it was sent (the request failed or left first).
pub(super) const UNSENT: u8 = 3;

/// One admission's way through the limits counted in time, shared by its [`Permit`] and
/// its [`SendHook`]. `phase` changes only under the cell's lock, so a send that races the
/// request's cancellation is settled there, one way or the other.
pub(crate) struct Ticket {
    pub(super) cell: Arc<Cell>,
    pub(super) family: FamilyRef,
    pub(super) id: Id,
    pub(super) epoch: u64,
    pub(super) phase: AtomicU8,
    pub(super) admitted: Instant,
    /// Nanoseconds from admission to send, once sent.
    pub(super) sent_after: AtomicU64,
    /// The rate limit it waited for: it was admitted at that limit's edge.
    pub(super) edge: Option<LimitRef>,
    /// What it cost, in each unit.
    pub(super) costs: Costs,
    /// Its shared limits, to be told of its send and answer too.
    pub(super) global: Option<Box<dyn Reservation>>,
}

impl Ticket {
    pub(super) fn sent_at(&self) -> Instant {
        self.admitted + Duration::from_nanos(self.sent_after.load(Ordering::Relaxed))
    }
}

/// A sent request's hold on the rate limits it paid, kept past its answer: the response
/// may report the request's true cost, in its head or at the end of its body.
#[derive(Clone)]
pub(crate) struct Correction(Arc<Ticket>);

impl Correction {
    /// The request really cost `actual` (unit index, cost): each limit of those units
    /// that it paid is given back, or charged, the difference from what it took.
    pub(crate) fn correct(&self, actual: &[(u8, u64)]) {
        let t = &self.0;
        let mut st = t.cell.lock();
        // Given back before it was sent: it holds nothing to correct.
        if t.phase.load(Ordering::Relaxed) == UNSENT {
            return;
        }
        let now = crate::clock::now();
        for &(unit, w) in actual {
            let was = t.costs.of(unit);
            st.bucket
                .reweigh(t.family, t.id, unit, (was, w), t.epoch, now);
        }
        t.cell.changed(&mut st, now);
        drop(st);
        if let Some(g) = &t.global {
            for &(unit, w) in actual {
                g.reweigh(unit, w);
            }
        }
    }
}

impl Correction {
    /// A budget the provider announced in a response body, in unit `unit` (see
    /// `Permit::learn_in`).
    pub(crate) fn learn_in(&self, a: crate::policy::announced::Announced, unit: u8) {
        let t = &self.0;
        let mut st = t.cell.lock();
        let now = crate::clock::now();
        st.bucket.learn_in(a, unit, now);
        t.cell.changed(&mut st, now);
    }
}

/// Reports the instant a request is handed to its upstream connection (see
/// `upstream::outbound::Outbound`), once.
pub struct SendHook(Arc<Ticket>);

impl SendHook {
    pub fn fire(self) {
        let t = &self.0;
        let mut st = t.cell.lock();
        let now = crate::clock::now();
        let epoch = match t.phase.load(Ordering::Relaxed) {
            ADMITTED => Some(t.epoch),
            // Its permit was already given back, but the provider will see it: count it.
            UNSENT => None,
            _ => return,
        };
        st.bucket.sent(t.family, t.id, &t.costs, epoch, now);
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
