//! Every input committed under `fuzz/corpus/` (seeds, what the fuzzers kept, and every
//! crash they found) run through the fuzz targets' own checks, on stable, on every test
//! run: a crash found once stays fixed. `scripts/fuzz` runs the fuzzers themselves.

use sluice_fuzz_targets as targets;

fn replay(target: &str, run: fn(&[u8])) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "{} has no inputs", dir.display());
    for input in &inputs {
        let data = std::fs::read(input).unwrap();
        if std::panic::catch_unwind(|| run(&data)).is_err() {
            panic!("{} fails", input.display());
        }
    }
}

#[test]
fn config_corpus() {
    replay("config", targets::config);
}

#[test]
fn patterns_corpus() {
    replay("patterns", targets::patterns);
}

#[test]
fn hints_corpus() {
    replay("hints", targets::hints);
}

#[test]
fn classify_corpus() {
    replay("classify", targets::classify);
}

#[test]
fn response_corpus() {
    replay("response", targets::response);
}

#[test]
fn authority_corpus() {
    replay("authority", targets::authority);
}

#[test]
fn request_corpus() {
    replay("request", targets::request);
}
