//! One partition of one upstream, as a pure state machine: the upstream's limits, and per
//! family its limits, its FIFO queue and its pause. `dispatch` admits waiters at `now`;
//! nothing here sleeps or locks, so every rule is tested by stepping `now`.
//!
//! Admission rule: a family's head is *ready* when the family is not paused and every
//! family limit admits it now. Among ready heads the best (priority, then arrival) goes
//! first, if every upstream limit admits it too; it then takes all its permits at that one
//! instant. A family blocked on its own limits never holds up another family, and no
//! request holds a permit of one limit while it waits for another.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use super::kinds::LimitState;
use crate::config::{Limit, Priority};

/// What a family's bucket is made of, from the config.
#[derive(Debug, Clone)]
pub struct FamilySpec {
    pub name: String,
    pub priority: Priority,
    pub limits: Vec<Limit>,
    pub max_queue: u32,
    pub max_wait: Duration,
    /// Pays only the upstream's concurrency limits: the queue of CONNECT tunnels, which
    /// carry no visible requests for rate limits to count.
    pub concurrency_only: bool,
}

/// An upstream's limits and its families. The last family is the one for requests that
/// match no family: no limits of its own, the upstream's queue bounds.
#[derive(Debug, Clone)]
pub struct PartitionSpec {
    pub upstream_limits: Vec<Limit>,
    pub families: Vec<FamilySpec>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    QueueFull { retry_after: Duration },
    QueueTimeout { retry_after: Duration },
}

#[derive(Debug)]
pub struct Queued<W> {
    pub seq: u64,
    pub since: Instant,
    pub waiter: W,
}

#[derive(Debug)]
pub struct Admitted<W> {
    pub family: usize,
    pub seq: u64,
    pub since: Instant,
    pub at: Instant,
    pub waiter: W,
}

#[derive(Debug)]
pub struct FamilyBucket<W> {
    pub limits: Vec<LimitState>,
    pub priority: Priority,
    pub paused_until: Option<Instant>,
    pub queue: VecDeque<Queued<W>>,
    max_queue: usize,
    max_wait: Duration,
    holds_concurrency: bool,
    concurrency_only: bool,
}

#[derive(Debug)]
pub struct Bucket<W> {
    pub upstream: Vec<LimitState>,
    pub paused_until: Option<Instant>,
    pub families: Vec<FamilyBucket<W>>,
    next_seq: u64,
    waiting: usize,
}

/// The upstream limits a family pays: all of them, or only concurrency for tunnels.
fn paid(
    upstream: &mut [LimitState],
    concurrency_only: bool,
) -> impl Iterator<Item = &mut LimitState> {
    upstream
        .iter_mut()
        .filter(move |l| !concurrency_only || l.is_concurrency())
}

fn paused(until: Option<Instant>, now: Instant) -> bool {
    until.is_some_and(|t| now < t)
}

/// Whole seconds, rounded up, at least one: the form `Retry-After` takes.
pub fn retry_after(wait: Duration) -> Duration {
    Duration::from_secs(wait.as_secs() + u64::from(wait.subsec_nanos() > 0))
        .max(Duration::from_secs(1))
}

impl<W> Bucket<W> {
    pub fn new(spec: &PartitionSpec, now: Instant) -> Bucket<W> {
        let upstream: Vec<LimitState> = spec
            .upstream_limits
            .iter()
            .map(|l| LimitState::new(l, now))
            .collect();
        let upstream_conc = upstream.iter().any(LimitState::is_concurrency);
        let families = spec
            .families
            .iter()
            .map(|f| {
                let limits: Vec<LimitState> =
                    f.limits.iter().map(|l| LimitState::new(l, now)).collect();
                FamilyBucket {
                    holds_concurrency: upstream_conc
                        || limits.iter().any(LimitState::is_concurrency),
                    limits,
                    priority: f.priority,
                    paused_until: None,
                    queue: VecDeque::new(),
                    max_queue: f.max_queue as usize,
                    max_wait: f.max_wait,
                    concurrency_only: f.concurrency_only,
                }
            })
            .collect();
        Bucket {
            upstream,
            paused_until: None,
            families,
            next_seq: 0,
            waiting: 0,
        }
    }

    /// Requests queued in every family.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Whether an admission in `family` holds a permit until the response ends.
    pub fn holds_concurrency(&self, family: usize) -> bool {
        self.families[family].holds_concurrency
    }

    /// The earliest instant the `n`-th request of `family`'s queue could be admitted, if
    /// it can be known (a lower bound: other families may take upstream permits first).
    pub fn eta(&mut self, family: usize, n: u64, now: Instant) -> Option<Instant> {
        let f = &mut self.families[family];
        let mut at = now
            .max(f.paused_until.unwrap_or(now))
            .max(self.paused_until.unwrap_or(now));
        for l in f
            .limits
            .iter_mut()
            .chain(paid(&mut self.upstream, f.concurrency_only))
        {
            at = at.max(l.ready_at(n, now)?);
        }
        Some(at)
    }

    /// Bounds for a new arrival: a full queue, or a wait known to exceed `max_wait`.
    pub fn check(&mut self, family: usize, now: Instant) -> Result<(), Reject> {
        let ahead = self.families[family].queue.len();
        let eta = self.eta(family, ahead as u64 + 1, now);
        let f = &self.families[family];
        let hint = |eta: Option<Instant>| retry_after(eta.map_or(Duration::ZERO, |t| t - now));
        if ahead >= f.max_queue {
            return Err(Reject::QueueFull {
                retry_after: hint(eta),
            });
        }
        if let Some(t) = eta
            && t - now > f.max_wait
        {
            return Err(Reject::QueueTimeout {
                retry_after: hint(Some(t)),
            });
        }
        Ok(())
    }

    /// `Retry-After` for a waiter of `family` whose `max_wait` ran out at position `seq`.
    pub fn timeout_hint(&mut self, family: usize, seq: u64, now: Instant) -> Duration {
        let pos = self.families[family]
            .queue
            .iter()
            .position(|q| q.seq == seq)
            .unwrap_or(0);
        let eta = self.eta(family, pos as u64 + 1, now);
        retry_after(eta.map_or(Duration::ZERO, |t| t - now))
    }

    pub fn push(&mut self, family: usize, waiter: W, now: Instant) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.families[family].queue.push_back(Queued {
            seq,
            since: now,
            waiter,
        });
        self.waiting += 1;
        seq
    }

    /// Empties every queue (shutdown), returning each waiter with its family.
    pub fn take_all_waiters(&mut self) -> Vec<(usize, W)> {
        let mut out = Vec::with_capacity(self.waiting);
        for (i, f) in self.families.iter_mut().enumerate() {
            out.extend(f.queue.drain(..).map(|q| (i, q.waiter)));
        }
        self.waiting = 0;
        out
    }

    /// Removes a waiter that gave up; `None` if it is no longer queued (it was admitted).
    pub fn cancel(&mut self, family: usize, seq: u64) -> Option<Queued<W>> {
        let q = &mut self.families[family].queue;
        let i = q.binary_search_by_key(&seq, |w| w.seq).ok()?;
        self.waiting -= 1;
        q.remove(i)
    }

    /// Admits every waiter that can go at `now`, in order, into `out`.
    pub fn dispatch(&mut self, now: Instant, out: &mut Vec<Admitted<W>>) {
        if paused(self.paused_until, now) {
            return;
        }
        loop {
            let mut best: Option<(usize, (Priority, u64))> = None;
            for (i, f) in self.families.iter_mut().enumerate() {
                let Some(head) = f.queue.front() else {
                    continue;
                };
                if paused(f.paused_until, now) || !f.limits.iter_mut().all(|l| l.can_take(now)) {
                    continue;
                }
                let key = (f.priority, head.seq);
                if best.is_none_or(|(_, k)| key < k) {
                    best = Some((i, key));
                }
            }
            let Some((i, _)) = best else { return };
            let f = &mut self.families[i];
            if !paid(&mut self.upstream, f.concurrency_only).all(|l| l.can_take(now)) {
                return;
            }
            for l in f
                .limits
                .iter_mut()
                .chain(paid(&mut self.upstream, f.concurrency_only))
            {
                l.take(now);
            }
            let Some(q) = f.queue.pop_front() else { return };
            self.waiting -= 1;
            out.push(Admitted {
                family: i,
                seq: q.seq,
                since: q.since,
                at: now,
                waiter: q.waiter,
            });
        }
    }

    /// Gives back the permits of an admission at `at` that never reached its request.
    pub fn undo(&mut self, family: usize, at: Instant, now: Instant) {
        let f = &mut self.families[family];
        for l in f
            .limits
            .iter_mut()
            .chain(paid(&mut self.upstream, f.concurrency_only))
        {
            l.undo(at, now);
        }
    }

    /// A response of `family` ended: its concurrency permits come back.
    pub fn release(&mut self, family: usize) {
        for l in self.families[family]
            .limits
            .iter_mut()
            .chain(self.upstream.iter_mut())
        {
            l.release();
        }
    }

    /// Pauses one family (or, with `None`, the whole upstream) until `until`; a later
    /// pause never shortens an earlier one.
    pub fn pause(&mut self, family: Option<usize>, until: Instant) {
        let slot = match family {
            Some(f) => &mut self.families[f].paused_until,
            None => &mut self.paused_until,
        };
        *slot = Some(slot.map_or(until, |t| t.max(until)));
    }

    /// When the driver should look again: the earliest instant a waiting head could be
    /// admitted by time alone. `None` when only a release or a new event can help.
    pub fn next_wakeup(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for i in 0..self.families.len() {
            if self.families[i].queue.is_empty() {
                continue;
            }
            if let Some(t) = self.eta(i, 1, now) {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        next
    }

    /// Nothing queued, nothing held, every limit full, no pause: indistinguishable from a
    /// new bucket, so it can be dropped.
    pub fn is_idle(&mut self, now: Instant) -> bool {
        self.waiting == 0
            && !paused(self.paused_until, now)
            && self.upstream.iter_mut().all(|l| l.is_pristine(now))
            && self.families.iter_mut().all(|f| {
                !paused(f.paused_until, now) && f.limits.iter_mut().all(|l| l.is_pristine(now))
            })
    }
}

#[cfg(test)]
mod tests;
