//! One partition of one upstream, as a pure state machine: the upstream's limits, and per
//! family its limits, its FIFO queue and its pause. `dispatch` admits waiters at `now`;
//! nothing here sleeps or locks, so every rule is tested by stepping `now`.
//!
//! Admission rule: a family's head is *ready* when the family is not paused and every
//! family limit admits it now. Among ready heads the best (priority, then arrival) goes
//! first, if every upstream limit admits it too; it then takes all its permits at that one
//! instant. A family blocked on its own limits never holds up another family, and no
//! request holds a permit of one limit while it waits for another.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::aimd::{Adapts, Aimd};
use super::costs::{Costs, REQUESTS, UNITS};
use super::kinds::{Id, LimitState};
use super::learned::Learned;
pub(crate) use super::queue::{Queue, Queued, Tenant};
use crate::config::{Limit, Priority};
use crate::policy::announced::Announced;

/// What a family's bucket is made of, from the config.
#[derive(Debug, Clone)]
pub(crate) struct FamilySpec {
    pub(crate) name: String,
    pub(crate) priority: Priority,
    pub(crate) limits: Vec<Limit>,
    pub(crate) max_queue: u32,
    pub(crate) max_wait: Duration,
    /// Pays only the upstream's concurrency limits: the queue of CONNECT tunnels, which
    /// carry no visible requests for rate limits to count.
    pub(crate) concurrency_only: bool,
    /// `adaptive`, and the rate limit it adapts below.
    pub(crate) adaptive: Option<Adapts>,
    /// Whether its queue takes tenants in turns (`tenant`); `max_queue` then bounds each
    /// tenant's waiting requests, and [`FAIR_QUEUE_TENANTS`] times it the family's.
    pub(crate) fair: bool,
    /// `queue_order = "newest_first"`.
    pub(crate) newest_first: bool,
    /// The most of a priced unit its queue holds (unit index, cost), from the cost
    /// tables' `max_queue`.
    pub(crate) queue_caps: Vec<(u8, u64)>,
    /// The units it prices, by index, for the admin views.
    pub(crate) units: Vec<(u8, Arc<str>)>,
}

/// With tenants, a family holds at most this many times `max_queue` waiting requests in
/// all: tenant values come from clients, and memory must stay bounded.
pub(crate) const FAIR_QUEUE_TENANTS: usize = 10;

/// An upstream's limits and its families. The last family is the one for requests that
/// match no family: no limits of its own, the upstream's queue bounds.
#[derive(Debug, Clone)]
pub(crate) struct PartitionSpec {
    pub(crate) upstream_limits: Arc<[Limit]>,
    pub(crate) families: Vec<Arc<FamilySpec>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reject {
    QueueFull { retry_after: Duration },
    QueueTimeout { retry_after: Duration },
}

#[derive(Debug)]
pub(crate) struct Admitted<W> {
    /// The family's slot at the moment of admission.
    pub(crate) family: usize,
    pub(crate) seq: u64,
    pub(crate) since: Instant,
    pub(crate) at: Instant,
    /// The rate limit it waited for, if it waited for one: it was admitted at that
    /// limit's edge, the instant the limit allowed it.
    pub(crate) edge: Option<LimitRef>,
    /// What it cost.
    pub(crate) costs: Costs,
    pub(crate) waiter: W,
}

/// One of the limits an admission paid: its family's `i`-th or its upstream's `i`-th.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitRef {
    Family(usize),
    Upstream(usize),
}

/// A family's slot in a bucket. Slots can move when a reload reorders families, so
/// whoever holds on to one across an unlock names it by `id`, which never changes.
#[derive(Debug)]
pub(crate) struct FamilyBucket<W> {
    pub(crate) id: u32,
    pub(crate) spec: Arc<FamilySpec>,
    pub(crate) limits: Vec<LimitState>,
    pub(crate) paused_until: Option<Instant>,
    pub(crate) queue: Queue<W>,
    /// What its queue's waiters cost together: a new arrival waits behind all of it.
    pub(crate) queued: Costs,
    holds_concurrency: bool,
    /// Whether an admission pays a limit counted in time (so its send matters).
    pays_rate: bool,
    /// The rate limit the head was last found waiting for (see `next_wakeup`).
    binding: Option<LimitRef>,
    /// The effective rate under `adaptive`, paid like one more family limit.
    /// Boxed, as is `learned`: few partitions have one, and every partition pays for the
    /// field's size.
    pub(crate) aimd: Option<Box<Aimd>>,
}

/// What the upstream's limits make every admission of a family do.
#[derive(Debug, Clone, Copy)]
struct UpstreamPays {
    concurrency: bool,
    rate: bool,
}

impl UpstreamPays {
    fn of(upstream: &[LimitState]) -> UpstreamPays {
        UpstreamPays {
            concurrency: upstream.iter().any(LimitState::is_concurrency),
            rate: upstream.iter().any(|l| !l.is_concurrency()),
        }
    }
}

impl<W> FamilyBucket<W> {
    fn new(id: u32, spec: &Arc<FamilySpec>, limits: Vec<LimitState>, up: UpstreamPays) -> Self {
        let mut f = FamilyBucket {
            id,
            holds_concurrency: false,
            pays_rate: false,
            binding: None,
            aimd: spec.adaptive.map(|a| Box::new(Aimd::new(a))),
            limits,
            spec: spec.clone(),
            paused_until: None,
            queue: Queue::new(spec.fair, spec.newest_first),
            queued: Costs::default(),
        };
        f.set_pays(up);
        f
    }

    /// Whether every limit of its own (its adaptive rate included) admits a request
    /// costing `costs` now.
    fn admits(&mut self, costs: &Costs, now: Instant) -> bool {
        self.limits
            .iter_mut()
            .all(|l| l.can_take_n(costs.of(l.unit()), now))
            && self.aimd.as_ref().is_none_or(|a| a.can_take(now))
    }

    fn take(&mut self, costs: &Costs, now: Instant) {
        for l in &mut self.limits {
            l.take_n(costs.of(l.unit()), now);
        }
        if let Some(a) = &mut self.aimd {
            a.take(now);
        }
    }

    fn set_pays(&mut self, up: UpstreamPays) {
        self.holds_concurrency =
            up.concurrency || self.limits.iter().any(LimitState::is_concurrency);
        // Tunnels pay only the upstream's concurrency limits.
        self.pays_rate = (up.rate && !self.spec.concurrency_only)
            || self.limits.iter().any(|l| !l.is_concurrency());
    }
}

/// A family named the way that survives a reload: its id, and the slot it was last seen
/// in (checked first, so the common case is not a search).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FamilyRef {
    pub(crate) id: u32,
    pub(crate) slot: usize,
}

#[derive(Debug)]
pub(crate) struct Bucket<W> {
    pub(crate) upstream_spec: Arc<[Limit]>,
    pub(crate) upstream: Vec<LimitState>,
    pub(crate) paused_until: Option<Instant>,
    /// The pace the provider's announced budget sets, paid like an upstream rate limit
    /// (`learn = "headers"`).
    pub(crate) learned: Option<Box<Learned>>,
    /// The paces of budgets announced in priced units (`tokens`, `points`), by unit
    /// index less one.
    pub(crate) learned_units: Option<Box<[Option<Learned>; UNITS - 1]>>,
    /// The spec's families in its order, then retired ones (removed by a reload) that
    /// still have requests queued.
    pub(crate) families: Vec<FamilyBucket<W>>,
    next_seq: u64,
    next_id: u32,
    waiting: usize,
    /// Reloads applied so far; concurrency permits remember the epoch they were taken in.
    epoch: u64,
}

/// How far an edge placed by an announced reset may be from the provider's: the reset
/// and the `Date` it is read against are whole seconds.
pub(crate) const ANNOUNCED_SLACK: Duration = Duration::from_secs(2);

/// The shortest window on the clock whose edges an announced reset places.
pub(crate) const ALIGNABLE: Duration = Duration::from_secs(20);

/// The upstream limits a family pays: all of them, or only concurrency for tunnels.
fn paid(
    upstream: &mut [LimitState],
    concurrency_only: bool,
) -> impl Iterator<Item = &mut LimitState> {
    upstream
        .iter_mut()
        .filter(move |l| !concurrency_only || l.is_concurrency())
}

/// The learned paces: of requests, and of the budgets in priced units.
type LearnedUnits = Option<Box<[Option<Learned>; UNITS - 1]>>;

/// Whether the learned paces let an admission costing `costs` through now (tunnels do
/// not pay them). Admissions given back later (never sent, never received) are not
/// returned to them: the provider's count is unknown, so erring slow is the safe side.
fn learned_admits(
    (learned, units): (Option<&Learned>, &LearnedUnits),
    concurrency_only: bool,
    costs: &Costs,
    now: Instant,
) -> bool {
    concurrency_only
        || (learned.is_none_or(|l| l.can_take(now))
            && units.as_deref().is_none_or(|u| {
                u.iter()
                    .zip(1u8..)
                    .all(|(l, i)| l.as_ref().is_none_or(|l| l.can_take_n(costs.of(i), now)))
            }))
}

fn take_learned(
    (learned, units): (&mut Option<Box<Learned>>, &mut LearnedUnits),
    concurrency_only: bool,
    costs: &Costs,
    now: Instant,
) {
    if concurrency_only {
        return;
    }
    if let Some(l) = learned.as_mut() {
        l.take(now);
    }
    for (l, i) in units.iter_mut().flat_map(|u| u.iter_mut()).zip(1u8..) {
        if let Some(l) = l {
            l.take_n(costs.of(i), now);
        }
    }
}

/// What a new arrival of `family` and those served before it cost, for its `eta`: in a
/// FIFO queue everyone queued goes first; with tenants in turns only `turn - 1` requests
/// do, whose other costs are unknown and taken as nothing (a lower bound).
fn ahead_of_new<W>(f: &FamilyBucket<W>, turn: u64, costs: Costs) -> Costs {
    let before = if f.spec.fair || f.spec.newest_first {
        Costs::default()
    } else {
        f.queued
    };
    (before + costs).with(REQUESTS, turn)
}

fn paused(until: Option<Instant>, now: Instant) -> bool {
    until.is_some_and(|t| now < t)
}

/// Whole seconds, rounded up, at least one: the form `Retry-After` takes.
pub(crate) fn retry_after(wait: Duration) -> Duration {
    Duration::from_secs(wait.as_secs() + u64::from(wait.subsec_nanos() > 0))
        .max(Duration::from_secs(1))
}

impl<W> Bucket<W> {
    pub(crate) fn new(spec: &PartitionSpec, now: Instant) -> Bucket<W> {
        let upstream: Vec<LimitState> = spec
            .upstream_limits
            .iter()
            .map(|l| LimitState::new(l, now))
            .collect();
        let up = UpstreamPays::of(&upstream);
        let families = spec
            .families
            .iter()
            .zip(0..)
            .map(|(f, id)| {
                let limits = f.limits.iter().map(|l| LimitState::new(l, now)).collect();
                FamilyBucket::new(id, f, limits, up)
            })
            .collect::<Vec<_>>();
        Bucket {
            upstream_spec: spec.upstream_limits.clone(),
            upstream,
            paused_until: None,
            learned: None,
            learned_units: None,
            next_id: families.len() as u32,
            families,
            next_seq: 0,
            waiting: 0,
            epoch: 0,
        }
    }

    /// Applies a reloaded spec at `now`. Families are matched by name and limits by spec:
    /// an unchanged limit keeps its exact state, a changed one of the same kind carries
    /// what has been taken (see [`LimitState::carry`]), a new one starts fresh. Queues,
    /// pauses and arrival order are kept. A family the spec no longer has stays, retired,
    /// after the spec's families while requests are queued in it: they finish under its
    /// old limits. Returns the previous slot of each retired family kept, in order.
    pub(crate) fn reconfigure(&mut self, spec: &PartitionSpec, now: Instant) -> Vec<usize> {
        self.epoch += 1;
        let epoch = self.epoch;
        let upstream = std::mem::take(&mut self.upstream);
        self.upstream = carry_limits(
            &self.upstream_spec,
            upstream,
            &spec.upstream_limits,
            now,
            epoch,
        );
        self.upstream_spec = spec.upstream_limits.clone();
        let up = UpstreamPays::of(&self.upstream);

        let mut old: Vec<Option<FamilyBucket<W>>> = std::mem::take(&mut self.families)
            .into_iter()
            .map(Some)
            .collect();
        let mut families = Vec::with_capacity(spec.families.len());
        for f in &spec.families {
            let found = old
                .iter()
                .position(|o| o.as_ref().is_some_and(|o| o.spec.name == f.name));
            let fb = match found.and_then(|i| old[i].take()) {
                Some(prev) => {
                    let limits =
                        carry_limits(&prev.spec.limits, prev.limits, &f.limits, now, epoch);
                    let aimd = match (&prev.aimd, f.adaptive) {
                        (Some(a), Some(new)) => Some(Box::new(a.carry(new))),
                        (_, new) => new.map(|a| Box::new(Aimd::new(a))),
                    };
                    let mut queue = prev.queue;
                    queue.refair(f.fair, f.newest_first);
                    FamilyBucket {
                        paused_until: prev.paused_until,
                        queue,
                        aimd,
                        ..FamilyBucket::new(prev.id, f, limits, up)
                    }
                }
                None => {
                    let limits = f
                        .limits
                        .iter()
                        .map(|l| LimitState::new_in(l, now, epoch))
                        .collect();
                    self.next_id += 1;
                    FamilyBucket::new(self.next_id - 1, f, limits, up)
                }
            };
            families.push(fb);
        }
        let mut retired = Vec::new();
        for (i, o) in old.into_iter().enumerate() {
            if let Some(mut fb) = o.filter(|o| !o.queue.is_empty()) {
                fb.set_pays(up);
                families.push(fb);
                retired.push(i);
            }
        }
        self.families = families;
        retired
    }

    /// The current slot of a family named by `r`, if it still exists.
    pub(crate) fn find(&self, r: FamilyRef) -> Option<usize> {
        if self.families.get(r.slot).is_some_and(|f| f.id == r.id) {
            return Some(r.slot);
        }
        self.families.iter().position(|f| f.id == r.id)
    }

    /// The slot of the family called `name`, current or retired.
    pub(crate) fn slot_named(&self, name: &str) -> Option<usize> {
        self.families.iter().position(|f| f.spec.name == name)
    }

    pub(crate) fn family_ref(&self, slot: usize) -> FamilyRef {
        FamilyRef {
            id: self.families[slot].id,
            slot,
        }
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Requests queued in every family.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting
    }

    /// Whether an admission in `family` holds a permit until the response ends.
    pub(crate) fn holds_concurrency(&self, family: usize) -> bool {
        self.families[family].holds_concurrency
    }

    /// Whether an admission in `family` pays a limit counted in time, whose accounting
    /// follows the request to its upstream connection.
    pub(crate) fn pays_rate(&self, family: usize) -> bool {
        self.families[family].pays_rate
    }

    /// The earliest instant the `n`-th request of `family`'s queue could be admitted, if
    /// it can be known (a lower bound: other families may take upstream permits first),
    /// when it and those before it cost `ahead` in all (its `n` requests included).
    pub(crate) fn eta(&mut self, family: usize, ahead: Costs, now: Instant) -> Option<Instant> {
        self.eta_by(family, ahead, now).map(|(at, _)| at)
    }

    /// As `eta`, with the rate limit that decides it (the last to admit), if one does.
    fn eta_by(
        &mut self,
        family: usize,
        ahead: Costs,
        now: Instant,
    ) -> Option<(Instant, Option<LimitRef>)> {
        let n = ahead.of(REQUESTS);
        let f = &mut self.families[family];
        let mut at = now
            .max(f.paused_until.unwrap_or(now))
            .max(self.paused_until.unwrap_or(now));
        let mut binding = None;
        let only = f.spec.concurrency_only;
        let own = f
            .limits
            .iter_mut()
            .enumerate()
            .map(|(i, l)| (LimitRef::Family(i), l));
        let up = self
            .upstream
            .iter_mut()
            .enumerate()
            .filter(|(_, l)| !only || l.is_concurrency())
            .map(|(i, l)| (LimitRef::Upstream(i), l));
        for (r, l) in own.chain(up) {
            let ready = l.ready_at(ahead.of(l.unit()), now)?;
            if ready > at {
                at = ready;
                binding = (!l.is_concurrency()).then_some(r);
            }
        }
        if let Some(a) = &f.aimd {
            let ready = a.ready_at(n, now);
            if ready > at {
                (at, binding) = (ready, None);
            }
        }
        let units = self.learned_units.iter().flat_map(|u| u.iter()).zip(1u8..);
        let paces = self
            .learned
            .as_deref()
            .map(|l| l.ready_at(n, now))
            .into_iter()
            .chain(units.filter_map(|(l, i)| Some(l.as_ref()?.ready_for(ahead.of(i), now))));
        for ready in paces.filter(|_| !only) {
            if ready > at {
                // The provider's own pace: not one of ours whose edge could be late.
                (at, binding) = (ready, None);
            }
        }
        Some((at, binding))
    }

    /// Bounds for a new arrival: a full queue, or a wait known to exceed `max_wait`.
    #[cfg(test)]
    pub(crate) fn check(&mut self, family: usize, now: Instant) -> Result<(), Reject> {
        let max_wait = self.families[family].spec.max_wait;
        self.check_within(family, None, Costs::ONE, now, max_wait)
    }

    /// As [`Bucket::check`], for an arrival that waits at most `max_wait` (no more than
    /// its family's, when the client asks for less).
    pub(crate) fn check_within(
        &mut self,
        family: usize,
        tenant: Option<Tenant>,
        costs: Costs,
        now: Instant,
        max_wait: Duration,
    ) -> Result<(), Reject> {
        let f = &self.families[family];
        let queue = &f.queue;
        let (mine, all) = (queue.len_of(tenant), queue.len());
        let turn = queue.turn_for_new(tenant);
        let eta = self.eta(family, ahead_of_new(f, turn, costs), now);
        let f = &self.families[family].spec;
        let hint = |eta: Option<Instant>| retry_after(eta.map_or(Duration::ZERO, |t| t - now));
        let max = f.max_queue as usize;
        let queued = self.families[family].queued;
        let over_cap = f
            .queue_caps
            .iter()
            .any(|&(unit, cap)| queued.of(unit).saturating_add(costs.of(unit)) > cap);
        if mine >= max || (f.fair && all >= max * FAIR_QUEUE_TENANTS) || (over_cap && all > 0) {
            return Err(Reject::QueueFull {
                retry_after: hint(eta),
            });
        }
        if let Some(t) = eta
            && t - now > max_wait.min(f.max_wait)
        {
            return Err(Reject::QueueTimeout {
                retry_after: hint(Some(t)),
            });
        }
        Ok(())
    }

    /// `Retry-After` for a waiter of `family` whose `max_wait` ran out at position `seq`.
    pub(crate) fn timeout_hint(
        &mut self,
        family: usize,
        seq: u64,
        tenant: Option<Tenant>,
        now: Instant,
    ) -> Duration {
        let queue = &self.families[family].queue;
        let turn = queue.turn_of(seq, tenant).unwrap_or(1);
        // Its own cost in the priced units, and the requests before it: a lower bound.
        let own = queue.costs_of(seq, tenant).unwrap_or(Costs::ONE);
        let eta = self.eta(family, own.with(REQUESTS, turn), now);
        retry_after(eta.map_or(Duration::ZERO, |t| t - now))
    }

    pub(crate) fn push(
        &mut self,
        family: usize,
        tenant: Option<Tenant>,
        costs: Costs,
        waiter: W,
        now: Instant,
    ) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let f = &mut self.families[family];
        f.queued = f.queued + costs;
        f.queue.push_back(Queued {
            seq,
            since: now,
            tenant,
            costs,
            waiter,
        });
        self.waiting += 1;
        seq
    }

    /// Empties every queue (shutdown), returning each waiter with its family.
    pub(crate) fn take_all_waiters(&mut self) -> Vec<(usize, Costs, W)> {
        let mut out = Vec::with_capacity(self.waiting);
        for (i, f) in self.families.iter_mut().enumerate() {
            out.extend(f.queue.drain().into_iter().map(|q| (i, q.costs, q.waiter)));
            f.queued = Costs::default();
        }
        self.waiting = 0;
        out
    }

    /// Removes a waiter that gave up; `None` if it is no longer queued (it was admitted).
    /// Returns its slot with it.
    pub(crate) fn cancel(
        &mut self,
        family: FamilyRef,
        seq: u64,
        tenant: Option<Tenant>,
    ) -> Option<(usize, Queued<W>)> {
        let slot = self.find(family)?;
        let f = &mut self.families[slot];
        let q = f.queue.remove(seq, tenant)?;
        f.queued = f.queued - q.costs;
        self.waiting -= 1;
        Some((slot, q))
    }

    /// A request of `family` arriving at `now` to a bucket where no one waits: admitted
    /// at once when every limit it pays allows it (its sequence number returned), exactly
    /// as queueing it and dispatching would, without the queue.
    pub(crate) fn admit_now(&mut self, family: usize, costs: &Costs, now: Instant) -> Option<u64> {
        if self.waiting != 0 || paused(self.paused_until, now) {
            return None;
        }
        let f = &mut self.families[family];
        if paused(f.paused_until, now) || !f.admits(costs, now) {
            return None;
        }
        let only = f.spec.concurrency_only;
        if !paid(&mut self.upstream, only).all(|l| l.can_take_n(costs.of(l.unit()), now))
            || !learned_admits(
                (self.learned.as_deref(), &self.learned_units),
                only,
                costs,
                now,
            )
        {
            return None;
        }
        f.take(costs, now);
        for l in paid(&mut self.upstream, only) {
            l.take_n(costs.of(l.unit()), now);
        }
        take_learned(
            (&mut self.learned, &mut self.learned_units),
            only,
            costs,
            now,
        );
        let seq = self.next_seq;
        self.next_seq += 1;
        Some(seq)
    }

    /// Admits every waiter that can go at `now`, in order, into `out`.
    pub(crate) fn dispatch(&mut self, now: Instant, out: &mut Vec<Admitted<W>>) {
        if paused(self.paused_until, now) {
            return;
        }
        loop {
            let mut best: Option<(usize, (Priority, u64))> = None;
            for (i, f) in self.families.iter_mut().enumerate() {
                let Some((seq, costs)) = f.queue.front().map(|head| (head.seq, head.costs)) else {
                    continue;
                };
                if paused(f.paused_until, now) || !f.admits(&costs, now) {
                    continue;
                }
                let key = (f.spec.priority, seq);
                if best.is_none_or(|(_, k)| key < k) {
                    best = Some((i, key));
                }
            }
            let Some((i, _)) = best else { return };
            let f = &mut self.families[i];
            let only = f.spec.concurrency_only;
            let Some(costs) = f.queue.front().map(|head| head.costs) else {
                return;
            };
            if !paid(&mut self.upstream, only).all(|l| l.can_take_n(costs.of(l.unit()), now))
                || !learned_admits(
                    (self.learned.as_deref(), &self.learned_units),
                    only,
                    &costs,
                    now,
                )
            {
                return;
            }
            f.take(&costs, now);
            for l in paid(&mut self.upstream, only) {
                l.take_n(costs.of(l.unit()), now);
            }
            take_learned(
                (&mut self.learned, &mut self.learned_units),
                only,
                &costs,
                now,
            );
            let Some(q) = f.queue.pop_front() else { return };
            f.queued = f.queued - q.costs;
            self.waiting -= 1;
            out.push(Admitted {
                family: i,
                seq: q.seq,
                since: q.since,
                at: now,
                edge: f.binding.filter(|_| q.since < now),
                costs: q.costs,
                waiter: q.waiter,
            });
        }
    }

    /// The spec and state of limit `r` of `family`, if both still exist.
    pub(crate) fn limit(
        &mut self,
        family: FamilyRef,
        r: LimitRef,
    ) -> Option<(&Limit, &mut LimitState)> {
        match r {
            LimitRef::Family(i) => {
                let slot = self.find(family)?;
                let f = &mut self.families[slot];
                Some((f.spec.limits.get(i)?, f.limits.get_mut(i)?))
            }
            LimitRef::Upstream(i) => Some((self.upstream_spec.get(i)?, self.upstream.get_mut(i)?)),
        }
    }

    /// The limits an admission in `family` paid (those still there after reloads).
    fn paid_by(&mut self, family: FamilyRef) -> impl Iterator<Item = &mut LimitState> {
        let (own, only): (&mut [LimitState], bool) = match self.find(family) {
            Some(slot) => {
                let f = &mut self.families[slot];
                (&mut f.limits, f.spec.concurrency_only)
            }
            // Retired and gone: only the upstream's limits remain.
            None => (&mut [], false),
        };
        own.iter_mut().chain(paid(&mut self.upstream, only))
    }

    /// Gives back everything an admission of `epoch` in `family` took: its grant never
    /// reached its request.
    pub(crate) fn undo(&mut self, family: FamilyRef, costs: &Costs, epoch: u64) {
        for l in self.paid_by(family) {
            l.undo(costs.of(l.unit()), epoch);
        }
    }

    /// Admission `id` (of `epoch`, `None` if already undone) was handed to its upstream
    /// connection at `now`.
    pub(crate) fn sent(
        &mut self,
        family: FamilyRef,
        id: Id,
        costs: &Costs,
        epoch: Option<u64>,
        now: Instant,
    ) {
        for l in self.paid_by(family) {
            l.sent_n(id, costs.of(l.unit()), epoch, now);
        }
    }

    /// The response to admission `id` arrived at `now`, `took` after its send.
    pub(crate) fn answered(&mut self, family: FamilyRef, id: Id, now: Instant, took: Duration) {
        for l in self.paid_by(family) {
            l.answered(id, now, took);
        }
    }

    /// Admission `id` of `epoch`, which took `was` of unit `unit`, really cost `w` (its
    /// response said so): every limit of that unit it paid gives back or takes the
    /// difference.
    #[allow(clippy::too_many_arguments, reason = "one admission and its two costs")]
    pub(crate) fn reweigh(
        &mut self,
        family: FamilyRef,
        id: Id,
        unit: u8,
        (was, w): (u64, u64),
        epoch: u64,
        now: Instant,
    ) {
        for l in self.paid_by(family).filter(|l| l.unit() == unit) {
            l.reweigh(id, was, w, epoch, now);
        }
    }

    /// Admission of `epoch` never reached its upstream connection: its rate permits
    /// come back (its concurrency permits come back with `release`).
    pub(crate) fn unsent(&mut self, family: FamilyRef, costs: &Costs, epoch: u64) {
        for l in self.paid_by(family) {
            l.unsent_n(costs.of(l.unit()), epoch);
        }
    }

    /// A response admitted in `epoch` ended: its concurrency permits come back, from its
    /// family if that still exists, and from the upstream.
    pub(crate) fn release(&mut self, family: FamilyRef, epoch: u64) {
        if let Some(slot) = self.find(family) {
            for l in &mut self.families[slot].limits {
                l.release(1, epoch);
            }
        }
        for l in &mut self.upstream {
            l.release(1, epoch);
        }
    }

    /// The answer to a request of `family` admitted at `admitted` arrived at `now`:
    /// `refused` when it was a 429 that classification retries or cools down.
    /// Returns the family's effective rate before and after, if it still adapts.
    pub(crate) fn adapt(
        &mut self,
        family: FamilyRef,
        refused: bool,
        admitted: Instant,
        now: Instant,
    ) -> Option<(f64, f64)> {
        let slot = self.find(family)?;
        let a = self.families[slot].aimd.as_mut()?;
        let before = a.rate();
        if refused {
            a.refused(admitted, now);
        } else {
            a.succeeded();
        }
        Some((before, a.rate()))
    }

    /// Whether admissions in `family` adapt their rate (`adaptive`).
    pub(crate) fn adapts(&self, family: usize) -> bool {
        self.families[family].aimd.is_some()
    }

    /// A response announced the provider's budget at `now` (`learn = "headers"`): below
    /// what the upstream's rate limits would still admit, it sets the pace until the
    /// provider's reset; at or above it, any pace learned before is lifted.
    pub(crate) fn learn(&mut self, a: Announced, now: Instant) -> bool {
        self.learn_in(a, REQUESTS, now)
    }

    /// As `learn`, for a budget in unit `unit` (an index among the upstream's units): it
    /// paces the admissions by what they cost in that unit, below what the limits of the
    /// unit (the upstream's, else any family's) would still admit.
    pub(crate) fn learn_in(&mut self, a: Announced, unit: u8, now: Instant) -> bool {
        if unit == REQUESTS {
            let believed = self
                .upstream
                .iter_mut()
                .filter(|l| !l.is_concurrency() && l.unit() == REQUESTS)
                .map(|l| l.available(now))
                .min()
                .unwrap_or(u64::MAX);
            self.learned = Learned::from(a, believed, now, self.learned.as_deref()).map(Box::new);
            return self.align(a, now);
        }
        let of_unit = |l: &&mut LimitState| l.unit() == unit;
        let upstream = self
            .upstream
            .iter_mut()
            .filter(of_unit)
            .map(|l| l.available(now))
            .min();
        let believed = upstream
            .or_else(|| {
                self.families
                    .iter_mut()
                    .flat_map(|f| f.limits.iter_mut())
                    .filter(of_unit)
                    .map(|l| l.available(now))
                    .min()
            })
            .unwrap_or(u64::MAX);
        let Some(slot) = usize::from(unit).checked_sub(1).filter(|i| *i < UNITS - 1) else {
            return false;
        };
        let units = self.learned_units.get_or_insert_with(Default::default);
        units[slot] = Learned::from(a, believed, now, units[slot].as_ref());
        if units.iter().all(Option::is_none) {
            self.learned_units = None;
        }
        false
    }

    /// A reset the provider announces is where its window ends: the one limit on the
    /// clock it can belong to (a window at least as long, and long enough for whole
    /// seconds to place its edges) moves its edges there when they are further from it
    /// than the announcement's precision. With two such limits it cannot be told whose
    /// edge it is, and none moves. Whether one moved.
    fn align(&mut self, a: Announced, now: Instant) -> bool {
        let fits = |l: &&mut LimitState| {
            l.clock_window()
                .is_some_and(|w| w >= ALIGNABLE && a.reset <= w + ANNOUNCED_SLACK)
        };
        let mut clock = self
            .upstream
            .iter_mut()
            .chain(self.families.iter_mut().flat_map(|f| f.limits.iter_mut()))
            .filter(fits);
        match (clock.next(), clock.next()) {
            (Some(only), None) => only.realign(now + a.reset, ANNOUNCED_SLACK),
            _ => false,
        }
    }

    /// Pauses one family (or, with `None`, the whole upstream) until `until`; a later
    /// pause never shortens an earlier one.
    pub(crate) fn pause(&mut self, family: Option<usize>, until: Instant) {
        let slot = match family {
            Some(f) => &mut self.families[f].paused_until,
            None => &mut self.paused_until,
        };
        *slot = Some(slot.map_or(until, |t| t.max(until)));
    }

    /// When the driver should look again: the earliest instant a waiting head could be
    /// admitted by time alone. `None` when only a release or a new event can help.
    pub(crate) fn next_wakeup(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for i in 0..self.families.len() {
            if self.families[i].queue.is_empty() {
                continue;
            }
            let head = self.families[i]
                .queue
                .front()
                .map_or(Costs::ONE, |h| h.costs);
            let eta = self.eta_by(i, head, now);
            // The head will be admitted at this limit's edge (unless a release or a
            // reload comes first), which the edge-429 hint needs to know.
            self.families[i].binding = eta.and_then(|(_, b)| b);
            if let Some((t, _)) = eta {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        next
    }

    /// Nothing queued, nothing held, every limit full, no pause: indistinguishable from a
    /// new bucket, so it can be dropped.
    pub(crate) fn is_idle(&mut self, now: Instant) -> bool {
        self.waiting == 0
            && !paused(self.paused_until, now)
            && !self.learned.as_ref().is_some_and(|l| l.active(now))
            && !self
                .learned_units
                .iter()
                .flat_map(|u| u.iter().flatten())
                .any(|l| l.active(now))
            && self.upstream.iter_mut().all(|l| l.is_pristine(now))
            && self.families.iter_mut().all(|f| {
                !paused(f.paused_until, now)
                    && f.limits.iter_mut().all(|l| l.is_pristine(now))
                    && f.aimd.as_ref().is_none_or(|a| a.forgettable(now))
            })
    }
}

#[cfg(test)]
mod tests;

/// The states for `new` limits given the `old` specs and states: an equal spec takes its
/// state as it is, else the first unused one of the same kind is carried over, else fresh.
fn carry_limits(
    old_spec: &[Limit],
    old: Vec<LimitState>,
    new: &[Limit],
    now: Instant,
    epoch: u64,
) -> Vec<LimitState> {
    let mut old: Vec<Option<(&Limit, LimitState)>> = old_spec.iter().zip(old).map(Some).collect();
    new.iter()
        .map(|spec| {
            let equal = old
                .iter()
                .position(|o| o.as_ref().is_some_and(|(s, _)| *s == spec));
            if let Some((_, state)) = equal.and_then(|i| old[i].take()) {
                return state;
            }
            let kind = old
                .iter()
                .position(|o| o.as_ref().is_some_and(|(_, l)| l.same_kind(spec)));
            match kind.and_then(|i| old[i].take()) {
                Some((_, state)) => state.carry(spec, now, epoch),
                None => LimitState::new_in(spec, now, epoch),
            }
        })
        .collect()
}
