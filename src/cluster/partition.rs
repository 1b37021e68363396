//! What one replica knows of one (upstream, partition)'s global limits, and how a request
//! gets through them: the gate that lets one request per family at a time call Redis (so
//! the family stays FIFO, and the next asks once the answers it waits on are in), the
//! reservation and the turns of small limits, the corrections waiting to go back, this
//! replica's own admissions still inside their windows (written back when Redis returns
//! or lost its data), and the local fallback while Redis is away.

use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{CallError, Cluster, GlobalLimit, Kind, Mode, OWN_FAILURES, Reply, micros};
use crate::config::{Limit, Rounding, WindowAlign};
use crate::limit::costs::Costs;
use crate::limit::error::LimitError;
use crate::limit::kinds::LimitState;
use crate::limit::kinds::Pace;
use crate::limit::shared::{LiveLimits, Reservation, Reserving, Store, StorePartition};
use crate::route::Partition;

/// A reservation changes its correction only by more than this: less is clock noise.
const NOISE_US: f64 = 1000.0;

/// How soon corrections go to Redis when no call of this replica carries them first:
/// soon for those that keep a permit longer (a late send, a request that never went out
/// from an opening), later for those that only free one sooner.
const URGENT: Duration = Duration::from_millis(5);
const LAZY_MAX: Duration = Duration::from_millis(250);
/// A window's permit answered sooner is used again a window later, by this replica's
/// own next calls as a rule: its correction waits a window and a margin for one (2 s at
/// most).
const LAZY_WINDOW_MAX: Duration = Duration::from_secs(2);

/// Times a request is told to come back for its turn (`reserve.lua`, "Turns") before it
/// takes the instant Redis gives without turns.
const MAX_TURNS: u32 = 8;

pub(crate) struct Shared {
    /// `{sluice:<upstream>:<partition>}`: every key of the partition carries this hash
    /// tag, so one call's keys share a Redis Cluster slot. The partition is the hash of
    /// the key value, never the value.
    tag: String,
    gates: Mutex<HashMap<Arc<str>, Arc<FamilyGate>>>,
    state: Mutex<State>,
}

/// A family's turn at Redis, how many of its requests wait for it, and how many it
/// reserved that are not answered yet.
#[derive(Default)]
struct FamilyGate {
    turn: tokio::sync::Mutex<Gate>,
    waiting: AtomicUsize,
    unanswered: AtomicUsize,
    /// Told when `unanswered` falls to 0.
    answered: tokio::sync::Notify,
}

/// One of a family's reservations not yet answered (nor known never sent).
struct Unanswered(Arc<FamilyGate>);

impl Unanswered {
    fn new(gate: &Arc<FamilyGate>) -> Unanswered {
        gate.unanswered.fetch_add(1, Ordering::Relaxed);
        Unanswered(gate.clone())
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if self.0.unanswered.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.answered.notify_one();
        }
    }
}

impl FamilyGate {
    /// The family's turn to call Redis on this replica: once the requests before it have
    /// asked, and once the answers the last reservation waits on are in (their corrections
    /// then ride on this request's call), or its latest arrival, or `deadline`, has come.
    async fn first_in_line(&self, deadline: Instant) -> tokio::sync::MutexGuard<'_, Gate> {
        // Counted as waiting until it asks, so that the answers it may wait on know their
        // corrections will ride on this request's call.
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let waiting = Waiting(&self.waiting);
        let mut turn = self.turn.lock().await;
        if let Some(until) = turn.answers_by.take() {
            let until = tokio::time::sleep_until(until.min(deadline));
            tokio::pin!(until);
            while self.unanswered.load(Ordering::Acquire) > 0 {
                tokio::select! {
                    _ = self.answered.notified() => {}
                    _ = &mut until => break,
                }
            }
        }
        drop(waiting);
        if let Some(at) = turn.not_before.take() {
            tokio::time::sleep_until(at.min(deadline)).await;
        }
        turn
    }
}

/// Counts an admission to shared limits by its result.
fn count(cluster: &Cluster, result: &str) {
    cluster
        .metrics
        .cluster_reservations
        .with_label_values(&[result])
        .inc();
}

/// What the request holding the turn finds: a reservation left by a request that gave
/// up on it, and the answer the next reservation waits on.
#[derive(Default)]
pub(crate) struct Gate {
    handed: Option<Reserved>,
    /// The next reservation waits on the answers of those before: ask once they are in,
    /// and no later than this instant, the last one's latest arrival.
    answers_by: Option<Instant>,
    /// This replica's run is over: ask again no sooner than this.
    not_before: Option<Instant>,
}

/// A reserved instant, on both clocks.
#[derive(Debug, Clone)]
struct Reserved {
    member: String,
    at_us: f64,
    at_local: Instant,
    /// The call's round trip: the local instant may be off from Redis's by this much.
    slack_us: f64,
    limits: Arc<[Arc<GlobalLimit>]>,
    /// What it paid, in each unit.
    costs: Costs,
    /// The next request waits on this one's answer.
    chained: bool,
    /// Other replicas wait for their turn on it.
    contended: bool,
    /// It ended this replica's run: the next request asks no sooner than this.
    comes_back: Option<Instant>,
}

#[derive(Default)]
struct State {
    epoch: Option<String>,
    pending: Vec<Correction>,
    mine: HashMap<Arc<str>, Mine>,
    /// Redis's clock at the last answer: (local instant the answer arrived, Redis
    /// microseconds). Redis read its clock up to `clock_rtt_us` before that instant, so
    /// this maps a local instant to the earliest Redis time it can be.
    clock: Option<(Instant, f64)>,
    /// The round trip of the call that set `clock`: the most that mapping is early by.
    clock_rtt_us: f64,
    /// Limits held here while Redis is away (`on_redis_error = "local"`).
    fallback: Option<HashMap<Arc<str>, LimitState>>,
    /// Admitted without Redis, or Redis lost its data: write back before reserving.
    absorb: bool,
    /// When this partition last wrote back to Redis.
    synced: Option<Instant>,
    /// A flush is scheduled.
    flushing: bool,
    /// When the oldest correction still waiting was queued: a flush waits for it to be
    /// that old, so that reserve calls, which carry corrections anyway, make it needless.
    oldest: Option<Instant>,
}

struct Correction {
    limit: Arc<GlobalLimit>,
    /// As the limit last knew it: a limit of a unit names members by weight (`named`).
    member: String,
    value: Latest,
    /// What the request really cost in the limit's unit, and the Redis instant its
    /// response said so (the provider reconciled by then), when it did.
    weight: Option<(u64, f64)>,
}

/// The latest instant a reservation may reach the provider, as a correction says it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Latest {
    /// It never went out.
    Never,
    /// As the store has it (a correction of its weight alone).
    Kept,
    At(f64),
}

impl Latest {
    /// Whether it still matters to its limit at Redis instant `now_us`.
    fn matters(self, limit: &GlobalLimit, now_us: f64) -> bool {
        match self {
            Latest::Never | Latest::Kept => true,
            Latest::At(v) => v + micros(limit.span) > now_us,
        }
    }

    fn arg(self) -> String {
        match self {
            Latest::Never => String::new(),
            Latest::Kept => "k".into(),
            Latest::At(v) => num(v),
        }
    }
}

/// What a reservation pays a limit: one for a limit of requests, its cost in the unit of
/// a limit of another.
fn weight(limit: &GlobalLimit, costs: &Costs) -> u64 {
    costs.of(limit.unit())
}

/// A reservation's member as a limit holds it: a limit of a unit carries its weight in
/// the name, as `reserve.lua` names it ("Weights").
fn named(member: &str, limit: &GlobalLimit, costs: &Costs) -> String {
    let w = weight(limit, costs);
    if limit.unit() == crate::limit::costs::REQUESTS || w == 1 {
        member.to_string()
    } else {
        format!("{member}*{w}")
    }
}

/// This replica's own admissions to one limit that still matter.
struct Mine {
    limit: Arc<GlobalLimit>,
    /// Windows: (member, latest arrival, Redis microseconds).
    entries: Vec<(String, f64)>,
    /// Fixed windows: the opening of the window they are in.
    opening: Option<f64>,
    /// Token buckets: until when this replica's own admissions keep the bucket in debt.
    debt_until: f64,
}

/// How a request got through its global limits.
pub(crate) enum Admission {
    /// Reserved through Redis, or admitted by the local fallback: follow it with a hold.
    Held(Box<Hold>),
    /// `on_redis_error = "allow"` while Redis is away.
    Allowed,
}

impl Shared {
    pub(crate) fn new(upstream: &str, partition: Option<Partition>) -> Shared {
        let p = partition.map_or_else(|| "-".to_string(), |p| format!("{:032x}", p.0));
        Shared {
            tag: format!("{{sluice:{upstream}:{p}}}"),
            gates: Mutex::default(),
            state: Mutex::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    fn gate(&self, family: &str) -> Arc<FamilyGate> {
        let mut gates = self.gates.lock();
        match gates.get(family) {
            Some(g) => g.clone(),
            None => {
                let g: Arc<FamilyGate> = Arc::default();
                gates.insert(Arc::from(family), g.clone());
                g
            }
        }
    }

    /// The keys of `limit` in this partition: its state, and a fixed window's opening.
    fn keys(&self, limit: &GlobalLimit) -> (String, String) {
        (
            format!("{}:{}", self.tag, limit.id),
            format!("{}:{}:o", self.tag, limit.id),
        )
    }

    /// Admits a request, already admitted by its local limits, through `limits`, FIFO
    /// among the requests of `family` on this replica. Gives up with `QueueTimeout` when
    /// the instant would be later than `deadline`.
    pub(crate) async fn admit(
        self: &Arc<Self>,
        cluster: &Arc<Cluster>,
        family: &str,
        live: LiveLimits<'_>,
        costs: &Costs,
        deadline: Instant,
    ) -> Result<Admission, LimitError> {
        let gate = self.gate(family);
        let mut turn = gate.first_in_line(deadline).await;
        let metric = |result: &str| count(cluster, result);
        let own_failures = OWN_FAILURES.min(cluster.config.failures).max(1);
        let mut failed = 0;
        let mut turns = 0;
        loop {
            // The live config's limits, read anew at every try: after a reload that
            // lowered them, a request that was already waiting asks under the new ones.
            let limits = &live();
            // The longest window among the limits: an instant further away is asked for
            // again.
            let horizon = limits
                .iter()
                .map(|l| l.span + l.margin)
                .max()
                .unwrap_or_default()
                .max(Duration::from_secs(1));
            let now = Instant::now();
            if let Some(r) = turn.handed.take() {
                if r.at_local > now && Arc::ptr_eq(&r.limits, limits) && r.costs == *costs {
                    metric("handed_over");
                    return Ok(Admission::Held(Box::new(
                        self.wait_for(cluster, &gate, turn, r).await,
                    )));
                }
                // Nobody took it in time: it never went out.
                self.unused(cluster, &r);
            }
            let left = deadline.saturating_duration_since(now);
            if failed >= own_failures {
                // A request that gave up on Redis opens the breaker, whatever other calls
                // do (one failing node of a Redis Cluster, say): the fallback then counts
                // as an outage, after which every replica writes back, rather than a
                // local admission the others know nothing of.
                cluster.trip(now);
                failed = 0;
            }
            let mode = cluster.mode(now);
            match mode {
                Mode::Redis => {
                    if self.must_absorb(cluster, limits, now)
                        && let Err(e) = self.absorb(cluster, limits).await
                    {
                        tracing::debug!(error = %e, "writing back to Redis failed");
                        failed += 1;
                        continue;
                    }
                    let queued = gate.waiting.load(Ordering::Relaxed);
                    let settle = turns >= MAX_TURNS;
                    let ask = self.reserve(
                        cluster,
                        limits,
                        costs,
                        horizon.min(left),
                        left,
                        queued,
                        settle,
                    );
                    match ask.await {
                        Ok(Some(r)) => {
                            metric("reserved");
                            return Ok(Admission::Held(Box::new(
                                self.wait_for(cluster, &gate, turn, r).await,
                            )));
                        }
                        Ok(None) => {}
                        Err(Asked::Later(wait)) => {
                            metric("later");
                            let again = now + wait.saturating_sub(horizon.min(left));
                            tokio::time::sleep_until(again.min(deadline)).await;
                        }
                        Err(Asked::TooLate(wait)) => {
                            metric("too_late");
                            return Err(LimitError::QueueTimeout {
                                retry_after: crate::limit::bucket::retry_after(wait),
                            });
                        }
                        Err(Asked::Turn(wait)) => {
                            metric("turn");
                            turns += 1;
                            let again = now + wait;
                            if again >= deadline {
                                // No time to wait for a turn: take the instant as it is.
                                turns = MAX_TURNS;
                            } else {
                                tokio::time::sleep_until(again).await;
                            }
                        }
                        // The breaker counts it; the next round may fall back.
                        Err(Asked::Failed) => failed += 1,
                    }
                }
                Mode::Local | Mode::Allow | Mode::Deny => {
                    match self.without_redis(cluster, mode, limits, costs, now, deadline) {
                        Ok(done) => return done,
                        Err(wake) => tokio::time::sleep_until(wake).await,
                    }
                }
            }
            if Instant::now() >= deadline {
                metric("too_late");
                return Err(LimitError::QueueTimeout {
                    retry_after: Duration::from_secs(1),
                });
            }
        }
    }

    /// While Redis is away, as `on_redis_error` says: admitted by this replica's share
    /// of each limit (`local`), let through (`allow`) or refused (`deny`). `Err`: try again
    /// at that instant, when the local limits allow it or Redis may be back.
    fn without_redis(
        self: &Arc<Self>,
        cluster: &Arc<Cluster>,
        mode: Mode,
        limits: &Arc<[Arc<GlobalLimit>]>,
        costs: &Costs,
        now: Instant,
        deadline: Instant,
    ) -> Result<Result<Admission, LimitError>, Instant> {
        let reopens = cluster.reopens_at().unwrap_or(now);
        match mode {
            Mode::Allow => {
                count(cluster, "allowed");
                Ok(Ok(Admission::Allowed))
            }
            Mode::Deny => {
                count(cluster, "denied");
                let wait = reopens.saturating_duration_since(now);
                Ok(Err(LimitError::ClusterUnavailable {
                    retry_after: crate::limit::bucket::retry_after(wait),
                }))
            }
            _ => match self.fallback_take(cluster, limits, costs, now) {
                Ok(hold) => {
                    count(cluster, "local");
                    Ok(Ok(Admission::Held(Box::new(hold))))
                }
                Err(next) => {
                    let wake = next.map_or(reopens, |n| n.min(reopens.max(now)));
                    if wake >= deadline {
                        count(cluster, "too_late");
                        return Ok(Err(LimitError::QueueTimeout {
                            retry_after: crate::limit::bucket::retry_after(wake - now),
                        }));
                    }
                    Err(wake.max(now + Duration::from_millis(1)))
                }
            },
        }
    }

    /// Sleeps until the reserved instant, keeping the family's turn so that the next
    /// request asks only after this one goes; a request that leaves meanwhile hands its
    /// reservation on.
    async fn wait_for(
        self: &Arc<Self>,
        cluster: &Arc<Cluster>,
        gate: &Arc<FamilyGate>,
        turn: tokio::sync::MutexGuard<'_, Gate>,
        r: Reserved,
    ) -> Hold {
        struct Holding<'a> {
            turn: tokio::sync::MutexGuard<'a, Gate>,
            r: Option<Reserved>,
        }
        impl Drop for Holding<'_> {
            fn drop(&mut self) {
                if let Some(r) = self.r.take() {
                    self.turn.handed = Some(r);
                }
            }
        }
        let at = r.at_local;
        let mut holding = Holding {
            turn,
            r: Some(r.clone()),
        };
        // A reservation for now goes at once: a timer would wait for the next tick.
        if at > Instant::now() {
            tokio::time::sleep_until(at).await;
        }
        // Used: nothing to hand on.
        holding.r = None;
        if r.chained {
            let margin = r.limits.iter().map(|l| l.margin).max().unwrap_or_default();
            holding.turn.answers_by = Some(at.max(Instant::now()) + margin);
        }
        holding.turn.not_before = r.comes_back;
        // Counted before the turn passes on: the next request, on another worker
        // thread, waits for this answer only if it sees it unanswered.
        let unanswered = Unanswered::new(gate);
        drop(holding);
        Hold {
            shared: self.clone(),
            cluster: cluster.clone(),
            weights: parking_lot::Mutex::new(r.costs),
            r,
            fallback: None,
            unanswered: parking_lot::Mutex::new(Some(unanswered)),
        }
    }

    /// One reserve call, carrying the corrections waiting. `Ok(None)`: Redis has lost its
    /// data (found now, or by the flush task meanwhile) and a write-back is due; ask
    /// again, and the caller writes back first.
    #[allow(
        clippy::too_many_arguments,
        reason = "one reservation's inputs, each named at the call"
    )]
    async fn reserve(
        self: &Arc<Self>,
        cluster: &Arc<Cluster>,
        limits: &Arc<[Arc<GlobalLimit>]>,
        costs: &Costs,
        horizon: Duration,
        max_wait: Duration,
        queued: usize,
        settle: bool,
    ) -> Result<Option<Reserved>, Asked> {
        let op = if settle { "settle" } else { "reserve" };
        let member = cluster.member();
        let (known, pending) = {
            let mut st = self.state();
            // Marked for a write-back since the caller looked (the flush task found the
            // epoch changed, and forgot it): reserving now would send no epoch, so the
            // script could not tell it lost its data and would reserve on an empty
            // window, on top of what the other replicas admitted. Ask again: the caller
            // writes back first.
            if st.absorb {
                return Ok(None);
            }
            st.oldest = None;
            (st.epoch.clone(), std::mem::take(&mut st.pending))
        };
        // The request's limits pay; limits that only have corrections come along.
        let mut all: Vec<(Arc<GlobalLimit>, bool)> =
            limits.iter().map(|l| (l.clone(), true)).collect();
        for c in &pending {
            if !all.iter().any(|(l, _)| l.id == c.limit.id) {
                all.push((c.limit.clone(), false));
            }
        }
        let mut inv = cluster.script.prepare_invoke();
        let call = Call {
            op,
            known: &known,
            member: &member,
            horizon,
            max_wait,
            queued,
            costs,
        };
        self.head(&mut inv, &call, &all);
        self.corrections(&mut inv, &all, &pending);
        let sent = Instant::now();
        let reply = cluster.run(op, inv).await;
        let received = Instant::now();
        let reply = match reply {
            Ok(r) => r,
            Err(_) => {
                let mut st = self.state();
                st.pending.splice(0..0, pending);
                st.oldest.get_or_insert(sent);
                return Err(Asked::Failed);
            }
        };
        let mut st = self.state();
        match reply {
            Reply::Reserved {
                wait,
                now,
                epoch,
                openings,
                chained,
                contended,
                comes_back,
            } => {
                st.epoch = Some(epoch);
                st.clock = Some((received, now));
                st.clock_rtt_us = micros(received - sent);
                let at_us = now + micros(wait);
                let slack_us = micros(received - sent);
                for ((l, pays), opening) in all.iter().zip(openings) {
                    if *pays {
                        remember(&mut st, l, &member, costs, at_us, Some(opening));
                    }
                }
                Ok(Some(Reserved {
                    member,
                    at_us,
                    at_local: received + wait,
                    slack_us,
                    limits: limits.clone(),
                    costs: *costs,
                    chained,
                    contended,
                    comes_back: comes_back.map(|d| received + d),
                }))
            }
            Reply::Later { wait, epoch } => {
                st.epoch = Some(epoch);
                Err(Asked::Later(wait))
            }
            Reply::TooLate { wait, epoch } => {
                st.epoch = Some(epoch);
                Err(Asked::TooLate(wait))
            }
            Reply::Turn { wait, epoch } => {
                st.epoch = Some(epoch);
                Err(Asked::Turn(wait))
            }
            Reply::EpochChanged { epoch } => {
                tracing::warn!(partition = %self.tag, "Redis lost the shared limits' state (restart or flush): writing back this replica's admissions");
                // The corrections were about entries Redis no longer has.
                let _ = epoch;
                st.epoch = None;
                st.absorb = true;
                Ok(None)
            }
            Reply::Done { .. } => Err(Asked::Failed),
        }
    }

    /// Whether to write back before reserving: this replica admitted without Redis, or
    /// Redis lost its data, or this partition has not written back since an outage whose
    /// admissions may still be in a window. In the last case the other replicas may
    /// have admitted their shares locally while this one admitted nothing (its share
    /// was still drained, or no request came): Redis knows none of it, and the
    /// write-back's filling the windows keeps this replica, back first, from spending a
    /// whole window on top of theirs.
    fn must_absorb(&self, cluster: &Cluster, limits: &[Arc<GlobalLimit>], now: Instant) -> bool {
        let st = self.state();
        if st.absorb {
            return true;
        }
        let Some((opened, back)) = cluster.outage() else {
            return false;
        };
        let reach = limits
            .iter()
            .map(|l| l.span + l.margin)
            .max()
            .unwrap_or_default();
        st.synced.is_none_or(|s| s < opened) && back.is_none_or(|b| now < b + reach)
    }

    /// Writes back this replica's admissions still inside their windows, with `limits`
    /// (the request's) among the limits filled, then forgets the local fallback: Redis
    /// holds everything again.
    async fn absorb(
        self: &Arc<Self>,
        cluster: &Arc<Cluster>,
        limits: &[Arc<GlobalLimit>],
    ) -> Result<(), CallError> {
        let (all, entries) = {
            let mut st = self.state();
            let now_us = st.redis_now(Instant::now());
            let mut all = Vec::new();
            let mut entries = Vec::new();
            for m in st.mine.values_mut() {
                m.prune(now_us);
                all.push((m.limit.clone(), false));
                entries.push((
                    m.entries.clone(),
                    m.opening,
                    (m.debt_until - now_us).max(0.0),
                ));
            }
            for l in limits {
                if !all.iter().any(|(a, _)| a.id == l.id) {
                    all.push((l.clone(), false));
                    entries.push((Vec::new(), None, 0.0));
                }
            }
            (all, entries)
        };
        let mut inv = cluster.script.prepare_invoke();
        self.head(&mut inv, &Call::bare("absorb", &None), &all);
        for ((l, _), (pairs, opening, debt)) in all.iter().zip(&entries) {
            if l.is_window() {
                inv.arg(pairs.len());
                if l.kind == Kind::Fixed {
                    // The earliest of its own reservations, if it knows no opening; 0: none.
                    let first = pairs
                        .iter()
                        .map(|p| p.1 - micros(l.margin))
                        .reduce(f64::min);
                    let o = match (opening, first) {
                        (Some(o), Some(f)) => o.min(f),
                        (o, f) => o.or(f).unwrap_or(0.0),
                    };
                    inv.arg(num(o));
                }
                for (member, value) in pairs {
                    inv.arg(member).arg(num(*value));
                }
            } else {
                inv.arg(num(*debt));
            }
        }
        let sent = Instant::now();
        let reply = cluster.run("absorb", inv).await?;
        let received = Instant::now();
        if let Reply::Done { now, epoch } = reply {
            let mut st = self.state();
            st.epoch = Some(epoch);
            st.clock = Some((received, now));
            st.clock_rtt_us = micros(received - sent);
            st.absorb = false;
            st.synced = Some(Instant::now());
            st.fallback = None;
            tracing::info!(partition = %self.tag, "wrote this replica's admissions back to Redis");
        }
        Ok(())
    }

    /// Sends the corrections waiting once the oldest is `delay` old, unless a reserve
    /// call carries them first.
    async fn flush(self: &Arc<Self>, cluster: &Arc<Cluster>, delay: Duration) {
        let (known, pending) = loop {
            let due = {
                let mut st = self.state();
                match st.oldest {
                    None => {
                        st.flushing = false;
                        return;
                    }
                    Some(t) if Instant::now() >= t + delay => {
                        st.flushing = false;
                        st.oldest = None;
                        if st.pending.is_empty() || st.absorb {
                            return;
                        }
                        break (st.epoch.clone(), std::mem::take(&mut st.pending));
                    }
                    Some(t) => t + delay,
                }
            };
            tokio::time::sleep_until(due).await;
        };
        let mut all: Vec<(Arc<GlobalLimit>, bool)> = Vec::new();
        for c in &pending {
            if !all.iter().any(|(l, _)| l.id == c.limit.id) {
                all.push((c.limit.clone(), false));
            }
        }
        let mut inv = cluster.script.prepare_invoke();
        self.head(&mut inv, &Call::bare("flush", &known), &all);
        self.corrections(&mut inv, &all, &pending);
        match cluster.run("flush", inv).await {
            Ok(Reply::EpochChanged { .. }) => {
                let mut st = self.state();
                st.epoch = None;
                st.absorb = true;
            }
            Ok(_) => {}
            // Kept for the next call, unless they no longer matter by then.
            Err(_) => {
                let mut st = self.state();
                let now_us = st.redis_now(Instant::now());
                let mut pending = pending;
                pending.retain(|c| c.value.matters(&c.limit, now_us));
                if !pending.is_empty() {
                    st.oldest.get_or_insert(Instant::now());
                }
                st.pending.splice(0..0, pending);
            }
        }
    }

    /// Keys and the arguments before the corrections (see `reserve.lua`).
    fn head(
        &self,
        inv: &mut redis::ScriptInvocation<'_>,
        call: &Call<'_>,
        all: &[(Arc<GlobalLimit>, bool)],
    ) {
        inv.key(format!("{}:epoch", self.tag));
        for (l, _) in all {
            let (k, aux) = self.keys(l);
            inv.key(k).key(aux);
        }
        inv.key(format!("{}:run", self.tag))
            .key(format!("{}:claims", self.tag));
        inv.arg(call.op)
            .arg("")
            .arg(call.known.as_deref().unwrap_or(""))
            .arg(format!("{:016x}", rand::random::<u64>()))
            .arg(call.member)
            .arg(micros(call.horizon).ceil() as u64)
            .arg(micros(call.max_wait).ceil() as u64)
            .arg(call.queued)
            .arg(all.len());
        for (l, pays) in all {
            // A limit of a unit: what this reservation pays it (nothing if it only
            // carries corrections).
            let w = match (l.unit() == crate::limit::costs::REQUESTS, pays) {
                (true, _) => String::new(),
                (false, true) => weight(l, call.costs).to_string(),
                (false, false) => "0".into(),
            };
            inv.arg(&super::script_args(l)[..])
                .arg(num(micros(l.margin)))
                .arg(if *pays { "1" } else { "0" })
                .arg(w);
        }
    }

    fn corrections(
        &self,
        inv: &mut redis::ScriptInvocation<'_>,
        all: &[(Arc<GlobalLimit>, bool)],
        pending: &[Correction],
    ) {
        inv.arg(pending.len());
        for c in pending {
            let index = all
                .iter()
                .position(|(l, _)| l.id == c.limit.id)
                .unwrap_or(0)
                + 1;
            inv.arg(index).arg(&c.member).arg(c.value.arg()).arg(
                c.weight
                    .map(|(w, said)| format!("{w} {}", num(said)))
                    .unwrap_or_default(),
            );
        }
    }

    /// Queues a correction, and makes sure it reaches Redis within `delay` if no call of
    /// this replica carries it first.
    fn correct(self: &Arc<Self>, cluster: &Arc<Cluster>, c: Correction, delay: Duration) {
        let urgent = delay < LAZY_MAX;
        let schedule = {
            let mut st = self.state();
            st.pending.push(c);
            let now = Instant::now();
            // Dated so that the flush, `LAZY_MAX` after the oldest, comes `delay` from now:
            // an urgent one makes the whole batch that old.
            let queued = match LAZY_MAX.checked_sub(delay) {
                Some(early) => now.checked_sub(early).unwrap_or(now),
                None => now + (delay - LAZY_MAX),
            };
            st.oldest = Some(st.oldest.map_or(queued, |t| t.min(queued)));
            // A flusher already asleep would not wake for an urgent one: start another.
            !std::mem::replace(&mut st.flushing, true) || urgent
        };
        if schedule && let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (me, cluster) = (self.clone(), cluster.clone());
            rt.spawn(async move { me.flush(&cluster, LAZY_MAX).await });
        } else if schedule {
            self.state().flushing = false;
        }
    }

    /// A reservation nobody used before its instant: it never went out.
    fn unused(self: &Arc<Self>, cluster: &Arc<Cluster>, r: &Reserved) {
        for l in r.limits.iter() {
            let member = named(&r.member, l, &r.costs);
            self.forget(&l.id, &member);
            self.correct(
                cluster,
                Correction {
                    limit: l.clone(),
                    member,
                    value: Latest::Never,
                    weight: None,
                },
                URGENT,
            );
        }
    }

    fn forget(&self, limit: &str, member: &str) {
        if let Some(m) = self.state().mine.get_mut(limit) {
            m.entries.retain(|e| e.0 != member);
        }
    }

    fn update_mine(&self, limit: &str, member: &str, value: f64) {
        if let Some(m) = self.state().mine.get_mut(limit)
            && let Some(e) = m.entries.iter_mut().find(|e| e.0 == member)
        {
            e.1 = value;
        }
    }

    /// This replica's own admission `member` to `limit` really weighed `w`, `was` more or
    /// less than it paid: renamed in a window, a bucket's debt moved.
    fn reweigh_mine(&self, limit: &GlobalLimit, member: &str, renamed: String, was: u64, w: u64) {
        if let Some(m) = self.state().mine.get_mut(&limit.id) {
            if let Some(e) = m.entries.iter_mut().find(|e| e.0 == member) {
                e.0 = renamed;
            }
            if limit.kind == Kind::Token && w > was {
                m.debt_until += (w - was) as f64 * limit.a;
            }
        }
    }

    /// Admits through this replica's share of each limit while Redis is away. The shares
    /// start drained: whatever Redis admitted just before it went away is still inside
    /// its windows. `Err(Some(t))`: not before `t`; `Err(None)`: a limit without a rate
    /// to share (never global).
    fn fallback_take(
        self: &Arc<Self>,
        cluster: &Arc<Cluster>,
        limits: &Arc<[Arc<GlobalLimit>]>,
        costs: &Costs,
        now: Instant,
    ) -> Result<Hold, Option<Instant>> {
        let replicas = cluster.config.replicas.unwrap_or(1).max(1);
        let mut st = self.state();
        let states = st.fallback.get_or_insert_with(HashMap::new);
        for l in limits.iter() {
            if !states.contains_key(&l.id) {
                let Some(share) = share(&l.spec, replicas) else {
                    return Err(None);
                };
                let mut s = LimitState::new(&share, now);
                if l.unit() == crate::limit::costs::REQUESTS {
                    let mut drain = 0;
                    while s.can_take(now) {
                        s.take(now);
                        s.sent(u64::MAX - drain, Some(0), now);
                        drain += 1;
                    }
                } else {
                    // Thousands of tokens: drained in one admission of them all.
                    let n = s.available(now);
                    if n > 0 {
                        s.take_n(n, now);
                        s.sent_n(u64::MAX, n, Some(0), now);
                    }
                }
                states.insert(l.id.clone(), s);
            }
        }
        let mut next: Option<Instant> = None;
        for l in limits.iter() {
            let s = states.get_mut(&l.id).ok_or(None)?;
            let w = weight(l, costs);
            if !s.can_take_n(w, now) {
                let at = s.ready_at(w, now).unwrap_or(now + l.span);
                next = Some(next.map_or(at, |n| n.max(at)));
            }
        }
        if let Some(n) = next {
            return Err(Some(n));
        }
        let id = cluster
            .seq
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for l in limits.iter() {
            if let Some(s) = states.get_mut(&l.id) {
                s.take_n(weight(l, costs), now);
            }
        }
        st.absorb = true;
        let member = format!("{}:{id}", cluster.replica);
        // The latest Redis time `now` can be: an admission counted later holds its permit
        // longer, never shorter. A call that answered slowly (Redis frozen, then thawed)
        // would otherwise date this admission up to its round trip too early.
        let at_us = st.redis_now(now) + st.clock_rtt_us;
        for l in limits.iter() {
            remember(&mut st, l, &member, costs, at_us, None);
        }
        drop(st);
        Ok(Hold {
            shared: self.clone(),
            cluster: cluster.clone(),
            weights: parking_lot::Mutex::new(*costs),
            r: Reserved {
                member,
                at_us,
                at_local: now,
                slack_us: 0.0,
                limits: limits.clone(),
                costs: *costs,
                chained: false,
                contended: false,
                comes_back: None,
            },
            fallback: Some(id),
            unanswered: parking_lot::Mutex::new(None),
        })
    }

    /// For `/buckets`: this replica's view of each global limit it has used.
    pub(crate) fn describe(&self) -> serde_json::Value {
        let mut st = self.state();
        let now = Instant::now();
        let now_us = st.redis_now(now);
        let fallback = st.fallback.is_some();
        let mut out = serde_json::Map::new();
        for (id, m) in st.mine.iter_mut() {
            m.prune(now_us);
            out.insert(
                id.to_string(),
                serde_json::json!({ "own_admissions_in_window": m.entries.len() }),
            );
        }
        serde_json::json!({
            "limits": out,
            "pending_corrections": st.pending.len(),
            "local_fallback": fallback,
        })
    }
}

/// One call's arguments before its limits (see `reserve.lua`).
struct Call<'a> {
    op: &'a str,
    known: &'a Option<String>,
    member: &'a str,
    horizon: Duration,
    max_wait: Duration,
    queued: usize,
    costs: &'a Costs,
}

impl<'a> Call<'a> {
    /// A call that reserves nothing: a flush or a write-back.
    fn bare(op: &'a str, known: &'a Option<String>) -> Call<'a> {
        Call {
            op,
            known,
            member: "",
            horizon: Duration::ZERO,
            max_wait: Duration::ZERO,
            queued: 0,
            costs: &Costs::ONE,
        }
    }
}

/// What the admission loop learned from one call besides a reservation.
enum Asked {
    Later(Duration),
    TooLate(Duration),
    /// Come back this much later, for the turn.
    Turn(Duration),
    Failed,
}

impl State {
    /// Redis's clock now, as last seen.
    fn redis_now(&self, now: Instant) -> f64 {
        match self.clock {
            Some((local, us)) => us + micros(now.saturating_duration_since(local)),
            // Never talked to Redis: the wall clock is the best guess.
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(micros)
                .unwrap_or(0.0),
        }
    }
}

impl Mine {
    fn prune(&mut self, now_us: f64) {
        let span = micros(self.limit.span);
        self.entries.retain(|e| e.1 + span > now_us);
        if self.entries.is_empty() {
            self.opening = None;
        }
    }
}

/// Notes an admission of this replica to `limit` reserved at `at_us`.
fn remember(
    st: &mut State,
    limit: &Arc<GlobalLimit>,
    member: &str,
    costs: &Costs,
    at_us: f64,
    opening: Option<f64>,
) {
    let m = st.mine.entry(limit.id.clone()).or_insert_with(|| Mine {
        limit: limit.clone(),
        entries: Vec::new(),
        opening: None,
        debt_until: 0.0,
    });
    m.limit = limit.clone();
    let latest = at_us + micros(limit.margin);
    match limit.kind {
        Kind::Token => {
            m.debt_until = m.debt_until.max(latest) + weight(limit, costs) as f64 * limit.a;
        }
        Kind::Sliding | Kind::Fixed | Kind::Calendar | Kind::Counter { .. } => {
            m.prune(at_us);
            if limit.kind == Kind::Fixed {
                match opening.filter(|o| *o > 0.0) {
                    // A new window: what this replica had in the old one no longer counts.
                    Some(o) if m.opening.is_some_and(|cur| o > cur) => {
                        m.entries.clear();
                        m.opening = Some(o);
                    }
                    Some(o) => m.opening = Some(m.opening.map_or(o, |cur| cur.min(o))),
                    None => {}
                }
            }
            m.entries.push((named(member, limit, costs), latest));
        }
    }
}

/// One replica's share of a global limit while Redis is away: its long-run share of the
/// rate. A fixed window from the first request becomes a sliding one: replicas' own
/// windows would not line up with the provider's, and any window of its length must
/// hold; windows on the clock line up by themselves. A counter's share is compared
/// unrounded: each replica's rounding slack would add up. A GCRA's share keeps its pace
/// `replicas` times slower, with its burst split.
///
/// A limit smaller than the replica count gives each replica one request per
/// `ceil(replicas / permits)` windows (a bucket: a burst of one), so that every replica
/// keeps serving; the provider may then see up to `replicas` requests in one window, which
/// `sluice check` and the startup log say. `None` only for what has no rate (concurrency).
pub(crate) fn share(spec: &Limit, replicas: u32) -> Option<Limit> {
    let replicas = replicas.max(1);
    // Permits per window, and how many windows that many take.
    let split = |n: u32| match std::num::NonZeroU32::new(n / replicas) {
        Some(p) => (p, 1),
        None => (std::num::NonZeroU32::MIN, replicas.div_ceil(n.max(1))),
    };
    let burst =
        |b: u32| std::num::NonZeroU32::new(b / replicas).unwrap_or(std::num::NonZeroU32::MIN);
    let (margin, scope, unit) = (spec.margin_spec(), spec.scope(), spec.unit_ref().clone());
    Some(match *spec {
        Limit::SlidingWindow {
            permits, window, ..
        }
        | Limit::FixedWindow {
            permits,
            window,
            align: WindowAlign::First,
            ..
        } => {
            let (permits, k) = split(permits.get());
            Limit::SlidingWindow {
                permits,
                window: window.checked_mul(k)?,
                margin,
                margin_max: None,
                scope,
                unit: unit.clone(),
            }
        }
        Limit::FixedWindow {
            permits,
            window,
            align,
            offset,
            ..
        } => {
            let (permits, k) = split(permits.get());
            Limit::FixedWindow {
                permits,
                window: window.checked_mul(k)?,
                align,
                offset,
                margin,
                margin_max: None,
                scope,
                unit: unit.clone(),
            }
        }
        Limit::SlidingCounter {
            permits,
            window,
            align,
            offset,
            ..
        } => {
            let (permits, k) = split(permits.get());
            Limit::SlidingCounter {
                permits,
                window: window.checked_mul(k)?,
                align,
                offset,
                rounding: Rounding::None,
                margin,
                margin_max: None,
                scope,
                unit: unit.clone(),
            }
        }
        Limit::TokenBucket {
            rate,
            per,
            burst: b,
            ..
        } => Limit::TokenBucket {
            rate,
            per: per.checked_mul(replicas)?,
            burst: burst(b.get()),
            margin,
            margin_max: None,
            scope,
            unit: unit.clone(),
        },
        Limit::LeakyBucket { .. } | Limit::Published { .. } => {
            let pace = Pace::of(spec)?;
            let interval =
                Duration::from_nanos(u64::try_from(pace.per_ns.div_ceil(pace.rate)).ok()?);
            Limit::TokenBucket {
                rate: std::num::NonZeroU32::MIN,
                per: interval.checked_mul(replicas)?,
                burst: burst(u32::try_from(pace.burst()).unwrap_or(u32::MAX)),
                margin: margin.or(Some(crate::config::Margin::Duration(spec.margin()?))),
                margin_max: None,
                scope,
                unit: unit.clone(),
            }
        }
        Limit::Concurrency { .. } => return None,
    })
}

fn num(x: f64) -> String {
    format!("{x:.3}")
}

/// A request admitted through its global limits, followed to its send and answer so that
/// Redis (or the local fallback) counts it as the provider does.
pub(crate) struct Hold {
    shared: Arc<Shared>,
    cluster: Arc<Cluster>,
    r: Reserved,
    /// What it costs as last known: its estimate until its response says otherwise.
    weights: parking_lot::Mutex<Costs>,
    /// Admitted by the local fallback, under this id.
    fallback: Option<u64>,
    /// Counted among its family's unanswered reservations until its correction is
    /// queued (or it is known never sent, or dropped).
    unanswered: parking_lot::Mutex<Option<Unanswered>>,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold")
            .field("member", &self.r.member)
            .field("fallback", &self.fallback)
            .finish()
    }
}

impl Hold {
    /// The Redis instant of a local one, late by at most the call's round trip.
    fn us(&self, t: Instant) -> f64 {
        let d = micros(t.saturating_duration_since(self.r.at_local))
            - micros(self.r.at_local.saturating_duration_since(t));
        self.r.at_us + d + self.r.slack_us
    }

    /// Handed to its upstream connection at `at`. Later than the margin after the
    /// reserved instant, Redis must hold the permit longer: corrected at once.
    pub(crate) fn sent(&self, at: Instant) {
        if let Some(id) = self.fallback {
            self.fallback_event(|s, w| s.sent_n(id, w, Some(0), at));
        }
        // How late on Redis's clock at most: the local delay plus the reservation call's
        // round trip, by which the local instant may trail the reserved one.
        let late = self.us(at) - self.r.at_us;
        for l in self.r.limits.iter() {
            // The margin covers a send a little after its instant (scheduling); one later
            // than a quarter of it (a slow connect) holds the permit longer.
            if late > NOISE_US.max(micros(l.margin) / 4.0) {
                self.report(l, Some(self.us(at) + micros(l.margin)), URGENT);
            }
        }
    }

    /// Answered at `at`, having been sent at `sent`: it reached the provider by then.
    pub(crate) fn answered(&self, sent: Instant, at: Instant, took: Duration) {
        if let Some(id) = self.fallback {
            self.fallback_event(|s, _| s.answered(id, at, took));
        }
        // Another replica comes back for its turn when this answer should be in: it
        // goes at once, unless the next request here, waiting on it, carries it.
        let carried = self.r.comes_back.is_none()
            && self
                .unanswered
                .lock()
                .as_ref()
                .is_some_and(|u| u.0.waiting.load(Ordering::Relaxed) > 0);
        for l in self.r.limits.iter() {
            let held = self.r.at_us.max(self.us(sent)) + micros(l.margin);
            let latest = self.us(at).min(self.us(sent) + micros(l.margin));
            if latest + NOISE_US < held {
                let delay = if self.r.contended && !carried {
                    Duration::ZERO
                } else if l.is_window() {
                    (l.span + l.margin).clamp(LAZY_MAX, LAZY_WINDOW_MAX)
                } else {
                    LAZY_MAX
                };
                self.report(l, Some(latest), delay);
            }
        }
        drop(self.unanswered.lock().take());
    }

    /// Never handed to a connection: the provider did not see it.
    pub(crate) fn unsent(&self) {
        if self.fallback.is_some() {
            self.fallback_event(|s, w| s.unsent_n(w, 0));
        }
        for l in self.r.limits.iter() {
            // A fixed window's opening may move later, another replica may wait: soon.
            let soon = l.kind == Kind::Fixed || self.r.contended;
            self.report(l, None, if soon { URGENT } else { LAZY_MAX });
        }
        drop(self.unanswered.lock().take());
    }

    /// The latest instant this request may reach the provider under `l` is now `value`
    /// (`None`: never): noted in this replica's own admissions, and sent to Redis unless
    /// the local fallback admitted it.
    fn report(&self, l: &Arc<GlobalLimit>, value: Option<f64>, delay: Duration) {
        let member = named(&self.r.member, l, &self.weights.lock());
        match value {
            Some(v) => self.shared.update_mine(&l.id, &member, v),
            None => self.shared.forget(&l.id, &member),
        }
        if self.fallback.is_none() {
            self.shared.correct(
                &self.cluster,
                Correction {
                    limit: l.clone(),
                    member,
                    value: value.map_or(Latest::Never, Latest::At),
                    weight: None,
                },
                delay,
            );
        }
    }

    /// Its response says it really cost `w` in unit `unit`: every limit of that unit it
    /// paid gives back, or takes, the difference, as the provider does when it
    /// reconciles (`reserve.lua`, "Weights").
    pub(crate) fn reweigh(&self, unit: u8, w: u64) {
        if unit == crate::limit::costs::REQUESTS {
            return;
        }
        let mut weights = self.weights.lock();
        let before = *weights;
        let was = before.of(unit);
        if was == w {
            return;
        }
        *weights = before.with(unit, w);
        let after = *weights;
        drop(weights);
        // The earliest Redis instant this can be: the provider gave back no sooner.
        let said = self.us(Instant::now()) - self.r.slack_us;
        if let Some(id) = self.fallback {
            let mut st = self.shared.state();
            if let Some(states) = st.fallback.as_mut() {
                for l in self.r.limits.iter().filter(|l| l.unit() == unit) {
                    if let Some(s) = states.get_mut(&l.id) {
                        s.reweigh(id, was, w, 0, Instant::now());
                    }
                }
            }
        }
        for l in self.r.limits.iter().filter(|l| l.unit() == unit) {
            let member = named(&self.r.member, l, &before);
            self.shared
                .reweigh_mine(l, &member, named(&self.r.member, l, &after), was, w);
            if self.fallback.is_none() {
                // A charge holds permits longer: soon. A refund frees some: lazily.
                let delay = if w > was || self.r.contended {
                    URGENT
                } else {
                    LAZY_MAX
                };
                self.shared.correct(
                    &self.cluster,
                    Correction {
                        limit: l.clone(),
                        member,
                        value: Latest::Kept,
                        weight: Some((w, said)),
                    },
                    delay,
                );
            }
        }
    }

    /// `f` on each limit's local fallback state, with what the request weighs there.
    fn fallback_event(&self, f: impl Fn(&mut LimitState, u64)) {
        let costs = *self.weights.lock();
        let mut st = self.shared.state();
        if let Some(states) = st.fallback.as_mut() {
            for l in self.r.limits.iter() {
                if let Some(s) = states.get_mut(&l.id) {
                    f(s, weight(l, &costs));
                }
            }
        }
    }
}

/// The store on Redis: each partition's [`Shared`] with the cluster it calls.
impl Store for Cluster {
    fn partition(
        self: Arc<Self>,
        upstream: &str,
        partition: Option<Partition>,
    ) -> Arc<dyn StorePartition> {
        Arc::new(OnRedis {
            shared: Arc::new(Shared::new(upstream, partition)),
            cluster: self,
        })
    }

    fn describe(&self) -> serde_json::Value {
        Cluster::describe(self)
    }
}

/// A partition's [`Shared`] and the cluster its calls go to.
struct OnRedis {
    shared: Arc<Shared>,
    cluster: Arc<Cluster>,
}

impl StorePartition for OnRedis {
    fn admit<'a>(
        &'a self,
        family: &'a str,
        limits: LiveLimits<'a>,
        costs: &'a Costs,
        deadline: Instant,
    ) -> Reserving<'a> {
        Box::pin(async move {
            Ok(
                match self
                    .shared
                    .admit(&self.cluster, family, limits, costs, deadline)
                    .await?
                {
                    Admission::Held(hold) => Some(hold as Box<dyn Reservation>),
                    Admission::Allowed => None,
                },
            )
        })
    }

    fn describe(&self) -> serde_json::Value {
        self.shared.describe()
    }
}

impl Reservation for Hold {
    fn sent(&self, at: Instant) {
        Hold::sent(self, at);
    }

    fn answered(&self, sent: Instant, at: Instant, took: Duration) {
        Hold::answered(self, sent, at, took);
    }

    fn unsent(&self) {
        Hold::unsent(self);
    }

    fn reweigh(&self, unit: u8, w: u64) {
        Hold::reweigh(self, unit, w);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(toml: &str) -> Limit {
        toml::from_str(toml).expect("a limit")
    }

    fn window(l: &Limit) -> (u32, Duration) {
        l.window_limit().expect("a window")
    }

    /// A cluster that is never called: these tests run without a runtime, so a queued
    /// correction stays queued where they can read it.
    fn cluster() -> Arc<Cluster> {
        let config = crate::config::Config::parse(
            "[[upstream]]\nname = \"u\"\nhosts = [\"u\"]\n\
             [cluster]\nredis = \"redis://127.0.0.1:1\"\nreplicas = 3\n",
            "t.toml",
        )
        .expect("a config");
        let metrics = crate::metrics::Metrics::new(prometheus::Registry::new()).expect("metrics");
        Cluster::new(config.cluster.as_ref().expect("[cluster]"), &metrics).expect("a cluster")
    }

    /// `toml` is an inline table, as a config writes a limit.
    fn global(toml: &str) -> Arc<GlobalLimit> {
        let doc: toml::Table = toml::from_str(&format!("l = {toml}")).expect("a limit");
        let spec: Limit = doc["l"].clone().try_into().expect("a limit");
        Arc::new(GlobalLimit::new("l".into(), &spec).expect("a global limit"))
    }

    /// Redis's clock at the reservation, in microseconds.
    const AT: f64 = 1e15;

    /// A reservation of `l` for Redis instant `AT`, which is `at` here, remembered as this
    /// replica's own admission.
    fn reserved(shared: &Arc<Shared>, l: &Arc<GlobalLimit>, at: Instant) -> Hold {
        remember(&mut shared.state(), l, "m1", &Costs::ONE, AT, None);
        Hold {
            shared: shared.clone(),
            cluster: cluster(),
            weights: parking_lot::Mutex::new(Costs::ONE),
            r: Reserved {
                member: "m1".into(),
                at_us: AT,
                at_local: at,
                slack_us: 0.0,
                limits: Arc::from(vec![l.clone()]),
                costs: Costs::ONE,
                chained: false,
                contended: false,
                comes_back: None,
            },
            fallback: None,
            unanswered: parking_lot::Mutex::new(None),
        }
    }

    /// The corrections queued for Redis: (limit, member, latest arrival), and this
    /// replica's own admissions to `l`: (member, latest arrival).
    fn queued(shared: &Shared, l: &GlobalLimit) -> (Vec<Option<f64>>, Vec<(String, f64)>) {
        let st = shared.state();
        let pending = st
            .pending
            .iter()
            .map(|c| match c.value {
                Latest::At(v) => Some(v),
                Latest::Never | Latest::Kept => None,
            })
            .collect();
        let mine = st
            .mine
            .get(&l.id)
            .map(|m| m.entries.clone())
            .unwrap_or_default();
        (pending, mine)
    }

    const MS: f64 = 1000.0;

    /// A send within a quarter of the margin after its instant is scheduling noise: no
    /// correction. A later one (a slow connect) holds the permit until the send plus the
    /// margin, in Redis and in this replica's own admissions.
    #[test]
    fn a_late_send_holds_the_permit_longer() {
        let l =
            global(r#"{ kind = "sliding_window", permits = 10, window = "1s", scope = "global" }"#);
        assert_eq!(
            l.margin,
            Duration::from_millis(200),
            "a fifth of the window"
        );
        let t0 = Instant::now();
        let shared = Arc::new(Shared::new("u", None));
        reserved(&shared, &l, t0).sent(t0 + Duration::from_millis(50));
        assert_eq!(
            queued(&shared, &l),
            (vec![], vec![("m1".into(), AT + 200.0 * MS)])
        );

        let shared = Arc::new(Shared::new("u", None));
        reserved(&shared, &l, t0).sent(t0 + Duration::from_millis(80));
        let late = AT + 80.0 * MS + 200.0 * MS;
        assert_eq!(
            queued(&shared, &l),
            (vec![Some(late)], vec![("m1".into(), late)])
        );
    }

    /// An answer before the margin ran out frees the permit at the answer: the provider
    /// had counted the request by then.
    #[test]
    fn an_answer_frees_the_permit_at_its_arrival() {
        let l =
            global(r#"{ kind = "fixed_window", permits = 10, window = "1s", scope = "global" }"#);
        let t0 = Instant::now();
        let shared = Arc::new(Shared::new("u", None));
        let hold = reserved(&shared, &l, t0);
        hold.sent(t0);
        hold.answered(t0, t0 + Duration::from_millis(3), Duration::from_millis(3));
        let at = AT + 3.0 * MS;
        assert_eq!(
            queued(&shared, &l),
            (vec![Some(at)], vec![("m1".into(), at)])
        );

        // An answer later than the margin changes nothing: the margin already covers it.
        let shared = Arc::new(Shared::new("u", None));
        let hold = reserved(&shared, &l, t0);
        hold.sent(t0);
        hold.answered(
            t0,
            t0 + Duration::from_millis(500),
            Duration::from_millis(500),
        );
        assert_eq!(
            queued(&shared, &l),
            (vec![], vec![("m1".into(), AT + 200.0 * MS)])
        );
    }

    /// A request that never went out gives its permit back: Redis forgets it, and so does
    /// this replica's list of its own admissions.
    #[test]
    fn an_unsent_request_is_forgotten() {
        let l =
            global(r#"{ kind = "sliding_window", permits = 10, window = "1s", scope = "global" }"#);
        let shared = Arc::new(Shared::new("u", None));
        reserved(&shared, &l, Instant::now()).unsent();
        assert_eq!(queued(&shared, &l), (vec![None], vec![]));
        assert_eq!(shared.describe()["pending_corrections"], 1);
    }

    /// This replica's own admissions, written back after an outage: a window keeps those
    /// whose latest arrival is inside it; a fixed window whose opening moves on starts
    /// empty; a GCRA keeps the instant its debt runs to.
    #[test]
    fn own_admissions_keep_what_still_counts() {
        let mut st = State::default();
        let sliding =
            global(r#"{ kind = "sliding_window", permits = 10, window = "1s", scope = "global" }"#);
        remember(&mut st, &sliding, "a", &Costs::ONE, AT, None);
        remember(&mut st, &sliding, "b", &Costs::ONE, AT + 500.0 * MS, None);
        remember(&mut st, &sliding, "c", &Costs::ONE, AT + 1100.0 * MS, None);
        let members: Vec<&str> = st.mine[&sliding.id]
            .entries
            .iter()
            .map(|e| e.0.as_str())
            .collect();
        assert_eq!(
            members,
            ["a", "b", "c"],
            "a's latest arrival (+200 ms) is inside c's window"
        );
        remember(&mut st, &sliding, "d", &Costs::ONE, AT + 1300.0 * MS, None);
        let members: Vec<&str> = st.mine[&sliding.id]
            .entries
            .iter()
            .map(|e| e.0.as_str())
            .collect();
        assert_eq!(members, ["b", "c", "d"], "a's window is over");

        let fixed =
            global(r#"{ kind = "fixed_window", permits = 10, window = "1s", scope = "global" }"#);
        remember(&mut st, &fixed, "a", &Costs::ONE, AT, Some(AT));
        remember(&mut st, &fixed, "b", &Costs::ONE, AT + 10.0 * MS, Some(AT));
        remember(
            &mut st,
            &fixed,
            "c",
            &Costs::ONE,
            AT + 400.0 * MS,
            Some(AT + 300.0 * MS),
        );
        assert_eq!(st.mine[&fixed.id].entries.len(), 1, "a new window opened");
        assert_eq!(st.mine[&fixed.id].opening, Some(AT + 300.0 * MS));

        let token = global(
            r#"{ kind = "token_bucket", rate = 10, per = "1s", burst = 2, scope = "global" }"#,
        );
        remember(&mut st, &token, "a", &Costs::ONE, AT, None);
        remember(&mut st, &token, "b", &Costs::ONE, AT, None);
        let margin = micros(token.margin);
        assert_eq!(
            st.mine[&token.id].debt_until,
            AT + margin + 2.0 * 100.0 * MS
        );
    }

    /// Each replica's share while Redis is away is its long-run share of the limit, never
    /// nothing: one request per `ceil(replicas / permits)` windows for a limit smaller
    /// than the replica count, a burst of at least 1.
    #[test]
    fn every_limit_keeps_a_share_for_every_replica() {
        let s = Duration::from_secs(1);
        let sliding = limit("kind = \"sliding_window\"\npermits = 12\nwindow = \"1s\"");
        assert_eq!(window(&share(&sliding, 3).unwrap()), (4, s));
        assert_eq!(window(&share(&sliding, 5).unwrap()), (2, s), "rounded down");
        let small = limit("kind = \"sliding_window\"\npermits = 2\nwindow = \"1s\"");
        assert_eq!(window(&share(&small, 3).unwrap()), (1, 2 * s));
        assert_eq!(window(&share(&small, 5).unwrap()), (1, 3 * s));
        let one = limit("kind = \"fixed_window\"\npermits = 1\nwindow = \"1m\"");
        let shared = share(&one, 2).unwrap();
        assert!(matches!(shared, Limit::SlidingWindow { .. }), "{shared:?}");
        assert_eq!(window(&shared), (1, Duration::from_secs(120)));
        let clock =
            limit("kind = \"fixed_window\"\npermits = 1\nwindow = \"1m\"\nalign = \"clock\"");
        let shared = share(&clock, 2).unwrap();
        assert!(
            matches!(
                shared,
                Limit::FixedWindow {
                    align: WindowAlign::Clock,
                    ..
                }
            ),
            "{shared:?}"
        );
        assert_eq!(window(&shared), (1, Duration::from_secs(120)));

        let bucket = limit("kind = \"token_bucket\"\nrate = 10\nper = \"1s\"\nburst = 1");
        let Limit::TokenBucket {
            rate, per, burst, ..
        } = share(&bucket, 2).unwrap()
        else {
            panic!("a bucket");
        };
        assert_eq!((rate.get(), per, burst.get()), (10, 2 * s, 1));
        let published = limit("kind = \"published\"\npermits = 10\nwindow = \"1s\"");
        let Limit::TokenBucket { burst, .. } = share(&published, 3).unwrap() else {
            panic!("published runs on a bucket");
        };
        assert_eq!(burst.get(), 1, "a burst of one, not nothing");
        let concurrency = limit("kind = \"concurrency\"\nmax = 4");
        assert!(share(&concurrency, 2).is_none());
    }
}
