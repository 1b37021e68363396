//! A real `redis-server` on a free loopback port, without persistence, stopped by PID:
//! killed and started again on the same port, frozen with SIGSTOP, flushed.

use parking_lot::Mutex;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct Redis {
    pub port: u16,
    /// Behind a lock so that a test can kill and restart it while others use it.
    child: Mutex<Option<Child>>,
    /// TLS only, with this certificate and key.
    tls: Option<(String, String)>,
}

impl Redis {
    /// Needs `redis-server` on the PATH (`scripts/test` installs it).
    pub fn start() -> Redis {
        let port = super::free_port();
        let r = Redis {
            port,
            child: Mutex::new(None),
            tls: None,
        };
        r.spawn();
        r
    }

    /// Speaks only TLS (`rediss://`), presenting `cert` (PEM files); clients need no
    /// certificate of their own.
    pub fn start_tls(cert: &std::path::Path, key: &std::path::Path) -> Redis {
        let port = super::free_port();
        let r = Redis {
            port,
            child: Mutex::new(None),
            tls: Some((cert.display().to_string(), key.display().to_string())),
        };
        r.spawn();
        r
    }

    fn spawn(&self) {
        let mut cmd = Command::new("redis-server");
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
        let child = cmd
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
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
        let out = cmd.args(args).output()?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// How many times a command ran, from `INFO commandstats` (`evalsha`, `eval`).
    pub fn calls(&self, command: &str) -> u64 {
        let info = self.cmd(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.thaw();
        self.kill();
    }
}
