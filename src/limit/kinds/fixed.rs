//! A fixed window anchored at the first request, as the provider counts it: its window
//! opens when the first request *arrives* there, and the next one opens with the first
//! arrival after it has closed. sluice sees sends, not arrivals; an arrival lies between
//! the send and the send plus the margin (or the response, if that came first).
//!
//! So sluice keeps bounds rather than instants: the provider's current window opened
//! somewhere in `[lo, hi]` and closes `window` after that. A send whose arrival bound is
//! before `lo + window` surely lands in it. One sent close to the end may land in it or
//! after it (*unsure*): it is counted in this window and, in case it opened the next
//! one, kept aside; when this window is surely over, the unsure sends become the next
//! window with `lo`/`hi` covering each of them being its first arrival. If all of them
//! landed in the old window instead, the provider's next window opens with the first
//! send after the old one closed, so that send also bounds its opening (`anchor`).
//!
//! Requests admitted but not yet sent could land in any window from now on: each counts
//! in the current window and in any later one until it is sent.

use std::time::Duration;

use tokio::time::Instant;

use super::time::{Id, turns_after};

#[derive(Debug, Clone)]
pub(super) struct Fixed {
    permits: u64,
    window: Duration,
    pub(super) margin: Duration,
    pub(super) pending: u64,
    cur: Option<Window>,
    /// Sends of `cur` that may have arrived after it closed: (id, sent, latest arrival,
    /// weight).
    unsure: Vec<(Id, Instant, Instant, u64)>,
}

#[derive(Debug, Clone)]
struct Window {
    /// The earliest instant the provider may have opened it.
    lo: Instant,
    /// The latest instant it may have opened, as far as the unsure sends it came from tell.
    others: Instant,
    /// The send that opened it, or the first one after the unsure sends, with the
    /// latest instant it may have arrived (lowered by its response).
    anchor: Option<(Id, Instant)>,
    /// The weight of the sends that may have landed in it.
    sent: u64,
}

impl Window {
    /// The latest instant the provider may have opened it.
    fn hi(&self) -> Instant {
        self.anchor.map_or(self.others, |a| a.1.max(self.others))
    }
}

impl Fixed {
    pub(super) fn new(permits: u32, window: Duration, margin: Duration) -> Fixed {
        Fixed {
            permits: u64::from(permits),
            window,
            margin,
            pending: 0,
            cur: None,
            unsure: Vec::new(),
        }
    }

    /// This window under a changed spec (a reload), keeping what has been counted.
    pub(super) fn carry(mut self, new: Fixed, now: Instant) -> Fixed {
        self.permits = new.permits;
        self.window = new.window;
        self.margin = new.margin;
        self.refresh(now);
        self
    }

    /// Closes the current window once the provider's has surely closed, and opens the
    /// one its unsure sends may have started.
    pub(super) fn refresh(&mut self, now: Instant) {
        while let Some(c) = &self.cur {
            if now < c.hi() + self.window {
                return;
            }
            let lo = c.lo + self.window;
            self.cur = self.next_of(lo);
        }
    }

    /// The window the unsure sends may have opened (none if there are none), after a
    /// window that closed at the provider no earlier than `closed`.
    fn next_of(&mut self, closed: Instant) -> Option<Window> {
        let unsure = std::mem::take(&mut self.unsure);
        let first = unsure.iter().map(|u| u.1).min()?;
        let latest = unsure.iter().map(|u| u.2).max()?;
        Some(Window {
            lo: closed.max(first),
            others: latest,
            anchor: None,
            sent: unsure.iter().map(|u| u.3).sum(),
        })
    }

    fn counted(&self) -> u64 {
        self.cur.as_ref().map_or(0, |c| c.sent) + self.pending
    }

    pub(super) fn available(&self) -> u64 {
        self.permits.saturating_sub(self.counted())
    }

    pub(super) fn sent(&mut self, id: Id, w: u64, reserved: bool, now: Instant) {
        self.refresh(now);
        if reserved {
            self.pending = self.pending.saturating_sub(w);
        }
        let latest = now + self.margin;
        let Some(c) = &mut self.cur else {
            self.cur = Some(Window {
                lo: now,
                others: now,
                anchor: Some((id, latest)),
                sent: w,
            });
            return;
        };
        c.sent += w;
        // A window opened by unsure sends may instead open with the first send after
        // them (if they all landed in the window before): that one bounds it too.
        if c.anchor.is_none() {
            c.anchor = Some((id, latest));
        }
        if latest >= c.lo + self.window {
            self.unsure.push((id, now, latest, w));
        }
    }

    pub(super) fn answered(&mut self, id: Id, now: Instant) {
        let Some(c) = &mut self.cur else {
            return;
        };
        if let Some((anchor, latest)) = &mut c.anchor
            && *anchor == id
        {
            *latest = (*latest).min(now);
        }
        if let Some(i) = self.unsure.iter().position(|u| u.0 == id) {
            if now < c.lo + self.window {
                // Answered before the window could have closed: it arrived inside it.
                self.unsure.swap_remove(i);
            } else {
                self.unsure[i].2 = self.unsure[i].2.min(now);
            }
        }
    }

    /// Admission `id`, sent, weighs `w` now. More is charged to the window open now,
    /// whichever it landed in (counting more than the provider can only admit less); a
    /// refund is taken back only from a window known to hold the send (the one it opened,
    /// or one its unsure arrival may have opened), and otherwise the estimate stands.
    pub(super) fn reweigh(&mut self, id: Id, was: u64, w: u64, now: Instant) {
        self.refresh(now);
        let unsure = self.unsure.iter().position(|u| u.0 == id);
        if let Some(i) = unsure {
            self.unsure[i].3 = w;
        }
        let Some(c) = &mut self.cur else {
            return;
        };
        if w > was {
            c.sent += w - was;
        } else if unsure.is_some() || c.anchor.is_some_and(|a| a.0 == id) {
            c.sent = c.sent.saturating_sub(was - w);
        }
    }

    /// The earliest instant the `n`-th unit from now could be admitted, a lower bound:
    /// the pending units go first.
    pub(super) fn ready_at(&self, n: u64, now: Instant) -> Instant {
        let p = self.permits.max(1);
        let need = n.max(1) + self.pending;
        let (mut at, mut counted) = match &self.cur {
            None => (now, 0),
            Some(c) => {
                if need + c.sent <= p {
                    return now;
                }
                (c.hi() + self.window, self.unsure.iter().map(|u| u.3).sum())
            }
        };
        if counted > 0 {
            if need + counted <= p {
                return at;
            }
            let latest = self.unsure.iter().map(|u| u.2).max().unwrap_or(at);
            at = at.max(latest + self.window);
            counted = 0;
        }
        // Then fresh windows of `permits` each, at least `window` apart.
        turns_after(at, self.window, (need + counted - 1) / p)
    }

    pub(super) fn is_pristine(&self) -> bool {
        self.pending == 0 && self.cur.is_none() && self.unsure.is_empty()
    }
}
