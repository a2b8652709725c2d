//! UTC wall-clock times for run directories, reports and the output
//! directory's lock, without a date crate: the civil-date arithmetic is a
//! dozen lines.

use std::path::PathBuf;

/// `runs/{kind}-YYYYMMDD-HHMMSS` (UTC): a new directory for every run.
pub fn run_dir(kind: &str) -> PathBuf {
    let (year, month, day, hour, minute, second) = utc_now();
    PathBuf::from(format!(
        "runs/{kind}-{year:04}{month:02}{day:02}-{hour:02}{minute:02}{second:02}"
    ))
}

/// `YYYY-MM-DD HH:MM:SS UTC` now, for reports.
pub fn utc_timestamp() -> String {
    utc(now_secs())
}

/// `YYYY-MM-DD HH:MM:SS UTC` of `secs` after the Unix epoch.
pub fn utc(secs: u64) -> String {
    let (year, month, day, hour, minute, second) = civil(secs);
    format!("{year:04}-{month:02}-{day:02} {hour:02}:{minute:02}:{second:02} UTC")
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn utc_now() -> (i64, u32, u32, u64, u64, u64) {
    civil(now_secs())
}

fn civil(secs: u64) -> (i64, u32, u32, u64, u64, u64) {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    (year, month, day, rest / 3600, rest % 3600 / 60, rest % 60)
}

/// Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_786), (2026, 11, 29));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(utc(1_796_246_462), "2026-12-02 21:21:02 UTC");
    }
}
