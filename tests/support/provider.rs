//! A provider as sluice's users meet one: it counts each request at its *arrival* in its
//! own application code, strictly, and refuses (429) beyond the limit; refused requests
//! do not count. [`Counter`] is that rule, pure, so the same counters judge the limiter's
//! model check, the HTTP [`Provider`] of the end-to-end tests and the benchmark
//! (`examples/edges.rs` includes this file). [`Relay`] stands between sluice and the
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

    /// Counts an arrival at `at` (arrivals in time order); `false` is a 429.
    pub fn arrive(&mut self, at: Instant) -> bool {
        match self {
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
                        let ok = counter.lock().arrive(at);
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
