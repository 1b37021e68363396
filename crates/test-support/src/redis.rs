//! A real `redis-server` on a free loopback port, without persistence, stopped by PID:
//! killed and started again on the same port, frozen with SIGSTOP, flushed. One kept in a
//! `static`, which is never dropped, is started by [`Redis::start_for_process`] so that
//! it does not outlive the test binary.

use parking_lot::Mutex;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct Redis {
    pub port: u16,
    /// Behind a lock so that a test can kill and restart it while others use it.
    child: Mutex<Option<Child>>,
    /// TLS only, with this certificate and key.
    tls: Option<(String, String)>,
    /// Started through a shell that stops it when this process ends: `child` is the
    /// shell, so it cannot be signalled.
    for_process: bool,
    /// More arguments for `redis-server` (a role, a memory cap), the first may be a
    /// config file.
    extra: Vec<String>,
    /// The password it requires of clients, if any.
    auth: Option<String>,
}

impl Redis {
    /// Needs `redis-server` on the PATH (`scripts/test` installs it).
    pub fn start() -> Redis {
        Redis::launch(None, false)
    }

    /// Lives until the test process ends, for a `static` (never dropped, so `Drop` would
    /// never stop it). A shell starts the server and waits on a pipe from this process;
    /// when the process ends, however it ends, the pipe closes and the shell stops the
    /// server. Cannot be killed, frozen or restarted.
    pub fn start_for_process() -> Redis {
        Redis::launch(None, true)
    }

    /// Speaks only TLS (`rediss://`), presenting `cert` (PEM files); clients need no
    /// certificate of their own.
    pub fn start_tls(cert: &std::path::Path, key: &std::path::Path) -> Redis {
        let tls = (cert.display().to_string(), key.display().to_string());
        Redis::launch(Some(tls), false)
    }

    /// With more `redis-server` arguments (`--maxmemory 1mb`, say).
    pub fn start_with(extra: &[&str]) -> Redis {
        Redis::launch_on(super::free_port(), None, false, extra, None)
    }

    /// Requires `password` of every client (`requirepass`).
    pub fn start_with_password(password: &str) -> Redis {
        let extra = ["--requirepass", password];
        Redis::launch_on(super::free_port(), None, false, &extra, Some(password))
    }

    /// A Redis Cluster node, on a port whose cluster bus port (+10000) is free too, with
    /// its nodes file in `dir`. Not yet in a cluster: see `create_cluster`.
    pub fn start_cluster_node(dir: &std::path::Path) -> Redis {
        Redis::cluster_node(dir, None, None)
    }

    /// As `start_cluster_node`, speaking only TLS (`cert`, `key`, and `ca` to verify the
    /// other nodes on the cluster bus) and requiring `password` of clients and of the
    /// other nodes.
    pub fn start_cluster_node_tls(
        dir: &std::path::Path,
        (cert, key, ca): (&std::path::Path, &std::path::Path, &std::path::Path),
        password: &str,
    ) -> Redis {
        let tls = (cert.display().to_string(), key.display().to_string());
        let ca = ca.display().to_string();
        let extra = [
            "--tls-cluster",
            "yes",
            "--tls-replication",
            "yes",
            "--tls-ca-cert-file",
            &ca,
            "--requirepass",
            password,
            "--masterauth",
            password,
        ];
        Redis::cluster_node(dir, Some((tls, &extra)), Some(password))
    }

    fn cluster_node(
        dir: &std::path::Path,
        tls: Option<((String, String), &[&str])>,
        auth: Option<&str>,
    ) -> Redis {
        let port = loop {
            let p = super::free_port();
            if std::net::TcpListener::bind(("127.0.0.1", p + 10000)).is_ok() {
                break p;
            }
        };
        let nodes = dir.join(format!("nodes-{port}.conf"));
        let mut extra = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            nodes.to_str().unwrap(),
            "--cluster-node-timeout",
            "2000",
            // A replica syncs at once, not after the default 5 s wait for others.
            "--repl-diskless-sync-delay",
            "0",
            "--dir",
            dir.to_str().unwrap(),
        ];
        let tls = tls.map(|(files, more)| {
            extra.extend_from_slice(more);
            files
        });
        Redis::launch_on(port, tls, false, &extra, auth)
    }

    /// A Sentinel watching `primary` as `mymaster` (a quorum of one, down after 1 s),
    /// its config file in `dir` (Sentinel rewrites it).
    pub fn start_sentinel(dir: &std::path::Path, primary: &Redis) -> Redis {
        Redis::start_sentinel_with_auth(dir, primary, None)
    }

    /// As `start_sentinel`, requiring `password` of its own clients when given, and
    /// speaking to the primary with the password the primary requires.
    pub fn start_sentinel_with_auth(
        dir: &std::path::Path,
        primary: &Redis,
        password: Option<&str>,
    ) -> Redis {
        let port = super::free_port();
        let conf = dir.join(format!("sentinel-{port}.conf"));
        let mut text = format!(
            "port {port}\nbind 127.0.0.1\ndir {}\n\
             sentinel monitor mymaster 127.0.0.1 {} 1\n\
             sentinel down-after-milliseconds mymaster 1000\n\
             sentinel failover-timeout mymaster 4000\n\
             sentinel parallel-syncs mymaster 1\n",
            dir.display(),
            primary.port
        );
        if let Some(p) = &primary.auth {
            text.push_str(&format!("sentinel auth-pass mymaster {p}\n"));
        }
        if let Some(p) = password {
            text.push_str(&format!("requirepass {p}\n"));
        }
        std::fs::write(&conf, text).unwrap();
        let args = [conf.to_str().unwrap(), "--sentinel"];
        Redis::launch_on(port, None, false, &args, password)
    }

    fn launch(tls: Option<(String, String)>, for_process: bool) -> Redis {
        Redis::launch_on(super::free_port(), tls, for_process, &[], None)
    }

    fn launch_on(
        port: u16,
        tls: Option<(String, String)>,
        for_process: bool,
        extra: &[&str],
        auth: Option<&str>,
    ) -> Redis {
        let r = Redis {
            port,
            child: Mutex::new(None),
            tls,
            for_process,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            auth: auth.map(str::to_string),
        };
        r.spawn();
        r
    }

    fn sentinel(&self) -> bool {
        self.extra.iter().any(|a| a == "--sentinel")
    }

    fn spawn(&self) {
        let mut cmd = if self.for_process {
            let mut sh = Command::new("sh");
            // The pipe stays open as long as `child` holds it: until the process ends.
            sh.args([
                "-c",
                "redis-server \"$@\" </dev/null & r=$!; read -r _ ; kill $r; wait $r",
                "sh",
            ])
            .stdin(Stdio::piped());
            sh
        } else {
            Command::new("redis-server")
        };
        // A config file comes first.
        if self.sentinel() {
            cmd.args(&self.extra);
        }
        match &self.tls {
            None => cmd.args(["--port", &self.port.to_string()]),
            Some((cert, key)) => cmd.args([
                "--port",
                "0",
                "--tls-port",
                &self.port.to_string(),
                "--tls-cert-file",
                cert,
                "--tls-key-file",
                key,
                "--tls-auth-clients",
                "no",
            ]),
        };
        if !self.sentinel() {
            // A replica's full sync writes the primary's RDB to disk even without
            // `save`: in the temporary directory, never in the repository.
            let file = format!("dump-{}.rdb", self.port);
            let dir = std::env::temp_dir();
            cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args([
                    "--dir",
                    dir.to_str().unwrap_or("/tmp"),
                    "--dbfilename",
                    &file,
                ])
                .args(&self.extra);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (scripts/test installs it)");
        *self.child.lock() = Some(child);
        // Ready when it answers.
        for _ in 0..200 {
            if self.try_cmd(&["PING"]).is_ok_and(|r| r.contains("PONG")) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("redis-server on port {} did not start", self.port);
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/0", self.port)
    }

    fn pid(&self) -> Option<u32> {
        self.child.lock().as_ref().map(Child::id)
    }

    fn signal(&self, sig: &str) {
        assert!(
            !self.for_process,
            "a process-long redis-server is not signalled"
        );
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill")
                .args([&format!("-{sig}"), &pid.to_string()])
                .status();
        }
    }

    /// SIGKILL: gone, with everything it held.
    pub fn kill(&self) {
        self.signal("KILL");
        let child = self.child.lock().take();
        if let Some(mut c) = child {
            let _ = c.wait();
        }
    }

    /// Started again, empty, on the same port.
    pub fn restart(&self) {
        self.spawn();
    }

    /// SIGSTOP: connections stay open and calls hang.
    pub fn freeze(&self) {
        self.signal("STOP");
    }

    pub fn thaw(&self) {
        self.signal("CONT");
    }

    /// A command through redis-cli; its output.
    pub fn cmd(&self, args: &[&str]) -> String {
        self.try_cmd(args).expect("redis-cli runs")
    }

    fn try_cmd(&self, args: &[&str]) -> std::io::Result<String> {
        let mut cmd = Command::new("redis-cli");
        cmd.args(["-p", &self.port.to_string()]);
        if self.tls.is_some() {
            cmd.args(["--tls", "--insecure"]);
        }
        if let Some(p) = &self.auth {
            cmd.args(["-a", p, "--no-auth-warning"]);
        }
        let out = cmd.args(args).output()?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// How many times a command ran, from `INFO commandstats` (`evalsha`, `eval`).
    pub fn calls(&self, command: &str) -> u64 {
        self.stat(command, "calls")
    }

    /// How many times a command reached this server at all: run (failed or not), or
    /// rejected before it ran (`READONLY`, `OOM`, ...).
    pub fn attempts(&self, command: &str) -> u64 {
        self.stat(command, "calls") + self.stat(command, "rejected_calls")
    }

    fn stat(&self, command: &str, field: &str) -> u64 {
        let info = self.cmd(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{command}:");
        let Some(fields) = info.lines().find_map(|l| l.trim().strip_prefix(&prefix)) else {
            return 0;
        };
        fields
            .split(',')
            .find_map(|kv| kv.strip_prefix(&format!("{field}=")))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if self.for_process {
            // The shell reads the end of its stdin and stops the server.
            drop(self.child.lock().take());
            return;
        }
        self.thaw();
        self.kill();
    }
}
