//! The monotonic clock as the request path reads it: on a worker, once per task poll.
//!
//! A proxied request needs the time at its start, its admission, the wait's end, the
//! attempt, the send, the answer, the connection's return and its access line, nearly all
//! of it in two polls of its task: one that reads the request and sends it on, one that
//! reads the answer and writes it back. A read is a vDSO call of about 20 ns on a 2-core
//! VM, and the readings of one poll differ by microseconds. So on a worker the first [`now`] of a task poll reads the clock and the rest
//! of that poll reuse the reading, as nginx (`ngx_time_update` once per event loop turn),
//! haproxy (`now_ms` once per poll loop) and Envoy (`approximateMonotonicTime`) do.
//!
//! What that changes: a reading is late by as much as the poll has run so far, on
//! loopback a few microseconds; a poll that streams a body may run longer before tokio's
//! cooperative budget makes it yield. Every use tolerates that: a limiter admits or
//! stamps a send as of the poll's start, which is earlier than the write it stands for
//! anyway, and a deadline set from it comes due that much earlier. Nothing that times
//! work done synchronously inside one poll uses this clock, nor does a loop that reads
//! the time, finds a deadline not yet due and arms a timer that may already have fired
//! (`upstream::timer::Deadline`, the limiter's driver): with one reading per poll it
//! would go round until tokio's budget ends the poll.
//!
//! Outside a task poll (between polls, on other threads, in tests' runtimes) [`now`]
//! reads the clock every time, so `tokio::time::pause` is honoured as before. The hooks
//! need tokio's unstable API (`--cfg tokio_unstable`, set by `.cargo/config.toml`); a
//! build without it reads the clock every time.

use std::cell::Cell;
use tokio::time::Instant;

#[derive(Clone, Copy)]
enum Reading {
    /// Not inside a task poll on a worker: every call reads the clock.
    Outside,
    /// Inside a task poll that has not read the clock yet.
    Due,
    /// Inside a task poll that read the clock at this instant.
    Read(Instant),
}

thread_local! {
    static READING: Cell<Reading> = const { Cell::new(Reading::Outside) };
}

/// The current instant: the reading this task poll already took, or a new one.
#[inline]
pub(crate) fn now() -> Instant {
    READING.with(|r| match r.get() {
        Reading::Read(at) => at,
        Reading::Due => {
            let at = Instant::now();
            r.set(Reading::Read(at));
            at
        }
        Reading::Outside => Instant::now(),
    })
}

/// Makes the worker runtime `rt` builds share one reading of the clock per task poll.
pub(crate) fn per_poll(rt: &mut tokio::runtime::Builder) {
    #[cfg(tokio_unstable)]
    rt.on_before_task_poll(|_| READING.set(Reading::Due))
        .on_after_task_poll(|_| READING.set(Reading::Outside));
    #[cfg(not(tokio_unstable))]
    let _ = rt;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn worker() -> tokio::runtime::Runtime {
        let mut rt = tokio::runtime::Builder::new_current_thread();
        rt.enable_all();
        per_poll(&mut rt);
        rt.build().unwrap()
    }

    #[cfg(tokio_unstable)]
    #[test]
    fn a_task_poll_reads_the_clock_once_and_the_next_poll_reads_it_again() {
        let rt = worker();
        let (first, again, next) = rt.block_on(async {
            tokio::spawn(async {
                let first = now();
                std::thread::sleep(Duration::from_millis(5));
                let again = now();
                // A poll of its own: the task yields and is polled again.
                tokio::task::yield_now().await;
                (first, again, now())
            })
            .await
            .unwrap()
        });
        assert_eq!(first, again, "one reading within a poll");
        assert!(
            next - first >= Duration::from_millis(5),
            "a new reading next poll"
        );
    }

    #[test]
    fn outside_a_task_poll_every_call_reads_the_clock() {
        let rt = worker();
        // `block_on`'s own future is not a task: it reads the clock each time.
        let (a, b) = rt.block_on(async {
            let a = now();
            std::thread::sleep(Duration::from_millis(5));
            (a, now())
        });
        assert!(b - a >= Duration::from_millis(5));
        // Nor does the thread keep the last poll's reading once the poll is over.
        rt.block_on(async { tokio::spawn(async { now() }).await.unwrap() });
        let before = now();
        std::thread::sleep(Duration::from_millis(5));
        assert!(now() - before >= Duration::from_millis(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_test_clock_is_honoured() {
        let t0 = now();
        tokio::time::sleep(Duration::from_secs(40)).await;
        assert_eq!(now() - t0, Duration::from_secs(40));
    }
}
