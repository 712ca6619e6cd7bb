//! Durations as users write them: `5s`, `200ms`, `1m30s`, `1.5s`.

use std::time::Duration;

/// Parses a Go-style duration with at least one unit (`ns`, `us`, `ms`, `s`, `m`, `h`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("a duration needs a number and a unit, e.g. 200ms".into());
    }
    let mut rest = s;
    let mut total = 0f64;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("{text:?} has no unit: write e.g. {text}ms or {text}s"))?;
        if digits == 0 {
            return Err(format!(
                "{text:?} is not a duration (e.g. 5s, 200ms, 1m30s)"
            ));
        }
        let number: f64 = rest[..digits]
            .parse()
            .map_err(|_| format!("{text:?} is not a duration (e.g. 5s, 200ms, 1m30s)"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds_per_unit = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            unit => {
                return Err(format!(
                    "{text:?} has unknown unit {unit:?} (use ns, us, ms, s, m or h)"
                ));
            }
        };
        total += number * seconds_per_unit;
        rest = &rest[unit_len..];
    }
    Duration::try_from_secs_f64(total).map_err(|_| format!("{text:?} is out of range"))
}

/// Formats seconds compactly for traces and errors (`1.5s`, `230ms`).
pub fn format_seconds(seconds: f64) -> String {
    if seconds.abs() >= 1.0 {
        format!("{}s", trim_float(seconds))
    } else {
        format!("{}ms", trim_float(seconds * 1e3))
    }
}

fn trim_float(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_the_seed_names() {
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("200ms").unwrap(), Duration::from_millis(200));
        assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
    }

    #[test]
    fn rejects_bare_numbers_and_unknown_units() {
        assert!(parse_duration("200").unwrap_err().contains("no unit"));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("1..2s").is_err());
    }

    #[test]
    fn formats_compactly() {
        assert_eq!(format_seconds(1.5), "1.5s");
        assert_eq!(format_seconds(0.23), "230ms");
    }
}
