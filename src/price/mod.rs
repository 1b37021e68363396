//! What a request costs before it is sent, in each unit its family prices
//! (`[upstream.family.cost.<unit>]`): the client's own `sluice-cost`, else the family's
//! estimate (a constant, a header, JSON pointers into the body, or an LLM estimator in
//! [`llm`]). [`usage`] reads what the response says it really cost.

pub(crate) mod json;
pub(crate) mod llm;
mod read;
mod scan;
pub(crate) mod usage;

use read::{number, sum_pointers};

use http::HeaderMap;

use crate::config::cost::{Estimate, Price, Source};
use crate::limit::costs::Costs;

/// The header a client declares a request's cost with (`sluice-cost: tokens=1200,
/// points=3`); removed before the request goes upstream.
pub(crate) const DECLARED: &str = "sluice-cost";

/// Why a request cannot be priced, or may never be admitted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum Unpriced {
    /// More than `max`, or than a limit of the unit could ever hold.
    #[error("the request costs {cost} {unit}, more than {most} ({why})")]
    TooLarge {
        unit: String,
        cost: u64,
        most: u64,
        why: &'static str,
    },
    /// A body larger than sluice reads to price it, in a family without a fallback.
    #[error(
        "the request body is larger than sluice reads to price it in {unit} \
         (proxy.max_replay_body, {limit} bytes): declare the cost with sluice-cost, or give \
         [cost.{unit}] a fallback"
    )]
    BodyTooLarge { unit: String, limit: u64 },
    /// The estimate's source is missing or not a number, and the family has no fallback.
    #[error("cannot price the request in {unit}: {why}")]
    Unreadable { unit: String, why: String },
    #[error("sluice-cost: {0}")]
    Declared(String),
}

impl Unpriced {
    /// The local answer's `sluice-reason` and status (PRODUCT.md's table).
    pub(crate) fn answer(&self) -> (&'static str, u16) {
        match self {
            Unpriced::TooLarge { .. } | Unpriced::BodyTooLarge { .. } => ("cost_too_large", 413),
            Unpriced::Unreadable { .. } | Unpriced::Declared(_) => ("bad_request", 400),
        }
    }
}

/// The costs a client declared, by unit name.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Declared(Vec<(String, u64)>);

impl Declared {
    /// Every `sluice-cost` value of `headers`: `unit=n` pairs, comma-separated. A unit
    /// declared twice keeps its larger cost.
    pub(crate) fn read(headers: &HeaderMap) -> Result<Declared, Unpriced> {
        let mut out = Declared::default();
        for value in headers.get_all(DECLARED) {
            let text = value
                .to_str()
                .map_err(|_| Unpriced::Declared("not text".into()))?;
            for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                let parsed = item
                    .split_once('=')
                    .and_then(|(u, n)| Some((u.trim(), n.trim().parse::<u64>().ok()?)));
                let Some((unit, n)) = parsed else {
                    return Err(Unpriced::Declared(format!(
                        "{item:?} is not unit=cost (\"tokens=1200, points=3\")"
                    )));
                };
                match out.0.iter_mut().find(|(u, _)| u == unit) {
                    Some((_, had)) => *had = (*had).max(n),
                    None => out.0.push((unit.to_owned(), n)),
                }
            }
        }
        Ok(out)
    }

    fn get(&self, unit: &str) -> Option<u64> {
        self.0.iter().find(|(u, _)| u == unit).map(|(_, n)| *n)
    }
}

/// The request body as the estimates see it.
pub(crate) enum BodyView<'a> {
    /// Not read: no estimate needed it.
    Unread,
    Json(&'a json::Json<'a>),
    /// Read, but not JSON.
    NotJson,
    /// Longer than the `limit` sluice reads.
    TooLarge {
        limit: u64,
    },
}

/// Whether pricing needs the body: some unit is neither declared nor estimated without it.
pub(crate) fn needs_body(prices: &[Price], declared: &Declared) -> bool {
    prices.iter().any(|p| {
        declared.get(&p.unit).is_none()
            && matches!(
                p.estimate,
                Estimate::Llm(..) | Estimate::Read(Source::Json(_))
            )
    })
}

/// What the request costs: one request, and in each priced unit what the client
/// declared, else the estimate. `path`: the request's path (an embeddings request asks
/// for no output).
pub(crate) fn price(
    prices: &[Price],
    headers: &HeaderMap,
    declared: &Declared,
    body: &BodyView<'_>,
    path: &str,
) -> Result<Costs, Unpriced> {
    let mut costs = Costs::ONE;
    for p in prices {
        let cost = match declared.get(&p.unit) {
            Some(n) => n,
            None => estimate(p, headers, body, path)?,
        };
        if let Some(max) = p.max
            && cost > max
        {
            return Err(too_large(p, cost, max, "its max"));
        }
        if let Some(most) = p.ceiling
            && cost > most
        {
            return Err(too_large(
                p,
                cost,
                most,
                "the most a limit of the unit ever holds",
            ));
        }
        costs = costs.with(p.index, cost);
    }
    Ok(costs)
}

fn too_large(p: &Price, cost: u64, most: u64, why: &'static str) -> Unpriced {
    Unpriced::TooLarge {
        unit: p.unit.clone(),
        cost,
        most,
        why,
    }
}

fn estimate(
    p: &Price,
    headers: &HeaderMap,
    body: &BodyView<'_>,
    path: &str,
) -> Result<u64, Unpriced> {
    let unreadable = |why: String| match p.fallback {
        Some(n) => Ok(n),
        None => Err(Unpriced::Unreadable {
            unit: p.unit.clone(),
            why,
        }),
    };
    let json = match (&p.estimate, body) {
        (Estimate::Fixed(n), _) => return Ok(*n),
        (Estimate::Read(Source::Header(h)), _) => {
            return match headers.get(h).map(|v| number(v.to_str().unwrap_or(""))) {
                Some(Some(n)) => Ok(n),
                Some(None) => unreadable(format!("header {h} is not a whole number")),
                None => unreadable(format!("the request has no header {h}")),
            };
        }
        (_, BodyView::Json(v)) => *v,
        (_, BodyView::TooLarge { limit }) => {
            return match p.fallback {
                Some(n) => Ok(n),
                None => Err(Unpriced::BodyTooLarge {
                    unit: p.unit.clone(),
                    limit: *limit,
                }),
            };
        }
        (_, BodyView::NotJson | BodyView::Unread) => {
            return unreadable("the request body is not JSON".into());
        }
    };
    match &p.estimate {
        Estimate::Llm(llm, part) => Ok(llm::estimate(*llm, *part, json, path, p.default_output)),
        Estimate::Read(Source::Json(pointers)) => match sum_pointers(json, pointers) {
            Some(n) => Ok(n),
            None => unreadable(format!(
                "the body has no number at {}",
                pointers.join(" or ")
            )),
        },
        // Answered above.
        Estimate::Fixed(n) => Ok(*n),
        Estimate::Read(Source::Header(_)) => unreadable("no header".into()),
    }
}

#[cfg(test)]
mod tests;
