//! What one request costs, in each unit its upstream's limits count: requests (always
//! one), and the units its family prices (tokens, points, weights). A limit of unit `u`
//! takes `costs.of(u)` from its budget where a limit of requests takes one.

use std::ops::{Add, Sub};

/// Units an upstream's limits may count: requests and up to three priced ones.
pub(crate) const UNITS: usize = 4;
const _: () = assert!(UNITS == crate::config::cost::MAX_PRICED + 1);

/// The unit every limit counts unless it names another: index 0, costing 1 each.
pub(crate) const REQUESTS: u8 = 0;

/// A request's cost per unit index (0: requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Costs([u64; UNITS]);

impl Costs {
    /// One request, priced in no other unit.
    pub(crate) const ONE: Costs = Costs([1, 0, 0, 0]);

    /// The cost in unit `unit` (0 for a unit this request is not priced in).
    pub(crate) fn of(&self, unit: u8) -> u64 {
        self.0.get(usize::from(unit)).copied().unwrap_or(0)
    }

    /// The same request costing `n` in `unit` instead.
    pub(crate) fn with(mut self, unit: u8, n: u64) -> Costs {
        if let Some(slot) = self.0.get_mut(usize::from(unit)) {
            *slot = n;
        }
        self
    }
}

impl Add for Costs {
    type Output = Costs;

    fn add(self, o: Costs) -> Costs {
        let mut c = self;
        for (a, b) in c.0.iter_mut().zip(o.0) {
            *a = a.saturating_add(b);
        }
        c
    }
}

impl Sub for Costs {
    type Output = Costs;

    fn sub(self, o: Costs) -> Costs {
        let mut c = self;
        for (a, b) in c.0.iter_mut().zip(o.0) {
            *a = a.saturating_sub(b);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_costs_one_request_and_what_it_is_priced() {
        let c = Costs::ONE.with(1, 1200).with(2, 3);
        assert_eq!((c.of(0), c.of(1), c.of(2), c.of(3)), (1, 1200, 3, 0));
        assert_eq!(c.of(7), 0);
        let sum = c + Costs::ONE + c;
        assert_eq!((sum.of(0), sum.of(1)), (3, 2400));
        assert_eq!((sum - c).of(1), 1200);
        assert_eq!((Costs::ONE - c).of(1), 0, "never below nothing");
        assert_eq!(c.with(1, 10).of(1), 10);
    }
}
