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
    permits: u32,
    window: Duration,
    pub(super) margin: Duration,
    pub(super) pending: u32,
    cur: Option<Window>,
    /// Sends of `cur` that may have arrived after it closed: (id, sent, latest arrival).
    unsure: Vec<(Id, Instant, Instant)>,
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
    /// Sends that may have landed in it.
    sent: u32,
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
            permits,
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
            sent: unsure.len() as u32,
        })
    }

    fn counted(&self) -> u32 {
        self.cur.as_ref().map_or(0, |c| c.sent) + self.pending
    }

    pub(super) fn available(&self) -> u64 {
        u64::from(self.permits.saturating_sub(self.counted()))
    }

    pub(super) fn sent(&mut self, id: Id, reserved: bool, now: Instant) {
        self.refresh(now);
        if reserved {
            self.pending = self.pending.saturating_sub(1);
        }
        let latest = now + self.margin;
        let Some(c) = &mut self.cur else {
            self.cur = Some(Window {
                lo: now,
                others: now,
                anchor: Some((id, latest)),
                sent: 1,
            });
            return;
        };
        c.sent += 1;
        // A window opened by unsure sends may instead open with the first send after
        // them (if they all landed in the window before): that one bounds it too.
        if c.anchor.is_none() {
            c.anchor = Some((id, latest));
        }
        if latest >= c.lo + self.window {
            self.unsure.push((id, now, latest));
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

    /// The earliest instant the `n`-th request from now could be admitted, a lower bound:
    /// the pending requests go first.
    pub(super) fn ready_at(&self, n: u64, now: Instant) -> Instant {
        let p = u64::from(self.permits);
        let need = n.max(1) + u64::from(self.pending);
        let (mut at, mut counted) = match &self.cur {
            None => (now, 0),
            Some(c) => {
                if need + u64::from(c.sent) <= p {
                    return now;
                }
                (c.hi() + self.window, self.unsure.len() as u64)
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
