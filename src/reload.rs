//! What starts a reload besides `POST /reload`: a change to the config file and SIGHUP.
//! All three end in [`App::reload`], which validates the whole file before anything
//! changes.
//!
//! The file is watched through its directory, not itself: editors write a temporary file
//! and rename it over the old one, and Kubernetes updates a mounted ConfigMap by pointing
//! the `..data` symlink at a new directory. Neither changes the inode a file watch would
//! follow, but both show up as events in the directory. When the path is a symlink to a
//! file elsewhere, that file's directory is watched too (and followed if the link moves).
//! Only events that name the config file, the ConfigMap's `..data` link or the symlink's
//! target count: other files in the directory (a log written there, say) are none of our
//! business. Events come in bursts, so a reload waits until they have been quiet for
//! [`DEBOUNCE`], never longer than [`MAX_DELAY`] after the first, and only runs when the
//! bytes behind the path differ from the last ones tried. A file written in place is
//! half-written until its writer closes it, however long the writer pauses, so after a
//! write the watcher waits for the close instead (or for [`WRITER_GONE`] of quiet).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::app::App;
use crate::config::{MAX_CONFIG_BYTES, read_capped, text_sha256};

/// How long the config file must stay quiet before a change is read.
pub const DEBOUNCE: Duration = Duration::from_millis(250);

/// A file that never stays quiet is read this long after its first change anyway.
pub const MAX_DELAY: Duration = Duration::from_secs(2);

/// A file written to and not yet closed is read once it has been quiet this long: its
/// writer stopped without closing it, or the close was missed.
pub const WRITER_GONE: Duration = Duration::from_secs(5);

/// The watch on the config's directory and the SIGHUP handler, for an app loaded from a
/// file. Both are registered by [`Triggers::new`], so nothing that happens after it is
/// missed; [`Triggers::start`] begins acting on them.
pub(crate) struct Triggers {
    path: Option<PathBuf>,
    watch: Option<(notify::RecommendedWatcher, Events, Names)>,
    hup: Option<tokio::signal::unix::Signal>,
}

impl Triggers {
    /// Must run inside the tokio runtime (the signal handler registers with it).
    pub(crate) fn new(app: &App) -> Triggers {
        let Some(path) = app.config_path().map(Path::to_path_buf) else {
            return Triggers {
                path: None,
                watch: None,
                hup: None,
            };
        };
        let watch = watch(&path)
            .inspect_err(|e| tracing::warn!(config = %path.display(), error = %e, "cannot watch the config file; reload with SIGHUP or POST /reload"))
            .ok();
        let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .inspect_err(
                |e| tracing::warn!(error = %e, "cannot handle SIGHUP; reload with POST /reload"),
            )
            .ok();
        Triggers {
            path: Some(path),
            watch,
            hup,
        }
    }

    /// Acts on the triggers until `stop` is cancelled.
    pub(crate) fn start(self, app: &Arc<App>, stop: &CancellationToken) {
        let Some(path) = self.path else { return };
        if let Some((watcher, events, names)) = self.watch {
            tokio::spawn(on_file_change(
                app.clone(),
                path,
                (watcher, events, names),
                stop.clone(),
            ));
        }
        if let Some(hup) = self.hup {
            tokio::spawn(on_sighup(app.clone(), hup, stop.clone()));
        }
    }
}

type Events = mpsc::UnboundedReceiver<Change>;

/// What an event that names one of ours says about the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    /// Bytes were written in place: the file is incomplete until its writer closes it.
    Written,
    /// A writer closed it.
    Closed,
    /// Renamed, created or deleted, or events were lost: a write in progress, if any,
    /// is no longer to what the path names.
    Replaced,
    /// Anything else (its mode, say): worth a look, but a write in progress goes on.
    Touched,
}

impl Change {
    fn of(kind: &notify::EventKind) -> Option<Change> {
        use notify::EventKind;
        use notify::event::{AccessKind, AccessMode, ModifyKind};
        match kind {
            EventKind::Modify(ModifyKind::Data(_)) => Some(Change::Written),
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => Some(Change::Closed),
            // Other reads and opens (our own included) change nothing.
            EventKind::Access(_) => None,
            EventKind::Create(_)
            | EventKind::Remove(_)
            | EventKind::Modify(ModifyKind::Name(_)) => Some(Change::Replaced),
            _ => Some(Change::Touched),
        }
    }
}

/// The file names whose events count: the config file's, `..data`, and the symlink
/// target's when it lives elsewhere.
type Names = Arc<parking_lot::RwLock<Vec<std::ffi::OsString>>>;

fn names_of(path: &Path) -> Vec<std::ffi::OsString> {
    let mut names = vec![std::ffi::OsString::from("..data")];
    names.extend(path.file_name().map(ToOwned::to_owned));
    if let Some(target) = std::fs::canonicalize(path)
        .ok()
        .and_then(|t| t.file_name().map(ToOwned::to_owned))
    {
        names.push(target);
    }
    names
}

fn dir_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The directory of the file `path` resolves to, when a symlink puts it outside the
/// directory of `path` itself (inside it, as in a ConfigMap, that one sees the changes).
fn target_dir(path: &Path) -> Option<PathBuf> {
    let dir = std::fs::canonicalize(dir_of(path)).ok()?;
    let target = dir_of(&std::fs::canonicalize(path).ok()?);
    (!target.starts_with(&dir)).then_some(target)
}

/// Keeps the watch on the symlink target's directory in step with where it points now.
fn follow(
    watcher: &mut notify::RecommendedWatcher,
    followed: &mut Option<PathBuf>,
    names: &Names,
    path: &Path,
) {
    *names.write() = names_of(path);
    let now = target_dir(path);
    if now == *followed {
        return;
    }
    if let Some(old) = followed.take() {
        let _ = watcher.unwatch(&old);
    }
    if let Some(dir) = now {
        match watcher.watch(&dir, RecursiveMode::NonRecursive) {
            Ok(()) => *followed = Some(dir),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot watch the config file's target directory")
            }
        }
    }
}

fn watch(path: &Path) -> notify::Result<(notify::RecommendedWatcher, Events, Names)> {
    let dir = dir_of(path);
    let (tx, rx) = mpsc::unbounded_channel();
    let names: Names = Arc::new(parking_lot::RwLock::new(names_of(path)));
    let ours = names.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        let change = if event.need_rescan() {
            Change::Replaced
        } else {
            let Some(change) = Change::of(&event.kind) else {
                return;
            };
            let names = ours.read();
            let named = event
                .paths
                .iter()
                .filter_map(|p| p.file_name())
                .any(|n| names.iter().any(|m| m == n));
            if !named {
                return;
            }
            change
        };
        let _ = tx.send(change);
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    Ok((watcher, rx, names))
}

async fn on_file_change(
    app: Arc<App>,
    path: PathBuf,
    (mut watcher, mut events, names): (notify::RecommendedWatcher, Events, Names),
    stop: CancellationToken,
) {
    let mut followed = None;
    follow(&mut watcher, &mut followed, &names, &path);
    let mut last_tried = app.config().sha256.clone();
    // The first pass looks at once: the file may have changed between its load and the
    // watch.
    let mut first = true;
    loop {
        let mut writing = false;
        if !std::mem::take(&mut first) {
            tokio::select! {
                e = events.recv() => match e {
                    None => return,
                    Some(change) => writing = change == Change::Written,
                },
                _ = stop.cancelled() => return,
            }
        }
        // Quiet for DEBOUNCE: the writer is done. A writer that never stops does not keep
        // the change from being read, unless it holds the file open mid-write: what it
        // wrote so far is not the config it is writing.
        let latest = tokio::time::Instant::now() + MAX_DELAY;
        loop {
            let quiet = if writing { WRITER_GONE } else { DEBOUNCE };
            tokio::select! {
                e = events.recv() => match e {
                    None => return,
                    Some(Change::Written) => writing = true,
                    Some(Change::Closed | Change::Replaced) => writing = false,
                    Some(Change::Touched) => {}
                },
                _ = tokio::time::sleep(quiet) => break,
                _ = tokio::time::sleep_until(latest), if !writing => break,
                _ = stop.cancelled() => return,
            }
        }
        follow(&mut watcher, &mut followed, &names, &path);
        // An unreadable file (deleted, half swapped) goes to the reload, which reports it.
        let current = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || read_capped(&path, MAX_CONFIG_BYTES))
        }
        .await
        .ok()
        .and_then(Result::ok)
        .map(|t| text_sha256(&t));
        // Already live (a POST /reload or SIGHUP got there first) or already refused.
        // The live config back on disk after a refused edit (a rollback) is reloaded
        // all the same: it succeeds as unchanged and clears the failure it replaces.
        let live = current.as_ref().is_some_and(|c| *c == app.config().sha256);
        let failed = app.metrics.config_last_reload_successful.get() == 0;
        let tried = current.as_ref().is_some_and(|c| *c == last_tried);
        let skip = if live { !failed } else { tried };
        if skip {
            continue;
        }
        if let Some(sha) = current {
            last_tried = sha;
        }
        tracing::info!(config = %path.display(), "config file changed");
        // The outcome is logged and counted by the reload itself.
        let _ = reload(&app).await;
    }
}

async fn on_sighup(app: Arc<App>, mut hup: tokio::signal::unix::Signal, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = hup.recv() => {
                tracing::info!("SIGHUP received");
                let _ = reload(&app).await;
            }
            _ = stop.cancelled() => return,
        }
    }
}

/// Runs a reload off the async threads: it reads files (config, CA certificates).
pub(crate) async fn reload(app: &Arc<App>) -> Result<crate::app::ReloadSummary, String> {
    let app = app.clone();
    match tokio::task::spawn_blocking(move || app.reload()).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(format!("reload task failed: {e}")),
    }
}
