//! Value types read from the config file: durations (`"250ms"`, `"1m"`) and byte sizes
//! (`"1MiB"`). Parsing happens inside `Deserialize`, so the TOML reader attaches the
//! offending value's position to every error for free.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer, de};

/// A duration written as a humantime string; zero is allowed (e.g. `shutdown_delay = "0s"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

/// A duration that must be greater than zero (windows, timeouts, refill periods).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PosDur(pub Duration);

/// A byte count written as `"64KiB"`, `"1MiB"`, `"10MB"` or a bare integer of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes(pub u64);

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| {
        format!("invalid duration {s:?} ({e}); write it like \"250ms\", \"10s\" or \"1m\"")
    })
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s).map(Dur).map_err(de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for PosDur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match parse_duration(&s) {
            Ok(v) if v.is_zero() => Err(de::Error::custom("duration must be greater than zero")),
            Ok(v) => Ok(PosDur(v)),
            Err(e) => Err(de::Error::custom(e)),
        }
    }
}

/// Parses a size; binary (KiB, MiB, GiB) and decimal (KB, MB, GB) units, case-sensitive
/// as in the IEC/SI symbols, so `"1mb"` is rejected rather than guessed at.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}; write it like \"64KiB\" or \"1MiB\""))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit {other:?} in {s:?}; use B, KiB, MiB, GiB, KB, MB or GB"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Bytes;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size like \"1MiB\" or an integer number of bytes")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Bytes, E> {
                u64::try_from(v)
                    .map(Bytes)
                    .map_err(|_| E::custom("size must not be negative"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Bytes, E> {
                parse_bytes(v).map(Bytes).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// Serializes a duration the way it is written in the file, for `/config` and `explain`.
pub fn ser_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&fmt_duration(*d))
}

pub fn fmt_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string().replace(' ', "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("1MiB"), Ok(1 << 20));
        assert_eq!(parse_bytes("64KiB"), Ok(65536));
        assert_eq!(parse_bytes("10MB"), Ok(10_000_000));
        assert_eq!(parse_bytes("512"), Ok(512));
        assert!(parse_bytes("1mb").is_err());
        assert!(parse_bytes("MiB").is_err());
        assert!(parse_bytes("99999999999999GiB").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_duration("10").is_err());
        assert_eq!(fmt_duration(Duration::from_millis(1500)), "1s500ms");
    }
}
