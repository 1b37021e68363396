//! Connecting to one of a name's addresses, the way RFC 8305 (happy eyeballs v2) races
//! them: the addresses alternate between families, starting with the resolver's first;
//! each attempt gets a head start of [`ATTEMPT_DELAY`] before the next one begins (or
//! none, once it has failed), earlier attempts keep going, and the first connection made
//! wins. An address that swallows packets (an IPv6 route that goes nowhere) so costs a
//! quarter of a second, not the caller's whole timeout.
//!
//! Every caller bounds the whole race with its own timeout: the attempt's deadline for
//! plain and TLS requests, `attempt_timeout` for CONNECT.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

/// RFC 8305 §5 recommends 250 ms between attempts.
pub(super) const ATTEMPT_DELAY: Duration = Duration::from_millis(250);

type Attempt = Pin<Box<dyn Future<Output = io::Result<TcpStream>> + Send>>;

/// Connects to the first of `addrs` to answer, racing them as the module describes.
pub(crate) async fn connect(addrs: &[SocketAddr]) -> io::Result<TcpStream> {
    let order = interleave(addrs);
    let mut next = 0;
    let mut running: Vec<Attempt> = Vec::new();
    let mut last: Option<io::Error> = None;
    // Starts the next attempt at once (the first, or after one failed) when set.
    let mut now_due = true;
    let mut stagger = Box::pin(tokio::time::sleep(Duration::ZERO));
    let stream = std::future::poll_fn(|cx| {
        loop {
            if next < order.len() && (now_due || stagger.is_elapsed()) {
                let addr = order[next];
                next += 1;
                now_due = false;
                running.push(Box::pin(TcpStream::connect(addr)));
                stagger.as_mut().reset(Instant::now() + ATTEMPT_DELAY);
            }
            let mut i = 0;
            while i < running.len() {
                match running[i].as_mut().poll(cx) {
                    Poll::Ready(Ok(s)) => return Poll::Ready(Ok(s)),
                    Poll::Ready(Err(e)) => {
                        last = Some(e);
                        drop(running.swap_remove(i));
                        now_due = true;
                    }
                    Poll::Pending => i += 1,
                }
            }
            if next >= order.len() {
                if running.is_empty() {
                    return Poll::Ready(Err(last.take().unwrap_or_else(|| {
                        io::Error::new(io::ErrorKind::NotFound, "no address to connect to")
                    })));
                }
                return Poll::Pending;
            }
            // Registers the stagger's wake-up; elapsed meanwhile, start the next now.
            if now_due || stagger.as_mut().poll(cx).is_ready() {
                continue;
            }
            return Poll::Pending;
        }
    })
    .await?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// `addrs` with the families alternating, each family's addresses in the resolver's
/// order, the first address's family first (RFC 8305 §4).
pub(super) fn interleave(addrs: &[SocketAddr]) -> Vec<SocketAddr> {
    let Some(first) = addrs.first() else {
        return Vec::new();
    };
    let (mut same, mut other): (Vec<SocketAddr>, Vec<SocketAddr>) =
        addrs.iter().partition(|a| a.is_ipv6() == first.is_ipv6());
    same.reverse();
    other.reverse();
    let mut out = Vec::with_capacity(addrs.len());
    while let Some(a) = same.pop() {
        out.push(a);
        if let Some(b) = other.pop() {
            out.push(b);
        }
    }
    out.extend(other.into_iter().rev());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::{TcpListener, TcpSocket};

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn families_alternate_starting_with_the_first() {
        let got = interleave(&[a("[::1]:1"), a("[::1]:2"), a("[::1]:3"), a("127.0.0.1:4")]);
        assert_eq!(
            got,
            [a("[::1]:1"), a("127.0.0.1:4"), a("[::1]:2"), a("[::1]:3")]
        );
        let got = interleave(&[a("127.0.0.1:1"), a("[::1]:2"), a("127.0.0.2:3")]);
        assert_eq!(got, [a("127.0.0.1:1"), a("[::1]:2"), a("127.0.0.2:3")]);
        let got = interleave(&[a("127.0.0.1:1"), a("[::1]:2"), a("[::1]:3")]);
        assert_eq!(got, [a("127.0.0.1:1"), a("[::1]:2"), a("[::1]:3")]);
        assert!(interleave(&[]).is_empty());
    }

    /// A loopback address whose connects hang, like a route that drops packets: a
    /// listener with a backlog of one that never accepts, its queue filled first, so
    /// the kernel drops further SYNs. The returned sockets keep the queue full.
    async fn unanswering() -> (SocketAddr, TcpListener, Vec<TcpStream>) {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind(a("127.0.0.1:0")).unwrap();
        let listener = socket.listen(1).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut fill = Vec::new();
        // Connects that complete fill the queue; the first that does not shows it full.
        loop {
            match tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(addr)).await {
                Ok(Ok(s)) => fill.push(s),
                Ok(Err(e)) => panic!("{e}"),
                Err(_) => break,
            }
            assert!(fill.len() < 64, "the backlog never filled");
        }
        (addr, listener, fill)
    }

    #[tokio::test]
    async fn an_unanswering_address_costs_a_head_start_not_the_timeout() {
        let (dead, _l, _fill) = unanswering().await;
        let live = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let t = Instant::now();
        let s = tokio::time::timeout(
            Duration::from_secs(20),
            connect(&[dead, live.local_addr().unwrap()]),
        )
        .await
        .expect("the second address answers while the first still hangs")
        .unwrap();
        assert_eq!(s.peer_addr().unwrap(), live.local_addr().unwrap());
        assert!(t.elapsed() >= ATTEMPT_DELAY, "the first had its head start");
    }

    #[tokio::test]
    async fn a_refused_address_hands_over_at_once_and_the_last_error_is_kept() {
        // A port nobody listens on: refused at once.
        let refused = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let live = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = connect(&[refused, live.local_addr().unwrap()])
            .await
            .unwrap();
        assert_eq!(s.peer_addr().unwrap(), live.local_addr().unwrap());
        let e = connect(&[refused, refused]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
        let e = connect(&[]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    /// An earlier attempt keeps going after the next begins: the first address answers
    /// late (its queue drains after the next attempt has started, and the kernel sends
    /// its SYN again a second in), while the second never does.
    #[tokio::test]
    async fn an_earlier_attempt_that_answers_late_still_wins() {
        let (late, listener, fill) = unanswering().await;
        let (dead, _l, _fill) = unanswering().await;
        tokio::spawn(async move {
            tokio::time::sleep(ATTEMPT_DELAY * 2).await;
            drop(fill);
            // Accepting empties the queue for the retransmitted SYN.
            while let Ok((s, _)) = listener.accept().await {
                drop(s);
            }
        });
        let s = tokio::time::timeout(Duration::from_secs(20), connect(&[late, dead]))
            .await
            .expect("the first attempt connected")
            .unwrap();
        assert_eq!(s.peer_addr().unwrap(), late);
    }

    /// The race goes on while attempts hang; the caller's timeout ends it.
    #[tokio::test]
    async fn only_the_callers_timeout_ends_a_race_that_hangs() {
        let (dead, _l, _fill) = unanswering().await;
        let t = Instant::now();
        let r = tokio::time::timeout(Duration::from_millis(600), connect(&[dead, dead])).await;
        assert!(r.is_err(), "still connecting: {r:?}");
        assert!(t.elapsed() >= Duration::from_millis(600));
    }
}
