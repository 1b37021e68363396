//! How many workers to start and whether to pin them, from what the process was given
//! rather than from the machine: a sidecar with a 50m CPU request on a 64-core node
//! starts one worker, and leaves the scheduler free to move it off a core a neighbour
//! is saturating. Pinning pays only when the CPUs are the process's own (a cpuset
//! narrower than the machine, as Kubernetes' static CPU manager or `taskset` gives), or
//! when asked for on a host that runs nothing else.

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
}

impl Machine {
    pub fn probe() -> Machine {
        let allowed = allowed_cpus();
        let parallelism = std::thread::available_parallelism().map_or(1, |n| n.get());
        let online = online_cpus().unwrap_or(allowed.len()).max(allowed.len());
        Machine {
            online,
            allowed,
            parallelism,
        }
    }
}

/// `--pin-workers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// Pin when the process has a cpuset of its own with one CPU per worker.
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
    let own_cpuset = !allowed.is_empty() && allowed.len() < machine.online;
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
        Pin::Auto if own_cpuset && workers == allowed.len() => (
            Some(allowed.clone()),
            format!(
                "a cpuset of its own: {} of the machine's {} CPUs",
                allowed.len(),
                machine.online
            ),
        ),
        Pin::Auto if own_cpuset => (
            None,
            format!("{workers} workers for a cpuset of {} CPUs", allowed.len()),
        ),
        Pin::Auto => (
            None,
            format!(
                "the process may run on all {} CPUs of the machine",
                machine.online
            ),
        ),
    };
    Plan {
        workers,
        workers_why,
        cpus,
        pin_why,
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
    count_list(&text)
}

fn count_list(text: &str) -> Option<usize> {
    let mut n = 0;
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(online: usize, allowed: &[usize], parallelism: usize) -> Machine {
        Machine {
            online,
            allowed: allowed.to_vec(),
            parallelism,
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
        let cpuset = plan(&machine(16, &[4, 5], 2), None, None, Pin::Auto);
        assert_eq!(cpuset.workers, 2);
        assert_eq!(cpuset.cpus, Some(vec![4, 5]));
        assert!(
            cpuset.pin_why.contains("cpuset of its own"),
            "{}",
            cpuset.pin_why
        );
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
            plan(&machine(4, &[1, 2], 2), Some(3), None, Pin::Auto).cpus,
            None
        );
    }

    #[test]
    fn cpu_lists_are_counted() {
        assert_eq!(count_list("0-63\n"), Some(64));
        assert_eq!(count_list("0,2-5"), Some(5));
        assert_eq!(count_list("0"), Some(1));
        assert_eq!(count_list(""), None);
        assert_eq!(count_list("5-2"), None);
    }
}
