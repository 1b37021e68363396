//! The order of a busy worker's socket writes: while several other tasks wait to run on
//! the worker (`HOLD_FROM`), or other requests are already held back, a request waits
//! for the runtime's next look at its sockets before it is written, to its upstream or
//! back to its client. A busy worker so reads every connection that is ready, then writes
//! what it read in one run, as haproxy's event loop does.
//!
//! Why: on loopback a write wakes the reader at the far end, and a reader woken early
//! finds one request, answers it and sleeps again. Written in runs, a busy worker's
//! requests reach the upstream together and it answers them in one wake. At 256
//! connections this is 3–6% of the rate (docs/BENCHMARKS.md, "Reads before writes").
//!
//! A held request keeps what it holds (its limiter permits, its upstream connection)
//! while the worker runs the rest of its queue, looks at its sockets once and gives each
//! connection that look found ready one turn, no longer: tokio queues every yielded task
//! behind those. A request whose client goes away while held is dropped with its hold.
//!
//! The queue's length is one of tokio's unstable metrics, so `.cargo/config.toml` builds
//! with `--cfg tokio_unstable`. A build without it (a `RUSTFLAGS` from the environment
//! replaces the file's flags) writes every request at once, as it is read.

#[cfg(tokio_unstable)]
use std::cell::{Cell, RefCell};

#[cfg(tokio_unstable)]
thread_local! {
    /// The metrics of the current-thread runtime this thread drives, set by [`enroll`]:
    /// they hold the length of its queue of tasks ready to run.
    static QUEUE: RefCell<Option<tokio::runtime::RuntimeMetrics>> = const { RefCell::new(None) };
    /// Requests held back on this thread until the runtime's next look at its sockets.
    static HELD: Cell<u32> = const { Cell::new(0) };
}

/// Tasks queued behind a request that start a round of held writes. Holding costs the
/// request a second poll and the worker an extra look at its sockets (about 1.9k
/// instructions a held request under callgrind with two connections a worker, 14% of a
/// matched request when every one was held), repaid only when enough writes go together.
#[cfg(tokio_unstable)]
const HOLD_FROM: usize = 4;

/// Makes the calling thread's writes take their turn behind `rt`'s queue. Called on a
/// worker thread, before it drives `rt`, a current-thread runtime (whose one queue is
/// worker 0's); a thread that goes on to drive another runtime enrolls again.
pub(crate) fn enroll(rt: &tokio::runtime::Handle) {
    #[cfg(tokio_unstable)]
    QUEUE.with_borrow_mut(|q| *q = Some(rt.metrics()));
    #[cfg(not(tokio_unstable))]
    let _ = rt;
}

/// Called before a write: on an enrolled thread, waits while `HOLD_FROM` or more tasks
/// are queued or other requests held. tokio runs a yielded task after its next look at
/// the sockets, so the held writes go together, after every read the worker had ready.
/// Alone, or behind a few, a request writes at once.
pub(crate) async fn write_in_turn() {
    #[cfg(tokio_unstable)]
    if QUEUE.with_borrow(|q| {
        q.as_ref()
            .is_some_and(|m| HELD.get() > 0 || m.worker_local_queue_depth(0) >= HOLD_FROM)
    }) {
        let _held = Held::new();
        tokio::task::yield_now().await;
    }
}

/// One held request, counted while it lives: a request dropped while held (its client
/// went away) is no longer counted.
#[cfg(tokio_unstable)]
struct Held;

#[cfg(tokio_unstable)]
impl Held {
    fn new() -> Held {
        HELD.set(HELD.get().saturating_add(1));
        Held
    }
}

#[cfg(tokio_unstable)]
impl Drop for Held {
    fn drop(&mut self) {
        HELD.set(HELD.get().saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    /// The product's builds hold writes back; a test build without the flag that lets
    /// them fails here rather than skipping the tests below (see the module doc).
    #[cfg(not(tokio_unstable))]
    #[test]
    fn the_build_can_read_the_queue() {
        panic!(
            "built without --cfg tokio_unstable: is .cargo/config.toml there, and RUSTFLAGS unset?"
        );
    }

    #[cfg(tokio_unstable)]
    mod held {
        use super::super::*;
        use futures_util::FutureExt;
        use parking_lot::Mutex;
        use std::sync::Arc;

        fn runtime() -> tokio::runtime::Runtime {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            enroll(rt.handle());
            rt
        }

        /// Alone, or behind fewer than `HOLD_FROM` queued tasks, a request writes at once;
        /// behind `HOLD_FROM`, or with another request held, it waits; a held request
        /// dropped no longer holds the others back.
        #[test]
        fn a_request_waits_only_behind_others() {
            runtime().block_on(async {
                assert!(write_in_turn().now_or_never().is_some(), "alone");
                let few: Vec<_> = (1..HOLD_FROM).map(|_| tokio::spawn(async {})).collect();
                assert!(write_in_turn().now_or_never().is_some(), "a few queued");
                let more = tokio::spawn(async {});
                let mut first = Box::pin(write_in_turn());
                assert!((&mut first).now_or_never().is_none(), "HOLD_FROM queued");
                for t in few {
                    t.await.unwrap();
                }
                more.await.unwrap();
                assert!(
                    write_in_turn().now_or_never().is_none(),
                    "nothing queued, another request held"
                );
                drop(first);
                assert!(
                    write_in_turn().now_or_never().is_some(),
                    "the held one dropped"
                );
            });
        }

        /// A thread that drives a second runtime waits behind that runtime's queue.
        #[test]
        fn a_thread_follows_the_runtime_it_enrolled_last() {
            drop(runtime());
            a_request_waits_only_behind_others();
        }

        /// Connections ready together, more than `HOLD_FROM`: every one is read before any
        /// is written, the last ones too, queued behind fewer.
        #[test]
        fn a_busy_workers_writes_follow_its_reads() {
            const CONNS: usize = HOLD_FROM + 2;
            let seen = Arc::new(Mutex::new(Vec::new()));
            runtime().block_on(async {
                let conns: Vec<_> = (0..CONNS)
                    .map(|i| {
                        let seen = seen.clone();
                        tokio::spawn(async move {
                            seen.lock().push(format!("read {i}"));
                            write_in_turn().await;
                            seen.lock().push(format!("write {i}"));
                        })
                    })
                    .collect();
                for c in conns {
                    c.await.unwrap();
                }
            });
            let mut seen = seen.lock().clone();
            // tokio wakes yielded tasks in an order of its own.
            seen[CONNS..].sort();
            let want: Vec<String> = (0..CONNS)
                .map(|i| format!("read {i}"))
                .chain((0..CONNS).map(|i| format!("write {i}")))
                .collect();
            assert_eq!(seen, want);
        }
    }
}
