//! Postgres date/time text output (DateStyle ISO) to milliseconds, as Zero's replicator stores
//! them: timestamps as fractional ms since the Unix epoch, dates as ms at UTC midnight, times as
//! ms since midnight.
//!
//! Hand-written rather than built on a date crate: Postgres dates span 4713 BC to 5874897 AD
//! (beyond what `time` or `chrono` represent), years may have more than four digits, `BC` is a
//! suffix, and offsets may carry seconds (`+05:53:28`).

const MICROS_PER_SECOND: i128 = 1_000_000;
const SECONDS_PER_DAY: i64 = 86_400;
pub(super) const MS_PER_DAY: i64 = 86_400_000;

/// A point in time as microseconds since 1970-01-01 00:00 UTC; `i128` because the latest
/// Postgres timestamp (294276 AD) does not fit `i64` microseconds relative to 1970.
pub(super) type UnixMicros = i128;

/// Days since 1970-01-01 of a proleptic Gregorian date with an astronomical year (1 BC = 0).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ if year.rem_euclid(4) == 0
            && (year.rem_euclid(100) != 0 || year.rem_euclid(400) == 0) =>
        {
            29
        }
        _ => 28,
    }
}

/// A tiny scanner over ASCII date/time text.
struct Scan<'a> {
    s: &'a [u8],
    pos: usize,
}

impl<'a> Scan<'a> {
    fn new(text: &'a str) -> Self {
        Scan {
            s: text.as_bytes(),
            pos: 0,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() == Some(byte) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        self.eat(byte).then_some(())
    }

    /// Between `min` and `max` digits as a number.
    fn digits(&mut self, min: usize, max: usize) -> Option<(i64, usize)> {
        let start = self.pos;
        let mut value: i64 = 0;
        while self.pos - start < max {
            match self.peek() {
                Some(d @ b'0'..=b'9') => {
                    value = value * 10 + i64::from(d - b'0');
                    self.pos += 1;
                }
                _ => break,
            }
        }
        let count = self.pos - start;
        (count >= min).then_some((value, count))
    }

    fn fixed(&mut self, count: usize) -> Option<i64> {
        self.digits(count, count).map(|(v, _)| v)
    }

    fn rest(&self) -> &'a [u8] {
        &self.s[self.pos..]
    }

    fn done(&self) -> bool {
        self.pos == self.s.len()
    }
}

/// `Y…Y-MM-DD` as days since 1970-01-01; the year is made astronomical by `bc`.
fn date_part(scan: &mut Scan<'_>) -> Option<(i64, u32, u32)> {
    // Postgres prints at least four year digits; seven cover its whole date range.
    let (year, _) = scan.digits(1, 7)?;
    scan.expect(b'-')?;
    let month = u32::try_from(scan.fixed(2)?).ok()?;
    scan.expect(b'-')?;
    let day = u32::try_from(scan.fixed(2)?).ok()?;
    (year >= 1 && (1..=12).contains(&month)).then_some((year, month, day))
}

fn resolve_date(year: i64, month: u32, day: u32, bc: bool) -> Option<i64> {
    let year = if bc { 1 - year } else { year };
    (day >= 1 && day <= days_in_month(year, month)).then(|| days_from_civil(year, month, day))
}

/// `HH:MM:SS[.ffffff]` as microseconds since midnight; `24:00:00` is allowed (end of day).
fn time_part(scan: &mut Scan<'_>) -> Option<i64> {
    let hour = scan.fixed(2)?;
    scan.expect(b':')?;
    let minute = scan.fixed(2)?;
    scan.expect(b':')?;
    let second = scan.fixed(2)?;
    let mut micros = 0;
    if scan.eat(b'.') {
        let (fraction, count) = scan.digits(1, 6)?;
        micros = fraction * 10_i64.pow(6 - count as u32);
    }
    let in_range = hour <= 24 && minute < 60 && second < 60;
    let end_of_day = hour < 24 || (minute == 0 && second == 0 && micros == 0);
    (in_range && end_of_day).then_some(((hour * 60 + minute) * 60 + second) * 1_000_000 + micros)
}

/// `±HH[:MM[:SS]]` as seconds east of UTC.
fn offset_part(scan: &mut Scan<'_>) -> Option<i64> {
    let sign = match scan.peek()? {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    scan.pos += 1;
    let hours = scan.fixed(2)?;
    let mut minutes = 0;
    let mut seconds = 0;
    if scan.eat(b':') {
        minutes = scan.fixed(2)?;
        if scan.eat(b':') {
            seconds = scan.fixed(2)?;
        }
    }
    (hours <= 15 && minutes < 60 && seconds < 60)
        .then_some(sign * (hours * 3600 + minutes * 60 + seconds))
}

fn bc_suffix(scan: &mut Scan<'_>) -> Option<bool> {
    match scan.rest() {
        b"" => Some(false),
        b" BC" => {
            scan.pos += 3;
            Some(true)
        }
        _ => None,
    }
}

/// What a date/time text denotes: a finite instant, or one of Postgres's infinities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Instant<T> {
    Finite(T),
    Infinite,
}

/// `timestamp` (`with_zone = false`) or `timestamptz` text as Unix microseconds.
/// A `timestamp` without zone is read as UTC, like Zero does.
pub(super) fn parse_timestamp(text: &str, with_zone: bool) -> Option<Instant<UnixMicros>> {
    if text == "infinity" || text == "-infinity" {
        return Some(Instant::Infinite);
    }
    let mut scan = Scan::new(text);
    let (year, month, day) = date_part(&mut scan)?;
    scan.expect(b' ')?;
    let time = time_part(&mut scan)?;
    let offset = if with_zone {
        offset_part(&mut scan)?
    } else {
        0
    };
    let bc = bc_suffix(&mut scan)?;
    if !scan.done() {
        return None;
    }
    let days = resolve_date(year, month, day, bc)?;
    let seconds = i128::from(days) * i128::from(SECONDS_PER_DAY) - i128::from(offset);
    Some(Instant::Finite(
        seconds * MICROS_PER_SECOND + i128::from(time),
    ))
}

/// `date` text as days since 1970-01-01.
pub(super) fn parse_date(text: &str) -> Option<Instant<i64>> {
    if text == "infinity" || text == "-infinity" {
        return Some(Instant::Infinite);
    }
    let mut scan = Scan::new(text);
    let (year, month, day) = date_part(&mut scan)?;
    let bc = bc_suffix(&mut scan)?;
    if !scan.done() {
        return None;
    }
    resolve_date(year, month, day, bc).map(Instant::Finite)
}

/// `time` text as whole milliseconds since midnight (sub-millisecond digits are dropped).
pub(super) fn parse_time(text: &str) -> Option<i64> {
    let mut scan = Scan::new(text);
    let micros = time_part(&mut scan)?;
    scan.done().then_some(micros / 1000)
}

/// `timetz` text as whole milliseconds since midnight UTC, wrapped into one day (as Zero does:
/// `24:00:00+00` stays 86 400 000).
pub(super) fn parse_time_tz(text: &str) -> Option<i64> {
    let mut scan = Scan::new(text);
    let micros = time_part(&mut scan)?;
    let offset = offset_part(&mut scan)?;
    if !scan.done() {
        return None;
    }
    let ms = micros / 1000 - offset * 1000;
    Some(if (0..=MS_PER_DAY).contains(&ms) {
        ms
    } else {
        ms.rem_euclid(MS_PER_DAY)
    })
}

/// Exact decimal text of `micros / 1000`: `"1547249435381.101"`, `"-1.5"`, `"0"`.
pub(super) fn micros_as_ms_text(micros: UnixMicros) -> String {
    let sign = if micros < 0 { "-" } else { "" };
    let abs = micros.unsigned_abs();
    let (whole, fraction) = (abs / 1000, abs % 1000);
    if fraction == 0 {
        format!("{sign}{whole}")
    } else {
        let digits = format!("{fraction:03}");
        format!("{sign}{whole}.{}", digits.trim_end_matches('0'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(text: &str, with_zone: bool) -> String {
        match parse_timestamp(text, with_zone) {
            Some(Instant::Finite(micros)) => micros_as_ms_text(micros),
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn timestamptz_matches_zeros_worked_examples() {
        // The same instant written with three offsets.
        assert_eq!(
            ms("2019-01-11 22:30:35.381101-01", true),
            "1547249435381.101"
        );
        assert_eq!(
            ms("2019-01-11 23:30:35.381101+00", true),
            "1547249435381.101"
        );
        assert_eq!(
            ms("2019-01-12 00:30:35.381101+01", true),
            "1547249435381.101"
        );
        assert_eq!(
            ms("2019-01-11 23:30:35.381101+01:01", true),
            "1547245775381.101"
        );
        assert_eq!(
            ms("2019-01-11 22:30:35.381101+00:03", true),
            "1547245655381.101"
        );
        assert_eq!(
            ms("2004-10-19 10:23:54.654321+00:00", true),
            "1098181434654.321"
        );
    }

    #[test]
    fn timestamps_at_known_instants() {
        assert_eq!(ms("1970-01-01 00:00:00", false), "0");
        assert_eq!(ms("2000-01-01 00:00:00", false), "946684800000");
        assert_eq!(ms("1969-12-31 23:59:59.9985", false), "-1.5");
        assert_eq!(ms("2024-02-29 12:00:00.5", false), "1709208000500");
        assert_eq!(ms("1900-01-01 00:00:00+05:53:28", true), "-2209010008000");
        // 1 BC is astronomical year 0, a leap year.
        assert_eq!(ms("0001-02-29 00:00:00 BC", false), "-62162121600000");
        assert_eq!(ms("0001-01-01 00:00:00+00 BC", true), "-62167219200000");
        // Beyond the i64-microsecond range relative to 1970.
        assert_eq!(
            ms("294276-12-31 23:59:59.999999", false),
            "9224318015999999.999"
        );
    }

    #[test]
    fn timestamp_infinities_and_garbage() {
        assert_eq!(parse_timestamp("infinity", true), Some(Instant::Infinite));
        assert_eq!(parse_timestamp("-infinity", false), Some(Instant::Infinite));
        for bad in [
            "",
            "2024-01-01",
            "2024-13-01 00:00:00",
            "2023-02-29 00:00:00",
            "2024-01-01 24:00:01",
            "2024-01-01 00:60:00",
            "2024-01-01 00:00:00.1234567",
            "2024-01-01T00:00:00",
            "2024-01-01 00:00:00 AD",
            "0000-01-01 00:00:00",
            "01/02/2024 00:00:00",
        ] {
            assert_eq!(parse_timestamp(bad, false), None, "{bad}");
        }
        // A zone is required for timestamptz and refused for timestamp.
        assert_eq!(parse_timestamp("2024-01-01 00:00:00", true), None);
        assert_eq!(parse_timestamp("2024-01-01 00:00:00+00", false), None);
    }

    #[test]
    fn dates_are_days_at_utc_midnight() {
        assert_eq!(parse_date("1970-01-01"), Some(Instant::Finite(0)));
        assert_eq!(parse_date("2000-03-01"), Some(Instant::Finite(11_017)));
        assert_eq!(parse_date("1969-12-31"), Some(Instant::Finite(-1)));
        assert_eq!(
            parse_date("4714-11-24 BC"),
            Some(Instant::Finite(-2_440_588))
        );
        assert_eq!(
            parse_date("5874897-12-31"),
            Some(Instant::Finite(2_145_042_905))
        );
        assert_eq!(parse_date("-infinity"), Some(Instant::Infinite));
        assert_eq!(parse_date("2024-02-30"), None);
        assert_eq!(parse_date("2024-01-01 00:00:00"), None);
    }

    #[test]
    fn times_are_ms_since_midnight() {
        assert_eq!(parse_time("00:00:00"), Some(0));
        assert_eq!(parse_time("13:14:15.9999"), Some(47_655_999));
        assert_eq!(parse_time("24:00:00"), Some(MS_PER_DAY));
        assert_eq!(parse_time("24:00:00.1"), None);
        assert_eq!(parse_time("12:00"), None);
        assert_eq!(parse_time_tz("12:00:00+02"), Some(36_000_000));
        assert_eq!(parse_time_tz("01:00:00+02"), Some(82_800_000));
        assert_eq!(parse_time_tz("23:00:00-03:30"), Some(9_000_000));
        assert_eq!(parse_time_tz("24:00:00+00"), Some(MS_PER_DAY));
        assert_eq!(parse_time_tz("12:00:00"), None);
    }

    proptest! {
        /// Cross-checks the calendar arithmetic against a day-by-day walk from 1970.
        #[test]
        fn days_from_civil_counts_days_in_order(days in -800_000i64..800_000) {
            // Inverse (Hinnant's civil_from_days) written independently.
            let z = days + 719_468;
            let era = z.div_euclid(146_097);
            let doe = z.rem_euclid(146_097);
            let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
            let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
            let mp = (5 * doy + 2) / 153;
            let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
            let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
            let y = yoe + era * 400 + i64::from(m <= 2);
            prop_assert!(d <= days_in_month(y, m));
            prop_assert_eq!(days_from_civil(y, m, d), days);
        }

        #[test]
        fn consecutive_days_differ_by_one(year in -5000i64..300_000, month in 1u32..=12) {
            let last = days_in_month(year, month);
            let next = if month == 12 { (year + 1, 1) } else { (year, month + 1) };
            prop_assert_eq!(days_from_civil(year, month, last) + 1, days_from_civil(next.0, next.1, 1));
        }

        #[test]
        fn arbitrary_text_never_panics(text in "[0-9 :.+\\-BCinfty]{0,40}") {
            let _ = parse_timestamp(&text, true);
            let _ = parse_timestamp(&text, false);
            let _ = parse_date(&text);
            let _ = parse_time(&text);
            let _ = parse_time_tz(&text);
        }
    }
}
