//! Sent requests by the latest instant each may reach the provider, earliest first: what
//! the sliding kinds remember of each request once it has been sent, with its weight (the
//! units it costs: 1 for a limit that counts requests).

use std::collections::VecDeque;

use tokio::time::Instant;

use super::time::Id;

#[derive(Debug, Clone, Default)]
pub(super) struct Bounds {
    bounds: VecDeque<(Instant, Id, u64)>,
    /// The sum of the weights.
    weight: u64,
    /// How many weigh other than 1: with none (a limit that counts requests), a weight
    /// before an instant is a count, found by bisection.
    odd: usize,
}

impl Bounds {
    /// Keeps the order; new bounds are nearly always the latest.
    pub(super) fn insert(&mut self, at: Instant, id: Id, w: u64) {
        let i = self
            .bounds
            .iter()
            .rposition(|(t, _, _)| *t <= at)
            .map_or(0, |i| i + 1);
        self.bounds.insert(i, (at, id, w));
        self.weight += w;
        self.odd += usize::from(w != 1);
    }

    /// Admission `id` was answered at `now`: it reached the provider by then.
    pub(super) fn answered(&mut self, id: Id, now: Instant) {
        // Answers come soon after their sends: search from the latest.
        let Some(i) = self.bounds.iter().rposition(|(_, s, _)| *s == id) else {
            return;
        };
        if self.bounds[i].0 > now {
            let (_, _, w) = self.bounds.remove(i).unwrap_or((now, id, 0));
            self.weight -= w;
            self.odd -= usize::from(w != 1);
            self.insert(now, id, w);
        }
    }

    /// Admission `id` weighs `w` now (its true cost, learnt from its response); `false`
    /// when it is no longer remembered.
    pub(super) fn reweigh(&mut self, id: Id, w: u64) -> bool {
        let Some(b) = self.bounds.iter_mut().rev().find(|(_, s, _)| *s == id) else {
            return false;
        };
        self.weight = self.weight - b.2 + w;
        self.odd = self.odd - usize::from(b.2 != 1) + usize::from(w != 1);
        b.2 = w;
        true
    }

    /// Forgets the bounds for which `expired` holds, from the earliest on.
    pub(super) fn forget_while(&mut self, expired: impl Fn(Instant) -> bool) {
        while let Some((t, _, w)) = self.bounds.front()
            && expired(*t)
        {
            self.weight -= *w;
            self.odd -= usize::from(*w != 1);
            self.bounds.pop_front();
        }
    }

    /// The sum of the weights.
    pub(super) fn weight(&self) -> u64 {
        self.weight
    }

    pub(super) fn is_empty(&self) -> bool {
        self.bounds.is_empty()
    }

    /// The bound holding the `i`-th unit of weight (0-based, earliest first).
    pub(super) fn unit(&self, mut i: u64) -> Option<Instant> {
        if self.odd == 0 {
            return usize::try_from(i)
                .ok()
                .and_then(|i| self.bounds.get(i))
                .map(|b| b.0);
        }
        for (t, _, w) in &self.bounds {
            if i < *w {
                return Some(*t);
            }
            i -= w;
        }
        None
    }

    /// The weight of the bounds earlier than `t`.
    pub(super) fn before(&self, t: Instant) -> u64 {
        if self.odd == 0 {
            return self.bounds.partition_point(|(b, _, _)| *b < t) as u64;
        }
        self.bounds
            .iter()
            .take_while(|(b, _, _)| *b < t)
            .map(|(_, _, w)| w)
            .sum()
    }

    pub(super) fn latest(&self) -> Option<Instant> {
        self.bounds.back().map(|(t, _, _)| *t)
    }

    /// The bounds with their weights, earliest first.
    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = (Instant, u64)> + '_ {
        self.bounds.iter().map(|(t, _, w)| (*t, *w))
    }
}
