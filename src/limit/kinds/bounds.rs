//! Sent requests by the latest instant each may reach the provider, earliest first: what
//! the sliding kinds remember of each request once it has been sent.

use std::collections::VecDeque;

use tokio::time::Instant;

use super::time::Id;

#[derive(Debug, Clone, Default)]
pub(super) struct Bounds(VecDeque<(Instant, Id)>);

impl Bounds {
    /// Keeps the order; new bounds are nearly always the latest.
    pub(super) fn insert(&mut self, at: Instant, id: Id) {
        let i = self
            .0
            .iter()
            .rposition(|(t, _)| *t <= at)
            .map_or(0, |i| i + 1);
        self.0.insert(i, (at, id));
    }

    /// Admission `id` was answered at `now`: it reached the provider by then.
    pub(super) fn answered(&mut self, id: Id, now: Instant) {
        // Answers come soon after their sends: search from the latest.
        let Some(i) = self.0.iter().rposition(|(_, s)| *s == id) else {
            return;
        };
        if self.0[i].0 > now {
            self.0.remove(i);
            self.insert(now, id);
        }
    }

    /// Forgets the bounds for which `expired` holds, from the earliest on.
    pub(super) fn forget_while(&mut self, expired: impl Fn(Instant) -> bool) {
        while self.0.front().is_some_and(|(t, _)| expired(*t)) {
            self.0.pop_front();
        }
    }

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(super) fn get(&self, i: usize) -> Option<Instant> {
        self.0.get(i).map(|(t, _)| *t)
    }

    /// How many bounds are earlier than `t`.
    pub(super) fn before(&self, t: Instant) -> usize {
        self.0.partition_point(|(b, _)| *b < t)
    }

    pub(super) fn latest(&self) -> Option<Instant> {
        self.0.back().map(|(t, _)| *t)
    }

    /// The bounds, earliest first.
    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = Instant> + '_ {
        self.0.iter().map(|(t, _)| *t)
    }
}
