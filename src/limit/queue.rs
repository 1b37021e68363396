//! A family's waiting requests. Without a tenant source, one FIFO. With one (`tenant =
//! "header:X-Tenant"`), tenants take turns: round-robin across the tenants that have
//! requests waiting, FIFO within each, which is deficit round-robin with every request
//! costing one. A tenant's bulk job then delays another tenant's request by one turn per
//! tenant waiting, not by its whole backlog. Pure: no clock, no locks.

use std::collections::{HashMap, VecDeque};

use tokio::time::Instant;

/// A tenant, as a keyed hash of its value (the value itself is never kept).
pub(crate) type Tenant = u64;

#[derive(Debug)]
pub(crate) struct Queued<W> {
    pub(crate) seq: u64,
    pub(crate) since: Instant,
    pub(crate) tenant: Option<Tenant>,
    /// What it costs: the head waits until every limit has room for all of it.
    pub(crate) costs: super::costs::Costs,
    pub(crate) waiter: W,
}

#[derive(Debug)]
pub(crate) enum Queue<W> {
    Fifo(VecDeque<Queued<W>>),
    /// `queue_order = "newest_first"`: the latest arrival is served first. Kept in
    /// arrival order, served from the back.
    Lifo(VecDeque<Queued<W>>),
    /// Boxed: most families queue FIFO, and every partition pays for the enum's size.
    Fair(Box<Fair<W>>),
}

#[derive(Debug)]
pub(crate) struct Fair<W> {
    /// Each waiting tenant's requests, in arrival order.
    tenants: HashMap<Option<Tenant>, VecDeque<Queued<W>>>,
    /// Whose turn comes next, front first: each tenant once.
    turns: VecDeque<Option<Tenant>>,
    len: usize,
}

impl<W> Queue<W> {
    /// Tenants in turns (`fair`), newest first (`newest`), or FIFO. Validation refuses
    /// both at once.
    pub(crate) fn new(fair: bool, newest: bool) -> Queue<W> {
        if newest && !fair {
            Queue::Lifo(VecDeque::new())
        } else if fair {
            Queue::Fair(Box::new(Fair {
                tenants: HashMap::new(),
                turns: VecDeque::new(),
                len: 0,
            }))
        } else {
            Queue::Fifo(VecDeque::new())
        }
    }

    pub(crate) fn is_fair(&self) -> bool {
        matches!(self, Queue::Fair(_))
    }

    pub(crate) fn is_newest_first(&self) -> bool {
        matches!(self, Queue::Lifo(_))
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Queue::Fifo(q) | Queue::Lifo(q) => q.len(),
            Queue::Fair(f) => f.len,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// When the longest-waiting request arrived.
    pub(crate) fn oldest(&self) -> Option<Instant> {
        match self {
            Queue::Fifo(q) | Queue::Lifo(q) => q.front().map(|w| w.since),
            Queue::Fair(f) => f
                .tenants
                .values()
                .filter_map(|q| q.front().map(|w| w.since))
                .min(),
        }
    }

    /// Tenants with requests waiting, in a queue that takes them in turns.
    pub(crate) fn tenants(&self) -> Option<usize> {
        match self {
            Queue::Fifo(_) | Queue::Lifo(_) => None,
            Queue::Fair(f) => Some(f.turns.len()),
        }
    }

    /// Requests of `tenant` waiting (all of them in a FIFO queue).
    pub(crate) fn len_of(&self, tenant: Option<Tenant>) -> usize {
        match self {
            Queue::Fifo(q) | Queue::Lifo(q) => q.len(),
            Queue::Fair(f) => f.tenants.get(&tenant).map_or(0, VecDeque::len),
        }
    }

    pub(crate) fn push_back(&mut self, q: Queued<W>) {
        match self {
            Queue::Fifo(fifo) | Queue::Lifo(fifo) => fifo.push_back(q),
            Queue::Fair(f) => {
                let Fair {
                    tenants,
                    turns,
                    len,
                } = &mut **f;
                let mine = tenants.entry(q.tenant).or_default();
                if mine.is_empty() {
                    turns.push_back(q.tenant);
                }
                mine.push_back(q);
                *len += 1;
            }
        }
    }

    /// The request whose turn is next.
    pub(crate) fn front(&self) -> Option<&Queued<W>> {
        match self {
            Queue::Fifo(q) => q.front(),
            Queue::Lifo(q) => q.back(),
            Queue::Fair(f) => f.tenants.get(f.turns.front()?)?.front(),
        }
    }

    /// Takes the request whose turn it was; its tenant's next turn comes after every
    /// other tenant's.
    pub(crate) fn pop_front(&mut self) -> Option<Queued<W>> {
        match self {
            Queue::Fifo(q) => q.pop_front(),
            Queue::Lifo(q) => q.pop_back(),
            Queue::Fair(f) => {
                let Fair {
                    tenants,
                    turns,
                    len,
                } = &mut **f;
                let t = turns.pop_front()?;
                let mine = tenants.get_mut(&t)?;
                let q = mine.pop_front();
                if mine.is_empty() {
                    tenants.remove(&t);
                } else {
                    turns.push_back(t);
                }
                *len -= usize::from(q.is_some());
                q
            }
        }
    }

    /// Removes request `seq` of `tenant`, if it still waits.
    pub(crate) fn remove(&mut self, seq: u64, tenant: Option<Tenant>) -> Option<Queued<W>> {
        let (q, now_empty) = match self {
            Queue::Fifo(q) | Queue::Lifo(q) => {
                let i = q.binary_search_by_key(&seq, |w| w.seq).ok()?;
                return q.remove(i);
            }
            Queue::Fair(f) => {
                let mine = f.tenants.get_mut(&tenant)?;
                let i = mine.binary_search_by_key(&seq, |w| w.seq).ok()?;
                let q = mine.remove(i)?;
                f.len -= 1;
                (q, mine.is_empty())
            }
        };
        if now_empty && let Queue::Fair(f) = self {
            f.tenants.remove(&tenant);
            f.turns.retain(|t| *t != tenant);
        }
        Some(q)
    }

    /// Everything waiting, in no particular order.
    pub(crate) fn drain(&mut self) -> Vec<Queued<W>> {
        let (fair, newest) = (self.is_fair(), self.is_newest_first());
        match std::mem::replace(self, Queue::new(fair, newest)) {
            Queue::Fifo(q) | Queue::Lifo(q) => q.into_iter().collect(),
            Queue::Fair(f) => f.tenants.into_values().flatten().collect(),
        }
    }

    /// The same requests, queued as `fair` and `newest` say (a reload that changed the
    /// family's tenant source or `queue_order`); arrival order is kept within each.
    pub(crate) fn refair(&mut self, fair: bool, newest: bool) {
        if std::mem::discriminant(self) == std::mem::discriminant(&Queue::<W>::new(fair, newest)) {
            return;
        }
        let mut all = self.drain();
        all.sort_by_key(|q| q.seq);
        *self = Queue::new(fair, newest);
        for q in all {
            self.push_back(q);
        }
    }

    /// Which turn (1 for the next) a request of `tenant` arriving now would be served at.
    pub(crate) fn turn_for_new(&self, tenant: Option<Tenant>) -> u64 {
        match self {
            Queue::Fifo(q) => q.len() as u64 + 1,
            // First, until someone newer comes.
            Queue::Lifo(_) => 1,
            Queue::Fair(_) => self.fair_turn(tenant, self.len_of(tenant)),
        }
    }

    /// Which turn the waiting request `seq` of `tenant` will be served at, if it waits.
    pub(crate) fn turn_of(&self, seq: u64, tenant: Option<Tenant>) -> Option<u64> {
        match self {
            Queue::Fifo(q) => q
                .binary_search_by_key(&seq, |w| w.seq)
                .ok()
                .map(|i| i as u64 + 1),
            Queue::Lifo(q) => q
                .binary_search_by_key(&seq, |w| w.seq)
                .ok()
                .map(|i| (q.len() - i) as u64),
            Queue::Fair(f) => {
                let k = f
                    .tenants
                    .get(&tenant)?
                    .binary_search_by_key(&seq, |w| w.seq)
                    .ok()?;
                Some(self.fair_turn(tenant, k))
            }
        }
    }

    /// What waiter `seq` (of `tenant`) costs, while it waits.
    pub(crate) fn costs_of(&self, seq: u64, tenant: Option<Tenant>) -> Option<super::costs::Costs> {
        match self {
            Queue::Fifo(q) | Queue::Lifo(q) => q
                .binary_search_by_key(&seq, |w| w.seq)
                .ok()
                .map(|i| q[i].costs),
            Queue::Fair(f) => {
                let list = f.tenants.get(&tenant)?;
                let k = list.binary_search_by_key(&seq, |w| w.seq).ok()?;
                Some(list[k].costs)
            }
        }
    }

    /// The turn of the `k`-th request (from 0) of `tenant`: every tenant serves one per
    /// round, in turn order, so it comes after `k` rounds of the others (or fewer, for
    /// tenants with fewer waiting), and after this round's turns of those before it.
    fn fair_turn(&self, tenant: Option<Tenant>, k: usize) -> u64 {
        let Queue::Fair(f) = self else {
            return k as u64 + 1;
        };
        let Fair { tenants, turns, .. } = &**f;
        let mut before = 0usize;
        let mut earlier_in_round = true;
        for t in turns {
            let n = tenants.get(t).map_or(0, VecDeque::len);
            if *t == tenant {
                earlier_in_round = false;
                before += k;
                continue;
            }
            before += n.min(k) + usize::from(earlier_in_round && n > k);
        }
        before as u64 + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn q(seq: u64, tenant: u64) -> Queued<()> {
        Queued {
            seq,
            since: Instant::now(),
            tenant: Some(tenant),
            costs: crate::limit::costs::Costs::ONE,
            waiter: (),
        }
    }

    fn serve_all(queue: &mut Queue<()>) -> Vec<(u64, u64)> {
        std::iter::from_fn(|| queue.pop_front())
            .map(|w| (w.tenant.unwrap(), w.seq))
            .collect()
    }

    #[test]
    fn tenants_take_turns_and_keep_their_own_order() {
        let mut queue = Queue::new(true, false);
        for seq in 0..5 {
            queue.push_back(q(seq, 1));
        }
        assert_eq!(
            queue.turn_for_new(Some(2)),
            2,
            "after the bulk tenant's next one"
        );
        queue.push_back(q(5, 2));
        queue.push_back(q(6, 3));
        queue.push_back(q(7, 2));
        assert_eq!(queue.turn_of(7, Some(2)), Some(5));
        assert_eq!(queue.turn_of(4, Some(1)), Some(8));
        assert_eq!(
            serve_all(&mut queue),
            [
                (1, 0),
                (2, 5),
                (3, 6),
                (1, 1),
                (2, 7),
                (1, 2),
                (1, 3),
                (1, 4)
            ]
        );
    }

    #[test]
    fn a_fifo_queue_serves_in_arrival_order_and_refair_keeps_it() {
        let mut queue = Queue::new(false, false);
        for (seq, t) in [(0, 1), (1, 1), (2, 2)] {
            queue.push_back(q(seq, t));
        }
        assert_eq!(queue.turn_for_new(Some(3)), 4);
        queue.refair(true, false);
        assert_eq!(serve_all(&mut queue), [(1, 0), (2, 2), (1, 1)]);
    }

    #[test]
    fn newest_first_serves_the_latest_arrival_and_says_so() {
        let mut queue = Queue::new(false, true);
        for seq in 0..4 {
            queue.push_back(q(seq, 1));
        }
        assert_eq!(queue.turn_for_new(None), 1);
        assert_eq!(queue.turn_of(3, None), Some(1));
        assert_eq!(queue.turn_of(0, None), Some(4));
        assert!(queue.remove(2, None).is_some());
        assert_eq!(queue.oldest(), Some(queue.remove(0, None).unwrap().since));
        queue.push_back(q(9, 1));
        assert_eq!(serve_all(&mut queue), [(1, 9), (1, 3), (1, 1)]);
        let mut queue = Queue::new(false, true);
        for seq in 0..3 {
            queue.push_back(q(seq, 1));
        }
        queue.refair(false, false);
        assert_eq!(
            serve_all(&mut queue),
            [(1, 0), (1, 1), (1, 2)],
            "oldest first again"
        );
    }

    proptest! {
        /// Against a model: whatever arrives and leaves, requests are served in turns
        /// across tenants and in arrival order within each; the turn predicted for each
        /// waiting request is the one it is served at; nothing is lost.
        #[test]
        fn turns_match_a_model(
            ops in proptest::collection::vec((0u8..3, 0u64..4, any::<prop::sample::Index>()), 1..200)
        ) {
            let mut queue = Queue::new(true, false);
            let mut seq = 0;
            let mut waiting: Vec<(u64, u64)> = Vec::new();
            for (op, tenant, pick) in ops {
                match op {
                    0 | 1 => {
                        queue.push_back(q(seq, tenant));
                        waiting.push((seq, tenant));
                        seq += 1;
                    }
                    _ if !waiting.is_empty() => {
                        let (s, t) = waiting.remove(pick.index(waiting.len()));
                        prop_assert!(queue.remove(s, Some(t)).is_some());
                    }
                    _ => {}
                }
                prop_assert_eq!(queue.len(), waiting.len());
            }
            let predicted: HashMap<u64, u64> = waiting
                .iter()
                .map(|(s, t)| (*s, queue.turn_of(*s, Some(*t)).unwrap()))
                .collect();
            let served = serve_all(&mut queue);
            prop_assert_eq!(served.len(), waiting.len());
            for (turn, (_, s)) in served.iter().enumerate() {
                prop_assert_eq!(predicted[s], turn as u64 + 1);
            }
            for t in 0..4 {
                let mine: Vec<u64> = served.iter().filter(|(x, _)| *x == t).map(|(_, s)| *s).collect();
                prop_assert!(mine.windows(2).all(|w| w[0] < w[1]));
            }
        }
    }
}
