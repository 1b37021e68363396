//! What the benchmark drivers share: the release binary, started with a config file,
//! awaited on `/readyz` and stopped with SIGTERM even when a panic unwinds past it; and
//! percentiles.

use std::process::Command;
use std::time::Duration;

/// Stops the sluice child even when a panic unwinds past it.
pub struct Child(pub std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// Waits (up to 5 s) for the admin listener at `admin` to answer `/readyz`.
pub async fn ready(admin: &str) {
    for _ in 0..100 {
        if reqwest::get(format!("http://{admin}/readyz")).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `p` quantile (0 to 1) of `sorted` samples.
pub fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}
