//! A provider as sluice's users meet one: it counts each request at its *arrival* in its
//! own application code, strictly, and refuses (429) beyond the limit. [`Counter`] is
//! that rule, pure, so the same counters judge the limiter's model check, the HTTP
//! [`Provider`] of the end-to-end tests and the benchmark (`examples/edges.rs` includes
//! this file). Besides the provider models sluice's own kinds are written from, it holds
//! the algorithms of deployed limiters, transcribed from their source with their
//! arithmetic (haproxy 2.6 `freq_ctr.c`, Python `limits` 5.8 `storage/memory.py`, nginx
//! `ngx_http_limit_req_module.c`), each reading time as its clock does. [`Relay`] stands between sluice and the
//! provider with the delays of a real network: a TLS handshake's round trips on each new
//! connection, and a little jitter on every request.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A provider's clock: the Unix time at `t0`, from which it reads every arrival.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    pub t0: Instant,
    pub unix0: Duration,
}

impl Clock {
    pub fn unix_ns(&self, at: Instant) -> u128 {
        (self.unix0 + at.saturating_duration_since(self.t0)).as_nanos()
    }

    /// Whole milliseconds, as haproxy and nginx read their clocks.
    pub fn ms(&self, at: Instant) -> u64 {
        (self.unix_ns(at) / 1_000_000) as u64
    }
}

#[derive(Debug, Clone)]
pub enum Counter {
    /// At most `permits` accepted arrivals in any `window` (a request exactly `window`
    /// after another no longer sees it).
    Sliding {
        permits: usize,
        window: Duration,
        accepted: VecDeque<Instant>,
    },
    /// `permits` per window; a window opens with the first arrival after the previous
    /// one closed ("300 per minute from the first request").
    Fixed {
        permits: u32,
        window: Duration,
        start: Option<Instant>,
        count: u32,
    },
    /// GCRA: `rate` per `per` with a burst of `burst`, in nanoseconds times `rate`.
    Token {
        rate: u128,
        per_ns: u128,
        burst: u128,
        base: Option<Instant>,
        tat: u128,
    },
    /// haproxy 2.6 `http-request deny if { sc_http_req_rate(0) gt permits }` after
    /// `track-sc0`: a `freq_ctr` over `period` ms whose windows start at the first
    /// arrival (again after two idle periods), the arrival counted before the check,
    /// refused ones too; the rate is `(prev × remain + curr × period) / period`,
    /// truncated, with `remain` the whole milliseconds left in the current period.
    Haproxy {
        permits: u64,
        period: u64,
        clock: Clock,
        tick: Option<u64>,
        curr: u64,
        prev: u64,
    },
    /// Python `limits` `SlidingWindowCounterRateLimiter` (memory storage): windows on the
    /// clock, `floor(prev × (window - elapsed) / window + curr) + 1 <= permits` to accept,
    /// accepted arrivals counted. `rounds_down: false`: the same counter comparing the
    /// estimate unrounded (`prev × (1 - elapsed/window) + curr + 1 <= permits`).
    Weighted {
        permits: u128,
        window_ns: u128,
        clock: Clock,
        rounds_down: bool,
        /// The current window's index, its count and the previous one's.
        index: u128,
        curr: u128,
        prev: u128,
    },
    /// A fixed window on the clock (windows at Unix multiples of the window, plus
    /// `offset`), every arrival counted as django-ratelimit does.
    Calendar {
        permits: u64,
        window_ns: u128,
        offset_ns: u128,
        clock: Clock,
        index: Option<u128>,
        count: u64,
    },
    /// nginx `limit_req`: the excess in thousandths of a request, drained by
    /// `rate × ms / 1000` (`rate` in thousandths per second, as nginx parses `r/s` and
    /// `r/m`), refused when it would exceed `burst × 1000`.
    Nginx {
        rate: u64,
        burst: u64,
        clock: Clock,
        excess: u64,
        last: Option<u64>,
    },
    /// Every one of these counters judges every arrival; accepted only if all accept.
    All(Vec<Counter>),
}

impl Counter {
    pub fn sliding(permits: u32, window: Duration) -> Counter {
        Counter::Sliding {
            permits: permits as usize,
            window,
            accepted: VecDeque::new(),
        }
    }

    pub fn fixed(permits: u32, window: Duration) -> Counter {
        Counter::Fixed {
            permits,
            window,
            start: None,
            count: 0,
        }
    }

    pub fn token(rate: u32, per: Duration, burst: u32) -> Counter {
        Counter::Token {
            rate: u128::from(rate),
            per_ns: per.as_nanos(),
            burst: u128::from(burst),
            base: None,
            tat: 0,
        }
    }

    pub fn haproxy(permits: u32, period: Duration, clock: Clock) -> Counter {
        Counter::Haproxy {
            permits: u64::from(permits),
            period: period.as_millis() as u64,
            clock,
            tick: None,
            curr: 0,
            prev: 0,
        }
    }

    pub fn weighted(permits: u32, window: Duration, clock: Clock, rounds_down: bool) -> Counter {
        Counter::Weighted {
            permits: u128::from(permits),
            window_ns: window.as_nanos(),
            clock,
            rounds_down,
            index: 0,
            curr: 0,
            prev: 0,
        }
    }

    pub fn calendar(permits: u32, window: Duration, offset: Duration, clock: Clock) -> Counter {
        Counter::Calendar {
            permits: u64::from(permits),
            window_ns: window.as_nanos(),
            offset_ns: offset.as_nanos(),
            clock,
            index: None,
            count: 0,
        }
    }

    /// `limit_req zone=... rate=<rate>r/s` (`per` one second) or `r/m` (one minute).
    pub fn nginx(rate: u32, per: Duration, burst: u32, clock: Clock) -> Counter {
        let rate = if per == Duration::from_secs(60) {
            u64::from(rate) * 1000 / 60
        } else {
            u64::from(rate) * 1000 * 1000 / per.as_millis() as u64
        };
        Counter::Nginx {
            rate,
            burst: u64::from(burst) * 1000,
            clock,
            excess: 0,
            last: None,
        }
    }

    /// What a clock window announces after the last arrival, as many APIs do: requests
    /// left, and the Unix second its window resets (`X-RateLimit-Remaining`,
    /// `X-RateLimit-Reset`). `None` for the others.
    pub fn announce(&self) -> Option<(u64, u64)> {
        let Counter::Calendar {
            permits,
            window_ns,
            offset_ns,
            index: Some(i),
            count,
            ..
        } = self
        else {
            return None;
        };
        let end_ns = (i + 1) * window_ns + offset_ns;
        Some((
            permits.saturating_sub(*count),
            end_ns.div_ceil(1_000_000_000) as u64,
        ))
    }

    /// A provider that reconciles (Anthropic's output tokens, Shopify's query cost): the
    /// request that arrived at `arrived` charged `was` then, and at `at`, when it ends,
    /// its true cost `is`. A moving window's entries at its arrival shrink or grow; a
    /// GCRA gives back (never beyond full) or charges the difference. The other counters
    /// keep what they counted.
    pub fn settle(&mut self, arrived: Instant, at: Instant, was: u64, is: u64) {
        match self {
            Counter::Sliding { accepted, .. } => {
                if is < was {
                    let mut drop = (was - is) as usize;
                    accepted.retain(|t| {
                        let gone = drop > 0 && *t == arrived;
                        drop -= usize::from(gone);
                        !gone
                    });
                } else {
                    let at = accepted.partition_point(|t| *t <= arrived);
                    for _ in 0..(is - was) {
                        accepted.insert(at, arrived);
                    }
                }
            }
            Counter::Token {
                rate,
                per_ns,
                base,
                tat,
                ..
            } => {
                let base = *base.get_or_insert(at);
                let t = (at - base).as_nanos() * *rate;
                if is >= was {
                    *tat += u128::from(is - was) * *per_ns;
                } else {
                    let back = u128::from(was - is) * *per_ns;
                    *tat = tat.saturating_sub(back).max(t.min(*tat));
                }
            }
            _ => {}
        }
    }

    /// Counts an arrival at `at` costing `n` units (arrivals in time order), as providers
    /// that count what a request costs do: Python `limits`' `hit(..., cost=n)` for the
    /// moving window, the fixed window and the sliding window counter (their checks, with
    /// `n` where one was), a GCRA whose `n` tokens must all conform, django-ratelimit's
    /// clock window counting `n`. haproxy's and nginx's counters count requests: for
    /// them `n` must be 1. `false` is a 429.
    pub fn arrive_n(&mut self, at: Instant, n: u64) -> bool {
        if n == 1 {
            return self.arrive(at);
        }
        match self {
            Counter::Sliding {
                permits,
                window,
                accepted,
            } => {
                while accepted.front().is_some_and(|t| *t + *window <= at) {
                    accepted.pop_front();
                }
                if accepted.len() + n as usize > *permits {
                    return false;
                }
                accepted.extend(std::iter::repeat_n(at, n as usize));
                true
            }
            Counter::Fixed {
                permits,
                window,
                start,
                count,
            } => {
                if start.is_none_or(|s| at >= s + *window) {
                    *start = Some(at);
                    *count = 0;
                }
                if u64::from(*count) + n > u64::from(*permits) {
                    return false;
                }
                *count += n as u32;
                true
            }
            Counter::Token {
                rate,
                per_ns,
                burst,
                base,
                tat,
            } => {
                let base = *base.get_or_insert(at);
                let t = (at - base).as_nanos() * *rate;
                let tau = (*burst - 1) * *per_ns;
                let n = u128::from(n);
                if (*tat).max(t) + (n - 1) * *per_ns > t + tau {
                    return false;
                }
                *tat = (*tat).max(t) + n * *per_ns;
                true
            }
            Counter::Weighted {
                permits,
                window_ns,
                clock,
                rounds_down,
                index,
                curr,
                prev,
            } => {
                let t = clock.unix_ns(at);
                let (i, x) = (t / *window_ns, t % *window_ns);
                if i != *index {
                    *prev = if i == *index + 1 { *curr } else { 0 };
                    *curr = 0;
                    *index = i;
                }
                let (w, n) = (*window_ns, u128::from(n));
                let ok = if *rounds_down {
                    *prev * (w - x) / w + *curr + n <= *permits
                } else {
                    *prev * (w - x) + *curr * w + n * w <= *permits * w
                };
                if ok {
                    *curr += n;
                }
                ok
            }
            Counter::Calendar {
                permits,
                window_ns,
                offset_ns,
                clock,
                index,
                count,
            } => {
                let i = (clock.unix_ns(at) - *offset_ns) / *window_ns;
                if *index != Some(i) {
                    *index = Some(i);
                    *count = 0;
                }
                *count += n;
                *count <= *permits
            }
            Counter::Haproxy { .. } | Counter::Nginx { .. } | Counter::All(_) => {
                panic!("this provider counts requests, not costs")
            }
        }
    }

    /// Counts an arrival at `at` (arrivals in time order); `false` is a 429.
    pub fn arrive(&mut self, at: Instant) -> bool {
        match self {
            Counter::Haproxy {
                permits,
                period,
                clock,
                tick,
                curr,
                prev,
            } => {
                let now = clock.ms(at);
                // update_freq_ctr_period: a fresh entry's tick is 0, far in the past.
                let t = tick.get_or_insert(0);
                if now - *t < *period {
                    *curr += 1;
                } else {
                    *prev = *curr;
                    *curr = 1;
                    *t += *period;
                    if now - *t >= *period {
                        *prev = 0;
                        *t = now;
                    }
                }
                // freq_ctr_total, then read_freq_ctr_period's division.
                let remain = *t + *period - now;
                let total = *prev * remain + *curr * *period;
                total / *period <= *permits
            }
            Counter::Weighted {
                permits,
                window_ns,
                clock,
                rounds_down,
                index,
                curr,
                prev,
            } => {
                let t = clock.unix_ns(at);
                let (i, x) = (t / *window_ns, t % *window_ns);
                if i != *index {
                    *prev = if i == *index + 1 { *curr } else { 0 };
                    *curr = 0;
                    *index = i;
                }
                let w = *window_ns;
                let ok = if *rounds_down {
                    *prev * (w - x) / w + *curr < *permits
                } else {
                    *prev * (w - x) + *curr * w + w <= *permits * w
                };
                if ok {
                    *curr += 1;
                }
                ok
            }
            Counter::Calendar {
                permits,
                window_ns,
                offset_ns,
                clock,
                index,
                count,
            } => {
                let i = (clock.unix_ns(at) - *offset_ns) / *window_ns;
                if *index != Some(i) {
                    *index = Some(i);
                    *count = 0;
                }
                *count += 1;
                *count <= *permits
            }
            Counter::Nginx {
                rate,
                burst,
                clock,
                excess,
                last,
            } => {
                let now = clock.ms(at);
                let Some(l) = *last else {
                    *last = Some(now);
                    return true;
                };
                let drained = *rate * (now - l) / 1000;
                let e = (*excess + 1000).saturating_sub(drained);
                if e > *burst {
                    return false;
                }
                *excess = e;
                *last = Some(now);
                true
            }
            Counter::All(all) => {
                // Every one counts the arrival, whatever the others said.
                let mut ok = true;
                for c in all {
                    ok &= c.arrive(at);
                }
                ok
            }
            Counter::Sliding {
                permits,
                window,
                accepted,
            } => {
                while accepted.front().is_some_and(|t| *t + *window <= at) {
                    accepted.pop_front();
                }
                if accepted.len() >= *permits {
                    return false;
                }
                accepted.push_back(at);
                true
            }
            Counter::Fixed {
                permits,
                window,
                start,
                count,
            } => {
                if start.is_none_or(|s| at >= s + *window) {
                    *start = Some(at);
                    *count = 0;
                }
                if *count >= *permits {
                    return false;
                }
                *count += 1;
                true
            }
            Counter::Token {
                rate,
                per_ns,
                burst,
                base,
                tat,
            } => {
                let base = *base.get_or_insert(at);
                let t = (at - base).as_nanos() * *rate;
                let tau = (*burst - 1) * *per_ns;
                if *tat > t + tau {
                    return false;
                }
                *tat = (*tat).max(t) + *per_ns;
                true
            }
        }
    }
}

/// Every request the provider saw: when it arrived in the application, and whether it
/// was accepted.
pub type Log = Arc<Mutex<Vec<(Instant, bool)>>>;

/// An HTTP/1.1 provider on 127.0.0.1, over TLS when given a server config.
pub struct Provider {
    pub addr: SocketAddr,
    pub log: Log,
    task: JoinHandle<()>,
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Provider {
    pub async fn start(counter: Counter, tls: Option<Arc<rustls::ServerConfig>>) -> Provider {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let log: Log = Arc::default();
        let counter = Arc::new(Mutex::new(counter));
        let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
        let l = log.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let _ = tcp.set_nodelay(true);
                let (counter, log, acceptor) = (counter.clone(), l.clone(), acceptor.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |_req| {
                        let at = Instant::now();
                        let (ok, announced) = {
                            let mut c = counter.lock();
                            (c.arrive(at), c.announce())
                        };
                        log.lock().push((at, ok));
                        let (status, body) = if ok {
                            (StatusCode::OK, "ok\n")
                        } else {
                            (
                                StatusCode::TOO_MANY_REQUESTS,
                                "{\"error\":\"rate_limited\"}\n",
                            )
                        };
                        let mut resp =
                            Response::new(Full::new(Bytes::from_static(body.as_bytes())));
                        *resp.status_mut() = status;
                        if let Some((remaining, reset)) = announced {
                            let h = resp.headers_mut();
                            h.insert("x-ratelimit-remaining", remaining.into());
                            h.insert("x-ratelimit-reset", reset.into());
                        }
                        async move { Ok::<_, Infallible>(resp) }
                    });
                    let http = hyper::server::conn::http1::Builder::new();
                    let _ = match acceptor {
                        Some(a) => match a.accept(tcp).await {
                            Ok(tls) => http.serve_connection(TokioIo::new(tls), svc).await,
                            Err(_) => return,
                        },
                        None => http.serve_connection(TokioIo::new(tcp), svc).await,
                    };
                });
            }
        });
        Provider { addr, log, task }
    }

    /// Requests accepted and refused so far.
    pub fn counts(&self) -> (usize, usize) {
        let log = self.log.lock();
        let ok = log.iter().filter(|e| e.1).count();
        (ok, log.len() - ok)
    }
}

/// The delays a [`Relay`] adds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Delays {
    /// Before the provider's first bytes on each new connection reach sluice: over TLS,
    /// the handshake's round trips, which sluice waits out before it sends the request.
    pub handshake: Duration,
    /// Before sluice's first bytes on each new connection reach the provider: a delay
    /// after sluice has sent, which it cannot see (a load balancer opening a backend
    /// connection, say).
    pub first_request: Duration,
    /// Up to this much, at random, on every chunk towards the provider (order kept).
    pub jitter: Duration,
}

/// A TCP relay on 127.0.0.1 in front of `to`, adding [`Delays`].
pub struct Relay {
    pub addr: SocketAddr,
    /// Connections opened through it.
    pub connections: Arc<std::sync::atomic::AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    pub async fn start(to: SocketAddr, delays: Delays) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = connections.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((down, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tokio::spawn(async move {
                    let Ok(up) = TcpStream::connect(to).await else {
                        return;
                    };
                    let _ = (down.set_nodelay(true), up.set_nodelay(true));
                    let (down_r, down_w) = down.into_split();
                    let (up_r, up_w) = up.into_split();
                    tokio::spawn(pipe(up_r, down_w, delays.handshake, Duration::ZERO));
                    pipe(down_r, up_w, delays.first_request, delays.jitter).await;
                });
            }
        });
        Relay {
            addr,
            connections,
            task,
        }
    }
}

/// Copies `from` to `to`, holding the first chunk back by `first` and every chunk by up
/// to `jitter` more, never reordering.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    first: Duration,
    jitter: Duration,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    });
    let mut buf = vec![0u8; 64 * 1024];
    let mut due = Instant::now();
    let mut first = Some(first);
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let extra = first.take().unwrap_or_default() + jitter.mul_f64(rand::random::<f64>());
        due = due.max(Instant::now() + extra);
        if tx.send((due, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}
