//! The admin views of the limiter: `/buckets` (every partition, or the busiest past a
//! thousand), and the summaries the status page and metrics read (learned paces, adaptive
//! shares, partitions).

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use super::kinds::LimitState;

use crate::config::Limit;
use crate::config::units::fmt_duration;

use super::Limiter;
use super::cell::Cell;
use super::plan::Plan;
use super::shared::{GlobalLimit, Store};

impl Limiter {
    /// By upstream name: the slowest pace a partition learned from the provider and how
    /// many partitions pace now (`learn = "headers"`), as the summary has it.
    pub(crate) fn learned_paces(&self) -> HashMap<Arc<str>, (f64, usize)> {
        self.registry.summary(Instant::now()).paces.clone()
    }

    /// By (upstream, family) name: the lowest share of its configured rate that an
    /// adaptive family's partition may send now (1 when none is slowed), as the summary
    /// has it.
    pub(crate) fn adaptive_shares(&self) -> HashMap<(Arc<str>, String), f64> {
        self.registry.summary(Instant::now()).shares.clone()
    }

    pub fn partitions(&self) -> usize {
        self.registry.len()
    }

    /// The buckets for `/buckets`: one entry for each partition's upstream limits and one
    /// per family, with available permits, queue depth and remaining pause. Every
    /// partition while they are few (up to [`super::registry::FRESH_UP_TO`]); beyond that the
    /// [`registry::KEPT`] with most requests waiting of each upstream, as of the last
    /// sweep. Also how many partitions are left out.
    pub(crate) fn snapshot(&self) -> (serde_json::Value, usize) {
        let now = Instant::now();
        let store = self.store();
        let all = self.registry.len();
        let cells: Vec<Arc<Cell>> = if all <= super::registry::FRESH_UP_TO {
            self.registry.cells()
        } else {
            let summary = self.registry.summary(now);
            summary
                .busiest
                .values()
                .flatten()
                .filter_map(Weak::upgrade)
                .collect()
        };
        let omitted = all.saturating_sub(cells.len());
        let mut out = Vec::new();
        for cell in cells {
            out.extend(cell_entries(&cell, now, store.as_ref()));
        }
        (serde_json::Value::Array(out), omitted)
    }

    /// For the status page, by upstream name: its `top` partitions with the most requests
    /// waiting (as `/buckets` describes them), and how many others it has.
    pub(crate) fn busiest(&self, top: usize) -> HashMap<Arc<str>, (Vec<serde_json::Value>, usize)> {
        let now = Instant::now();
        let store = self.store();
        let summary = self.registry.summary(now);
        summary
            .busiest
            .iter()
            .map(|(name, cells)| {
                let shown: Vec<serde_json::Value> = cells
                    .iter()
                    .filter_map(Weak::upgrade)
                    .take(top)
                    .map(|c| serde_json::Value::from(cell_entries(&c, now, store.as_ref())))
                    .collect();
                let live = summary.live.get(name).copied().unwrap_or(0);
                let others = live.saturating_sub(shown.len());
                (name.clone(), (shown, others))
            })
            .collect()
    }
}

/// One partition as `/buckets` shows it: an entry for its upstream's limits, then one
/// per family that has limits or waiters.
fn cell_entries(
    cell: &Arc<Cell>,
    now: Instant,
    store: Option<&Arc<dyn Store>>,
) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    let mut st = cell.lock();
    let st = &mut *st;
    let partition = cell
        .partition
        .map_or_else(|| "-".to_string(), |p| p.short());
    let b = &mut st.bucket;
    let paused = |t: Option<Instant>| t.filter(|t| *t > now).map(|t| (t - now).as_secs_f64());
    let spec = b.upstream_spec.clone();
    let mut entry = json!({
        "upstream": &*cell.name,
        "family": null,
        "partition": partition,
        "limits": limits_json(&spec, &mut b.upstream, now),
        "queue_depth": b.waiting(),
        "paused_for_seconds": paused(b.paused_until),
    });
    if let Some(l) = b.learned.as_ref().filter(|l| l.active(now))
        && let Some(o) = entry.as_object_mut()
    {
        o.insert(
            "learned".into(),
            json!({
                "source": l.announced.source,
                "announced_remaining": l.announced.remaining,
                "left": l.left,
                "resets_in_seconds": (l.reset - now).as_secs_f64(),
                "pace_per_second": l.rate(),
            }),
        );
    }
    let paces: Vec<serde_json::Value> = b
        .learned_units
        .iter()
        .flat_map(|u| u.iter())
        .zip(1u8..)
        .filter_map(|(l, i)| {
            let l = l.as_ref().filter(|l| l.active(now))?;
            Some(json!({
                "unit": l.announced.unit,
                "unit_index": i,
                "source": l.announced.source,
                "announced_remaining": l.announced.remaining,
                "left": l.left,
                "resets_in_seconds": (l.reset - now).as_secs_f64(),
                "pace_per_second": l.rate(),
            }))
        })
        .collect();
    if !paces.is_empty()
        && let Some(o) = entry.as_object_mut()
    {
        o.insert("learned_units".into(), paces.into());
    }
    if let Some(o) = entry.as_object_mut() {
        shared_json(cell, &st.plan, store, o);
    }
    out.push(entry);
    let ours = st.plan.family_index(None);
    let live = st.plan.spec.families.len();
    for (i, fb) in b.families.iter_mut().enumerate() {
        // Our own queues (no family, tunnels) are shown only while they hold some.
        if (ours..live).contains(&i) && fb.queue.is_empty() {
            continue;
        }
        let f = fb.spec.clone();
        let mut v = json!({
            "upstream": &*cell.name,
            "family": f.name,
            "partition": partition,
            "priority": f.priority,
            "limits": limits_json(&f.limits, &mut fb.limits, now),
            "queue_depth": fb.queue.len(),
            "oldest_wait_seconds": fb.queue.oldest().map(|t| (now - t).as_secs_f64()),
            "paused_for_seconds": paused(fb.paused_until),
        });
        if i >= live
            && let Some(o) = v.as_object_mut()
        {
            // Removed by a reload; its queued requests finish under these limits.
            o.insert("retired".into(), true.into());
        }
        if !f.units.is_empty()
            && let Some(o) = v.as_object_mut()
        {
            // What the waiting requests cost, in each unit the family prices.
            let cost: serde_json::Map<String, serde_json::Value> = f
                .units
                .iter()
                .map(|(i, u)| (u.to_string(), fb.queued.of(*i).into()))
                .collect();
            o.insert("queued_cost".into(), cost.into());
        }
        if let Some(n) = fb.queue.tenants()
            && let Some(o) = v.as_object_mut()
        {
            o.insert("tenants_waiting".into(), n.into());
        }
        if let Some(a) = &fb.aimd
            && let Some(o) = v.as_object_mut()
        {
            o.insert(
                "adaptive".into(),
                json!({
                    "rate_per_second": a.rate(),
                    "configured_per_second": a.configured(),
                }),
            );
        }
        out.push(v);
    }
    out
}

/// The partition's shared limits (the upstream's and its families'), how they are decided
/// now, and what this replica has of them; nothing when it pays none.
fn shared_json(
    cell: &Cell,
    plan: &Plan,
    store: Option<&Arc<dyn Store>>,
    o: &mut serde_json::Map<String, serde_json::Value>,
) {
    let mut shared: Vec<&Arc<GlobalLimit>> = Vec::new();
    for l in plan.global.iter().flat_map(|g| g.iter()) {
        if !shared.iter().any(|s| s.id == l.id) {
            shared.push(l);
        }
    }
    if shared.is_empty() {
        return;
    }
    let limits: Vec<serde_json::Value> = shared
        .iter()
        .map(|l| {
            let mut v = serde_json::to_value(&l.spec).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert("id".into(), l.id.to_string().into());
                o.insert("margin".into(), fmt_duration(l.margin).into());
            }
            v
        })
        .collect();
    o.insert("shared_limits".into(), limits.into());
    if let Some(c) = store {
        o.insert("cluster".into(), c.describe());
    }
    if let Some((_, sh)) = &*cell.shared.lock() {
        o.insert("this_replica".into(), sh.describe());
    }
}

fn limits_json(specs: &[Limit], states: &mut [LimitState], now: Instant) -> serde_json::Value {
    specs
        .iter()
        .zip(states.iter_mut())
        .map(|(spec, state)| {
            let mut v = serde_json::to_value(spec).unwrap_or(serde_json::Value::Null);
            if let Some(o) = v.as_object_mut() {
                o.insert("available".into(), state.available(now).into());
                if let Some(m) = state.margin() {
                    // The margin in force, written or default.
                    o.insert("margin".into(), fmt_duration(m).into());
                    // Admitted, still connecting: their permits have no return time yet.
                    o.insert("unsent".into(), state.unsent_count().into());
                }
                if let Some((next, slack)) = state.clock_edges(now) {
                    let next = Duration::from_millis(next.as_millis() as u64);
                    o.insert("next_edge_in".into(), fmt_duration(next).into());
                    let from = if slack.is_zero() {
                        "clock"
                    } else {
                        "announced reset"
                    };
                    o.insert("edges_from".into(), from.into());
                }
            }
            v
        })
        .collect()
}
