//! How many workers to start and whether to pin them, from what the process was given
//! rather than from the machine: a sidecar with a 50m CPU request on a 64-core node
//! starts one worker, and leaves the scheduler free to move it off a core a neighbour
//! is saturating. Pinning pays only when the CPUs are the process's own: an exclusive
//! cpuset (a cgroup partition, or the whole CPUs Kubernetes' static CPU manager gives a
//! Guaranteed container), or a host that runs nothing else when asked. A narrowed
//! affinity alone proves nothing: the static CPU manager's shared pool and `taskset`
//! narrow it too, and neighbours run on those CPUs.
//!
//! Also which worker a thread is ([`worker_index`]), for what is kept per worker.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

thread_local! {
    /// The index of the worker this thread is, `usize::MAX` on any other thread.
    static WORKER: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The most workers started at once in this process so far.
static MOST_WORKERS: AtomicUsize = AtomicUsize::new(0);

/// Called before `count` workers start.
pub(crate) fn starting_workers(count: usize) {
    MOST_WORKERS.fetch_max(count, Ordering::Relaxed);
}

/// Called on worker `i`'s thread, before it runs anything.
pub(crate) fn this_is_worker(i: usize) {
    WORKER.set(i);
}

/// Which worker the calling thread is, if it is one: the index of its slot in what is
/// kept per worker (see `upstream::pooled`).
pub(crate) fn worker_index() -> Option<usize> {
    let i = WORKER.get();
    (i != usize::MAX).then_some(i)
}

/// How many workers this process has started at once (at most): the slots to keep for
/// what is kept per worker. 0 before any started.
pub(crate) fn worker_slots() -> usize {
    MOST_WORKERS.load(Ordering::Relaxed)
}

/// What the process may use, read once at start.
#[derive(Debug, Clone)]
pub struct Machine {
    /// CPUs online in the machine.
    pub(crate) online: usize,
    /// The CPUs this process may run on (its affinity, which a cpuset narrows).
    pub(crate) allowed: Vec<usize>,
    /// `std::thread::available_parallelism`: the affinity, further bounded by a cgroup
    /// CPU quota when there is one.
    pub(crate) parallelism: usize,
    /// The CPUs of the process's cgroup cpuset, when it can be read.
    pub(crate) cpuset: Option<Vec<usize>>,
    /// The cgroup marks its cpuset exclusive: a v2 partition (`root`, `isolated`) or
    /// v1's `cpuset.cpu_exclusive`.
    pub(crate) exclusive_flag: bool,
}

impl Machine {
    pub fn probe() -> Machine {
        let allowed = allowed_cpus();
        let parallelism = std::thread::available_parallelism().map_or(1, |n| n.get());
        let online = online_cpus().unwrap_or(allowed.len()).max(allowed.len());
        let (cpuset, exclusive_flag) = cgroup_cpuset();
        Machine {
            online,
            allowed,
            parallelism,
            cpuset,
            exclusive_flag,
        }
    }

    /// Why the allowed CPUs are this process's own, if they can be shown to be: the
    /// cgroup says so, or the cpuset is what the static CPU manager gives a Guaranteed
    /// container (exactly its CPU request in whole CPUs, narrower than the machine, and
    /// the affinity is that cpuset rather than a `taskset` inside a wider one). The
    /// shared pool of such a node is narrowed too, but holds every other pod's
    /// containers and matches no whole-CPU request but by chance.
    fn exclusive(&self, cpu_request_millis: Option<u64>) -> Option<String> {
        let narrowed = !self.allowed.is_empty() && self.allowed.len() < self.online;
        if !narrowed || self.cpuset.as_deref() != Some(&self.allowed[..]) {
            return None;
        }
        let n = self.allowed.len();
        if self.exclusive_flag {
            return Some(format!(
                "an exclusive cpuset partition: {n} of the machine's {} CPUs",
                self.online
            ));
        }
        let whole = u64::try_from(n).ok()?.checked_mul(1000)?;
        (cpu_request_millis == Some(whole)).then(|| {
            format!(
                "a cpuset of its own: {n} of the machine's {} CPUs, its CPU request in \
                 whole CPUs (the static CPU manager's)",
                self.online
            )
        })
    }
}

/// `--pin-workers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// Pin when the process has an exclusive cpuset with one CPU per worker.
    Auto,
    /// Pin worker `i` to the `i`-th allowed CPU whenever there are enough of them.
    On,
    Off,
}

/// The decision, with the reasons the startup line gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub workers: usize,
    pub workers_why: String,
    /// The CPU each worker is to run on, when they are pinned.
    pub cpus: Option<Vec<usize>>,
    pub pin_why: String,
    /// The CPUs unpinned workers are kept apart on ([`Spread`]), when there are two
    /// workers or more and two CPUs or more to put them on.
    pub spread: Option<Vec<usize>>,
}

/// Decides the worker count (`workers` given, else one per CPU of the request in
/// millicores, else one per CPU the process may use) and the pinning.
pub fn plan(
    machine: &Machine,
    workers: Option<u16>,
    cpu_request_millis: Option<u64>,
    pin: Pin,
) -> Plan {
    let usable = machine.parallelism.max(1);
    let (workers, workers_why) = match (workers, cpu_request_millis) {
        (Some(n), _) => (usize::from(n).max(1), "set by --workers".to_string()),
        (None, Some(m)) if m > 0 => {
            let cores = usize::try_from(m.div_ceil(1000)).unwrap_or(usize::MAX);
            if cores > usable {
                (
                    usable,
                    format!("CPU request {m}m, capped at the {usable} CPUs the process may use"),
                )
            } else {
                (cores, format!("CPU request {m}m"))
            }
        }
        _ => (usable, usable_why(machine)),
    };
    let allowed = &machine.allowed;
    let narrowed = !allowed.is_empty() && allowed.len() < machine.online;
    let own = machine.exclusive(cpu_request_millis);
    let (cpus, pin_why) = match pin {
        Pin::Off => (None, "--pin-workers off".to_string()),
        Pin::On if workers <= allowed.len() => (
            Some(allowed[..workers].to_vec()),
            "--pin-workers on".to_string(),
        ),
        Pin::On => (
            None,
            format!(
                "--pin-workers on, but {workers} workers for {} CPUs",
                allowed.len()
            ),
        ),
        Pin::Auto => match own {
            Some(why) if workers == allowed.len() => (Some(allowed.clone()), why),
            Some(_) => (
                None,
                format!("{workers} workers for a cpuset of {} CPUs", allowed.len()),
            ),
            None if narrowed => (
                None,
                format!(
                    "{} of the machine's {} CPUs, not shown to be its own (a shared pool, \
                     or taskset): --pin-workers on pins anyway",
                    allowed.len(),
                    machine.online
                ),
            ),
            None => (
                None,
                format!(
                    "the process may run on all {} CPUs of the machine",
                    machine.online
                ),
            ),
        },
    };
    let spread = (cpus.is_none() && pin != Pin::Off && workers >= 2 && allowed.len() >= 2)
        .then(|| allowed.clone());
    Plan {
        workers,
        workers_why,
        cpus,
        pin_why,
        spread,
    }
}

fn usable_why(machine: &Machine) -> String {
    let allowed = machine.allowed.len();
    if machine.parallelism < allowed {
        format!(
            "cgroup CPU quota of {} CPUs (of {allowed} allowed)",
            machine.parallelism
        )
    } else if allowed < machine.online {
        format!(
            "cpuset of {allowed} of the machine's {} CPUs",
            machine.online
        )
    } else {
        format!("one per CPU of the machine ({})", machine.online)
    }
}

#[cfg(target_os = "linux")]
fn allowed_cpus() -> Vec<usize> {
    use rustix::thread::{CpuSet, sched_getaffinity};
    match sched_getaffinity(None) {
        Ok(set) => (0..CpuSet::MAX_CPU).filter(|&c| set.is_set(c)).collect(),
        Err(_) => Vec::new(),
    }
}

#[cfg(not(target_os = "linux"))]
fn allowed_cpus() -> Vec<usize> {
    Vec::new()
}

/// The machine's online CPUs, from sysfs ("0-63" or "0,2-5").
fn online_cpus() -> Option<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?;
    parse_list(&text).map(|cpus| cpus.len())
}

/// The cpuset of this process's cgroup, and whether the cgroup marks it exclusive.
/// cgroup v2 (`0::/path` in /proc/self/cgroup): `cpuset.cpus.effective` and
/// `cpuset.cpus.partition`; v1 (`N:cpuset:/path`): `cpuset.effective_cpus` and
/// `cpuset.cpu_exclusive`. In a container with its own cgroup namespace the path is `/`.
fn cgroup_cpuset() -> (Option<Vec<usize>>, bool) {
    let Ok(table) = std::fs::read_to_string("/proc/self/cgroup") else {
        return (None, false);
    };
    let read = |path: String| std::fs::read_to_string(path).ok();
    for line in table.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let path = path.trim_end_matches('/');
        if controllers.split(',').any(|c| c == "cpuset") {
            let dir = format!("/sys/fs/cgroup/cpuset{path}");
            let cpus = read(format!("{dir}/cpuset.effective_cpus"))
                .or_else(|| read(format!("{dir}/cpuset.cpus")))
                .and_then(|t| parse_list(&t));
            let exclusive =
                read(format!("{dir}/cpuset.cpu_exclusive")).is_some_and(|t| t.trim() == "1");
            return (cpus, exclusive);
        }
    }
    if let Some(path) = table.lines().find_map(|l| l.strip_prefix("0::")) {
        let dir = format!("/sys/fs/cgroup{}", path.trim_end_matches('/'));
        let cpus = read(format!("{dir}/cpuset.cpus.effective")).and_then(|t| parse_list(&t));
        let exclusive = read(format!("{dir}/cpuset.cpus.partition")).is_some_and(|t| {
            let kind = t.split_whitespace().next().unwrap_or("");
            kind == "root" || kind == "isolated"
        });
        return (cpus, exclusive);
    }
    (None, false)
}

/// A kernel CPU list ("0-63", "0,2-5") as the CPUs it names, in order.
fn parse_list(text: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if b < a || b - a > 1 << 16 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    (!cpus.is_empty()).then_some(cpus)
}

/// Keeps unpinned workers off one another's CPU. Two busy workers that the scheduler
/// puts on one CPU take turns for time slices while the other CPU runs the application
/// or a neighbour, and its load balancer, which sees as many tasks on each CPU, finds
/// nothing to fix: every connection of both workers waits for tens of milliseconds
/// (docs/BENCHMARKS.md, "The tail"). A worker that wakes to run tasks and finds a busy
/// worker on its CPU moves itself to a CPU no worker sits on, then gives the scheduler
/// back its whole affinity: unlike a pinned one, it can still be moved off a CPU a
/// neighbour saturates.
#[derive(Debug)]
pub(crate) struct Spread {
    allowed: Vec<usize>,
    /// Per worker: the CPU it last woke on, with `BUSY` set while it runs tasks. Only
    /// the worker writes its own seat.
    seats: Box<[AtomicU32]>,
}

const BUSY: u32 = 1 << 31;
/// A seat whose CPU is not known yet.
const NOWHERE: u32 = BUSY - 1;
/// A worker moves itself at most this often: when the scheduler keeps putting it back
/// (a wake-up pulls it to the CPU of the thread that woke it), this bounds the cost of
/// disagreeing to a few system calls per interval.
const MOVE_EVERY: Duration = Duration::from_millis(5);

thread_local! {
    static LAST_MOVE: Cell<Option<Instant>> = const { Cell::new(None) };
}

impl Spread {
    pub(crate) fn new(workers: usize, allowed: Vec<usize>) -> Arc<Spread> {
        Arc::new(Spread {
            allowed,
            seats: (0..workers).map(|_| AtomicU32::new(NOWHERE)).collect(),
        })
    }

    /// Worker `i` woke up to run tasks (the runtime's unpark hook).
    pub(crate) fn running(&self, i: usize) {
        let Some(seat) = self.seats.get(i) else {
            return;
        };
        let Some(cpu) = current_cpu() else {
            return;
        };
        seat.store(cpu | BUSY, Ordering::Relaxed);
        if !self.shared(i, cpu) {
            return;
        }
        let now = Instant::now();
        if LAST_MOVE
            .get()
            .is_some_and(|last| now.duration_since(last) < MOVE_EVERY)
        {
            return;
        }
        LAST_MOVE.set(Some(now));
        if move_off(|may| self.free_cpu(i, cpu, may)) {
            seat.store(current_cpu().unwrap_or(NOWHERE) | BUSY, Ordering::Relaxed);
        }
    }

    /// Worker `i` ran out of tasks (the runtime's park hook).
    pub(crate) fn resting(&self, i: usize) {
        if let Some(seat) = self.seats.get(i) {
            seat.store(seat.load(Ordering::Relaxed) & !BUSY, Ordering::Relaxed);
        }
    }

    /// Whether another worker is busy on `cpu`: runnable there, waiting for this one.
    fn shared(&self, i: usize, cpu: u32) -> bool {
        self.seats
            .iter()
            .enumerate()
            .any(|(j, s)| j != i && s.load(Ordering::Relaxed) == cpu | BUSY)
    }

    /// A CPU other than `cpu` that the thread `may` run on and no other worker last woke
    /// on, searched from a different place for each worker so that two movers do not
    /// pick the same one.
    fn free_cpu(&self, i: usize, cpu: u32, may: &dyn Fn(usize) -> bool) -> Option<u32> {
        let n = self.allowed.len();
        let start = i * n / self.seats.len().max(1);
        (0..n)
            .map(|k| self.allowed[(start + k) % n])
            .filter(|&c| may(c))
            .filter_map(|c| u32::try_from(c).ok())
            .find(|&c| {
                c != cpu
                    && self
                        .seats
                        .iter()
                        .enumerate()
                        .all(|(j, s)| j == i || s.load(Ordering::Relaxed) & !BUSY != c)
            })
    }
}

/// Asked at every wake-up of a worker. glibc (2.35 and later) reads the CPU from the
/// thread's rseq area, with no system call on any architecture; rustix asks the vDSO on
/// x86 and makes a system call on aarch64, whose vDSO has no `getcpu`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn current_cpu() -> Option<u32> {
    // SAFETY: no arguments and no memory of ours; -1 on failure.
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).ok().filter(|&c| c < NOWHERE)
}

#[cfg(all(target_os = "linux", not(target_env = "gnu")))]
fn current_cpu() -> Option<u32> {
    u32::try_from(rustix::thread::sched_getcpu())
        .ok()
        .filter(|&c| c < NOWHERE)
}

#[cfg(not(target_os = "linux"))]
fn current_cpu() -> Option<u32> {
    None
}

/// Moves the calling thread to the CPU `choose` picks among those its affinity allows
/// (the kernel migrates it before the call returns), then restores that affinity, so
/// that an operator's `taskset` or a cpuset change since the start is kept.
#[cfg(target_os = "linux")]
fn move_off(choose: impl FnOnce(&dyn Fn(usize) -> bool) -> Option<u32>) -> bool {
    use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};
    let Ok(before) = sched_getaffinity(None) else {
        return false;
    };
    let Some(cpu) = choose(&|c| c < CpuSet::MAX_CPU && before.is_set(c)) else {
        return false;
    };
    let mut only = CpuSet::new();
    only.set(cpu as usize);
    let moved = sched_setaffinity(None, &only).is_ok();
    if let Err(e) = sched_setaffinity(None, &before) {
        tracing::warn!(error = %e, "cannot give a worker its CPUs back; it stays on CPU {cpu}");
    }
    moved
}

#[cfg(not(target_os = "linux"))]
fn move_off(_: impl FnOnce(&dyn Fn(usize) -> bool) -> Option<u32>) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine whose affinity is its cgroup's cpuset, not marked exclusive.
    fn machine(online: usize, allowed: &[usize], parallelism: usize) -> Machine {
        Machine {
            online,
            allowed: allowed.to_vec(),
            parallelism,
            cpuset: Some(allowed.to_vec()),
            exclusive_flag: false,
        }
    }

    #[test]
    fn a_small_request_on_a_big_node_gets_one_unpinned_worker() {
        let all: Vec<usize> = (0..64).collect();
        let p = plan(&machine(64, &all, 64), None, Some(50), Pin::Auto);
        assert_eq!((p.workers, p.cpus.as_ref()), (1, None));
        assert_eq!(p.workers_why, "CPU request 50m");
        assert_eq!(
            p.pin_why,
            "the process may run on all 64 CPUs of the machine"
        );
    }

    #[test]
    fn the_request_rounds_up_and_is_capped_by_what_the_process_may_use() {
        let all: Vec<usize> = (0..8).collect();
        assert_eq!(
            plan(&machine(8, &all, 8), None, Some(1500), Pin::Auto).workers,
            2
        );
        let capped = plan(&machine(8, &all, 3), None, Some(6000), Pin::Auto);
        assert_eq!(capped.workers, 3);
        assert!(
            capped.workers_why.contains("capped"),
            "{}",
            capped.workers_why
        );
        // A pod without a request gets 0 from the downward API: as if none were given.
        assert_eq!(
            plan(&machine(8, &all, 8), None, Some(0), Pin::Auto).workers,
            8
        );
    }

    #[test]
    fn a_quota_or_a_cpuset_bounds_the_default_and_says_so() {
        let all: Vec<usize> = (0..16).collect();
        let quota = plan(&machine(16, &all, 2), None, None, Pin::Auto);
        assert_eq!((quota.workers, quota.cpus.as_ref()), (2, None));
        assert!(quota.workers_why.contains("quota"), "{}", quota.workers_why);
        // The static CPU manager's: a Guaranteed container's 2 whole CPUs.
        let cpuset = plan(&machine(16, &[4, 5], 2), None, Some(2000), Pin::Auto);
        assert_eq!(cpuset.workers, 2);
        assert_eq!(cpuset.cpus, Some(vec![4, 5]));
        assert!(
            cpuset.pin_why.contains("cpuset of its own"),
            "{}",
            cpuset.pin_why
        );
    }

    #[test]
    fn a_narrowed_affinity_is_pinned_only_when_shown_to_be_exclusive() {
        // The static CPU manager's shared pool: 60 of 64 CPUs, which every
        // non-Guaranteed container shares. Not exclusive for any request but one of
        // exactly 60 whole CPUs, which cannot be told from an exclusive cpuset.
        let pool: Vec<usize> = (4..64).collect();
        for request in [None, Some(50), Some(2000), Some(59_000)] {
            let p = plan(&machine(64, &pool, 60), Some(60), request, Pin::Auto);
            assert_eq!(p.cpus, None, "{request:?}");
            assert!(
                p.pin_why.contains("not shown to be its own"),
                "{}",
                p.pin_why
            );
        }
        // taskset inside a cgroup that has the whole machine.
        let mut taskset = machine(8, &[2, 3], 2);
        taskset.cpuset = Some((0..8).collect());
        assert_eq!(plan(&taskset, None, Some(2000), Pin::Auto).cpus, None);
        assert_eq!(
            plan(&taskset, None, Some(2000), Pin::On).cpus,
            Some(vec![2, 3]),
            "unless asked"
        );
        // A cpuset whose size is not the whole-CPU request: not the static manager's.
        assert_eq!(
            plan(&machine(16, &[4, 5, 6], 3), None, Some(2000), Pin::Auto).cpus,
            None
        );
        assert_eq!(
            plan(&machine(16, &[4, 5], 2), None, Some(1500), Pin::Auto).cpus,
            None
        );
        assert_eq!(
            plan(&machine(16, &[4, 5], 2), None, None, Pin::Auto).cpus,
            None
        );
        // A cgroup partition (v2 `root`/`isolated`, v1 cpu_exclusive) needs no request.
        let mut partition = machine(16, &[4, 5], 2);
        partition.exclusive_flag = true;
        let p = plan(&partition, None, None, Pin::Auto);
        assert_eq!(p.cpus, Some(vec![4, 5]));
        assert!(
            p.pin_why.contains("exclusive cpuset partition"),
            "{}",
            p.pin_why
        );
        // The whole machine is never "its own" without --pin-workers on.
        let mut whole = machine(4, &[0, 1, 2, 3], 4);
        whole.exclusive_flag = true;
        assert_eq!(plan(&whole, None, Some(4000), Pin::Auto).cpus, None);
    }

    #[test]
    fn the_whole_machine_is_pinned_only_when_asked() {
        let all: Vec<usize> = (0..2).collect();
        let m = machine(2, &all, 2);
        assert_eq!(plan(&m, None, None, Pin::Auto).cpus, None);
        assert_eq!(plan(&m, None, None, Pin::On).cpus, Some(vec![0, 1]));
        assert_eq!(plan(&m, Some(1), None, Pin::On).cpus, Some(vec![0]));
        assert_eq!(plan(&m, Some(3), None, Pin::On).cpus, None);
        assert_eq!(
            plan(&machine(4, &[1, 2], 2), None, None, Pin::Off).cpus,
            None
        );
        // A cpuset of its own, but not one CPU per worker.
        assert_eq!(
            plan(&machine(4, &[1, 2], 2), Some(3), Some(2000), Pin::Auto).cpus,
            None
        );
    }

    #[test]
    fn cpu_lists_are_read() {
        assert_eq!(parse_list("0-63\n").map(|c| c.len()), Some(64));
        assert_eq!(parse_list("0,2-5"), Some(vec![0, 2, 3, 4, 5]));
        assert_eq!(parse_list("0"), Some(vec![0]));
        assert_eq!(parse_list(""), None);
        assert_eq!(parse_list("5-2"), None);
        assert_eq!(parse_list("x"), None);
    }

    #[test]
    fn unpinned_workers_are_kept_apart_unless_told_off() {
        let all: Vec<usize> = (0..4).collect();
        let m = machine(4, &all, 4);
        assert_eq!(plan(&m, None, None, Pin::Auto).spread, Some(all.clone()));
        assert_eq!(plan(&m, Some(8), None, Pin::On).spread, Some(all.clone()));
        assert_eq!(plan(&m, None, None, Pin::On).spread, None, "pinned");
        assert_eq!(plan(&m, None, None, Pin::Off).spread, None);
        assert_eq!(
            plan(&m, Some(1), None, Pin::Auto).spread,
            None,
            "one worker"
        );
        assert_eq!(
            plan(&machine(4, &[2], 1), Some(2), None, Pin::Auto).spread,
            None,
            "one CPU"
        );
    }

    #[test]
    fn a_worker_on_a_busy_workers_cpu_picks_one_no_worker_is_on() {
        let busy_on = |cpu: u32| cpu | BUSY;
        let s = Spread::new(3, vec![0, 1, 2, 3]);
        s.seats[0].store(busy_on(1), Ordering::Relaxed);
        s.seats[1].store(2, Ordering::Relaxed);
        // Worker 2 woke on CPU 1, where worker 0 is busy; CPU 2 is worker 1's, though
        // idle; CPU 1 is its own.
        assert!(s.shared(2, 1));
        assert_eq!(s.free_cpu(2, 1, &|_| true), Some(3));
        // Only where its affinity lets it.
        assert_eq!(s.free_cpu(2, 1, &|c| c != 3), Some(0));
        // An idle worker's CPU is not shared.
        assert!(!s.shared(2, 2));
        // Every CPU taken: it stays.
        let full = Spread::new(2, vec![0, 1]);
        full.seats[0].store(busy_on(1), Ordering::Relaxed);
        assert_eq!(full.free_cpu(1, 1, &|_| true), Some(0));
        full.seats[0].store(busy_on(0), Ordering::Relaxed);
        assert_eq!(full.free_cpu(1, 0, &|_| true), Some(1));
        let tight = Spread::new(3, vec![0, 1]);
        tight.seats[0].store(busy_on(0), Ordering::Relaxed);
        tight.seats[1].store(busy_on(1), Ordering::Relaxed);
        assert_eq!(tight.free_cpu(2, 0, &|_| true), None);
    }

    /// The move itself, on this machine's CPUs: a thread that wakes on a CPU where
    /// another worker is busy ends up on another one, with its whole affinity back.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_worker_moves_itself_off_a_shared_cpu_and_keeps_its_affinity() {
        use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};
        std::thread::spawn(|| {
            let allowed = allowed_cpus();
            if allowed.len() < 2 {
                eprintln!("skipped: one CPU");
                return;
            }
            let here = allowed[0];
            let mut only = CpuSet::new();
            only.set(here);
            sched_setaffinity(None, &only).unwrap();
            assert_eq!(current_cpu(), u32::try_from(here).ok());
            let s = Spread::new(2, allowed.clone());
            s.seats[0].store(u32::try_from(here).unwrap() | BUSY, Ordering::Relaxed);
            // Pinned by the test, not by sluice: give it the CPUs back first, as an
            // unpinned worker has them.
            let mut all = CpuSet::new();
            allowed.iter().for_each(|&c| all.set(c));
            sched_setaffinity(None, &all).unwrap();
            s.running(1);
            assert!(LAST_MOVE.get().is_some(), "it found its CPU shared");
            // Where it went, as it recorded right after the move.
            let seat = s.seats[1].load(Ordering::Relaxed);
            assert_eq!(seat & BUSY, BUSY);
            let now = seat & !BUSY;
            assert_ne!(now, u32::try_from(here).unwrap());
            assert!(allowed.contains(&(now as usize)));
            let after = sched_getaffinity(None).unwrap();
            assert!(allowed.iter().all(|&c| after.is_set(c)));
            s.resting(1);
            assert_eq!(s.seats[1].load(Ordering::Relaxed), now);
        })
        .join()
        .unwrap();
    }
}
