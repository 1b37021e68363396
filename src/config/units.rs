//! Value types read from the config file: durations (`"250ms"`, `"1m"`) and byte sizes
//! (`"1MiB"`). Parsing happens inside `Deserialize`, so the TOML reader attaches the
//! offending value's position to every error for free.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer, de};

/// A duration written as a humantime string; zero is allowed (e.g. `shutdown_delay = "0s"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dur(pub Duration);

/// A duration that must be greater than zero (windows, timeouts, refill periods).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PosDur(pub Duration);

/// A byte count written as `"64KiB"`, `"1MiB"`, `"10MB"` or a bare integer of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bytes(pub u64);

pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
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
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
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

/// A limit's safety margin as written: a duration (`"30ms"`) or a share of the limit's
/// window or emission interval (`"20%"`, `"2.5%"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Margin {
    Duration(Duration),
    /// Parts per million of the window (windows) or of `per / rate` (token buckets).
    Fraction(u32),
}

impl Margin {
    /// The margin as a duration, for a limit whose window or emission interval is `span`.
    pub(crate) fn of(self, span: Duration) -> Duration {
        match self {
            Margin::Duration(d) => d,
            Margin::Fraction(ppm) => {
                let ns = span.as_nanos() * u128::from(ppm) / 1_000_000;
                Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
            }
        }
    }
}

fn parse_margin(s: &str) -> Result<Margin, String> {
    let t = s.trim();
    let bad =
        || format!("invalid margin {s:?}; write a duration like \"30ms\" or a share like \"20%\"");
    let Some(pct) = t.strip_suffix('%') else {
        return parse_duration(t).map(Margin::Duration).map_err(|_| bad());
    };
    let (whole, frac) = pct.trim().split_once('.').unwrap_or((pct.trim(), ""));
    if whole.is_empty()
        || frac.len() > 4
        || !(whole.bytes().chain(frac.bytes())).all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    let whole: u64 = whole.parse().map_err(|_| bad())?;
    let frac: u64 = format!("{frac:0<4}").parse().map_err(|_| bad())?;
    // Percent with four decimals is parts per million.
    let ppm = whole
        .checked_mul(10_000)
        .and_then(|w| w.checked_add(frac))
        .ok_or_else(bad)?;
    if ppm > 1_000_000 {
        return Err(format!("margin {s:?} is more than the whole window"));
    }
    Ok(Margin::Fraction(ppm as u32))
}

impl fmt::Display for Margin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Margin::Duration(d) => f.write_str(&fmt_duration(d)),
            Margin::Fraction(ppm) => {
                let (whole, frac) = (ppm / 10_000, ppm % 10_000);
                if frac == 0 {
                    write!(f, "{whole}%")
                } else {
                    let frac = format!("{frac:04}");
                    write!(f, "{whole}.{}%", frac.trim_end_matches('0'))
                }
            }
        }
    }
}

impl<'de> Deserialize<'de> for Margin {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_margin(&s).map_err(de::Error::custom)
    }
}

impl serde::Serialize for Margin {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Serializes a duration the way it is written in the file, for `/config` and `explain`.
pub(crate) fn ser_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&fmt_duration(*d))
}

/// `None` as null: "not set, see the key it falls back to".
pub(crate) fn ser_opt_duration<S: Serializer>(
    d: &Option<Duration>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => ser_duration(d, s),
        None => s.serialize_none(),
    }
}

pub(crate) fn fmt_duration(d: Duration) -> String {
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
    fn margins() {
        let ms = |v| Margin::Duration(Duration::from_millis(v));
        assert_eq!(parse_margin("30ms"), Ok(ms(30)));
        assert_eq!(parse_margin("0s"), Ok(ms(0)));
        assert_eq!(parse_margin("20%"), Ok(Margin::Fraction(200_000)));
        assert_eq!(parse_margin(" 2.5% "), Ok(Margin::Fraction(25_000)));
        assert_eq!(parse_margin("0.0001%"), Ok(Margin::Fraction(1)));
        for bad in ["%", "2.%x", "-1%", "1.00001%", "101%", "abc", "1e3%"] {
            assert!(parse_margin(bad).is_err(), "{bad}");
        }
        assert_eq!(Margin::Fraction(25_000).to_string(), "2.5%");
        assert_eq!(Margin::Fraction(200_000).to_string(), "20%");
        assert_eq!(ms(1500).to_string(), "1s500ms");
        let sec = Duration::from_secs(1);
        assert_eq!(
            Margin::Fraction(200_000).of(sec),
            Duration::from_millis(200)
        );
        assert_eq!(ms(30).of(sec), Duration::from_millis(30));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_duration("10").is_err());
        assert_eq!(fmt_duration(Duration::from_millis(1500)), "1s500ms");
    }
}
