//! Watermarks: Zero's LexiVersion encoding, StateVersions and Postgres LSNs.
//!
//! A LexiVersion writes a non-negative integer in base 36 behind a one-character length prefix,
//! so that plain string order equals numeric order. A StateVersion is `lexi(major)` or
//! `lexi(major).lexi(minor)`; the minor part orders auxiliary (backfill) transactions between two
//! upstream positions. Watermarks stay strings on the wire and are an ordered newtype here.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

pub use ethnum::U256;

/// Base-36 digits in LexiVersion order.
const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
/// At most 36 base-36 digits: the length prefix is itself one base-36 digit.
const MAX_DIGITS: usize = 36;

/// Why a watermark, LexiVersion, StateVersion or LSN string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WatermarkError {
    #[error("expected a LexiVersion (length prefix then base-36 digits), got an empty string")]
    Empty,
    #[error("expected lowercase base-36 digits in LexiVersion {text:?}, found {found:?}")]
    BadDigit { text: String, found: char },
    #[error("LexiVersion {text:?} declares {declared} digits but has {actual}")]
    LengthMismatch {
        text: String,
        declared: usize,
        actual: usize,
    },
    #[error("LexiVersion {text:?} is not canonical: it has a leading zero")]
    LeadingZero { text: String },
    #[error("expected a StateVersion `major` or `major.minor`, got {text:?}")]
    BadStateVersion { text: String },
    #[error("expected an LSN `H/L` of two hex numbers of at most 8 digits, got {text:?}")]
    BadLsn { text: String },
    #[error("StateVersion {text:?} has a major part beyond 64 bits and has no LSN")]
    MajorTooLarge { text: String },
}

/// 36^36 − 1, as `max_lexi_value` returns it, computed once.
const MAX_LEXI: U256 = U256::from_words(
    0x0456_bc60_e76c_111e,
    0x6797_35c9_29f6_a0ff_ffff_ffff_ffff_ffff,
);

/// The largest value a LexiVersion holds: 36^36 − 1 (36 base-36 digits).
pub fn max_lexi_value() -> U256 {
    MAX_LEXI
}

/// A LexiVersion's text in a stack buffer: the length prefix, then the digits.
struct LexiText {
    buf: [u8; MAX_DIGITS + 1],
    len: usize,
}

impl LexiText {
    /// `value`'s LexiVersion, or `None` beyond 36^36 − 1. Every watermark of an LSN goes
    /// through here (two per upstream transaction), so values of up to 64 bits, which every
    /// LSN is, are divided as `u64`s; only wider ones take `U256` division.
    fn new(value: U256) -> Option<LexiText> {
        if value > MAX_LEXI {
            return None;
        }
        // Digits least significant first.
        let mut digits = [0u8; MAX_DIGITS];
        let mut len = 0;
        let mut v = value;
        let base = U256::from(36u8);
        // Stops at a nonzero value: anything above `u64::MAX` divided by 36 still is.
        while v > U256::from(u64::MAX) {
            digits[len] = DIGITS[(v % base).as_usize()];
            len += 1;
            v /= base;
        }
        let mut small = v.as_u64();
        loop {
            digits[len] = DIGITS[(small % 36) as usize];
            len += 1;
            small /= 36;
            if small == 0 {
                break;
            }
        }
        let mut buf = [0u8; MAX_DIGITS + 1];
        buf[0] = DIGITS[len - 1];
        for (to, from) in buf[1..=len].iter_mut().zip(digits[..len].iter().rev()) {
            *to = *from;
        }
        Some(LexiText { buf, len: len + 1 })
    }

    fn as_str(&self) -> &str {
        // Only base-36 digits were written, all ASCII.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or_default()
    }
}

/// Encodes `value` as a LexiVersion, or `None` beyond 36^36 − 1.
pub fn try_encode_lexi(value: U256) -> Option<String> {
    LexiText::new(value).map(|text| text.as_str().to_owned())
}

/// Encodes `value` as a LexiVersion. Every `u128` fits (36^36 > 2^128).
pub fn encode_lexi(value: u128) -> String {
    try_encode_lexi(U256::from(value)).unwrap_or_default()
}

/// Decodes a LexiVersion: any value of up to 36 base-36 digits.
pub fn decode_lexi(text: &str) -> Result<U256, WatermarkError> {
    validate_lexi(text)?;
    Ok(lexi_value(text.as_bytes().get(1..).unwrap_or_default()))
}

/// The value of validated base-36 `digits`. Up to 24 digits fit a `u128` (36^24 < 2^128),
/// which covers every LSN; longer ones are summed as `U256`.
fn lexi_value(digits: &[u8]) -> U256 {
    let digit = |c: u8| digit_value(c).unwrap_or(0);
    if digits.len() <= 24 {
        let value = digits
            .iter()
            .fold(0u128, |value, &c| value * 36 + u128::from(digit(c)));
        return U256::from(value);
    }
    // Cannot overflow: at most 36 base-36 digits, far below 2^256.
    digits
        .iter()
        .fold(U256::ZERO, |value, &c| value * 36 + U256::from(digit(c)))
}

/// Checks that `text` is a canonical LexiVersion (any of the 36^36 values), without decoding.
pub fn validate_lexi(text: &str) -> Result<(), WatermarkError> {
    let bytes = text.as_bytes();
    let (&prefix, digits) = bytes.split_first().ok_or(WatermarkError::Empty)?;
    let declared = digit_value(prefix).ok_or_else(|| bad_digit(text))? as usize + 1;
    if let Some(&c) = digits.iter().find(|&&c| digit_value(c).is_none()) {
        return Err(WatermarkError::BadDigit {
            text: text.to_owned(),
            found: c as char,
        });
    }
    if digits.len() != declared {
        return Err(WatermarkError::LengthMismatch {
            text: text.to_owned(),
            declared,
            actual: digits.len(),
        });
    }
    if declared > 1 && digits[0] == b'0' {
        return Err(WatermarkError::LeadingZero {
            text: text.to_owned(),
        });
    }
    Ok(())
}

fn bad_digit(text: &str) -> WatermarkError {
    let found = text
        .chars()
        .find(|c| !c.is_ascii() || digit_value(*c as u8).is_none());
    WatermarkError::BadDigit {
        text: text.to_owned(),
        found: found.unwrap_or('?'),
    }
}

fn digit_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'z' => Some(c - b'a' + 10),
        _ => None,
    }
}

/// A Postgres WAL position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The watermark of this position: `lexi(lsn)`.
    pub fn to_watermark(self) -> Watermark {
        // Every u64 fits (36^36 > 2^64), so the empty fallback is never taken.
        let text = LexiText::new(U256::from(self.0));
        Watermark(text.as_ref().map_or("", LexiText::as_str).into())
    }
}

impl fmt::Display for Lsn {
    /// `H/L` in uppercase hex without padding, as Postgres prints it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xffff_ffff)
    }
}

impl FromStr for Lsn {
    type Err = WatermarkError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || WatermarkError::BadLsn {
            text: text.to_owned(),
        };
        let (hi, lo) = text.split_once('/').ok_or_else(bad)?;
        let part = |s: &str| {
            if s.is_empty() || s.len() > 8 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            u32::from_str_radix(s, 16).map_err(|_| bad())
        };
        Ok(Lsn(((part(hi)? as u64) << 32) | part(lo)? as u64))
    }
}

/// A decoded StateVersion: an upstream position plus an optional minor for auxiliary transactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StateVersion {
    pub major: U256,
    pub minor: Option<U256>,
}

impl StateVersion {
    pub fn major(major: U256) -> Self {
        StateVersion { major, minor: None }
    }

    /// The next auxiliary version after this one: `major.(minor + 1)`
    /// (`docs/protocol/change-stream.md`, "Watermarks").
    pub fn next_minor(self) -> Self {
        StateVersion {
            major: self.major,
            minor: Some(self.minor.unwrap_or(U256::ZERO) + 1),
        }
    }

    /// The watermark string, or `None` if a part exceeds 36 base-36 digits.
    pub fn to_watermark(self) -> Option<Watermark> {
        let major = LexiText::new(self.major)?;
        let Some(minor) = self.minor else {
            return Some(Watermark(major.as_str().into()));
        };
        let minor = LexiText::new(minor)?;
        Some(Watermark(
            format!("{}.{}", major.as_str(), minor.as_str()).into(),
        ))
    }
}

/// A watermark in its wire form: a canonical StateVersion string.
///
/// Ordering is string order, which by construction equals the numeric order of the versions.
/// The text is shared: the change streamer copies a commit's watermark to every subscriber it
/// is sent to, and a clone costs a count, not an allocation.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Watermark(Arc<str>);

impl Watermark {
    /// Validates `text` as `lexi(major)` or `lexi(major).lexi(minor)`.
    pub fn parse(text: &str) -> Result<Self, WatermarkError> {
        let (major, minor) = match text.split_once('.') {
            Some((major, minor)) => (major, Some(minor)),
            None => (text, None),
        };
        let bad = |_| WatermarkError::BadStateVersion {
            text: text.to_owned(),
        };
        validate_lexi(major).map_err(bad)?;
        if let Some(minor) = minor {
            validate_lexi(minor).map_err(bad)?;
        }
        Ok(Watermark(text.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0.to_string()
    }

    /// Decodes the StateVersion.
    pub fn state_version(&self) -> StateVersion {
        // Validated at construction: the digits follow the length prefix.
        let decode = |s: &str| lexi_value(s.as_bytes().get(1..).unwrap_or_default());
        match self.0.split_once('.') {
            Some((major, minor)) => StateVersion {
                major: decode(major),
                minor: Some(decode(minor)),
            },
            None => StateVersion {
                major: decode(&self.0),
                minor: None,
            },
        }
    }

    /// The LSN of the major part (the minor part has no LSN).
    pub fn to_lsn(&self) -> Result<Lsn, WatermarkError> {
        let major = self.0.split_once('.').map_or(&*self.0, |(major, _)| major);
        let major = lexi_value(major.as_bytes().get(1..).unwrap_or_default());
        if major > U256::from(u64::MAX) {
            return Err(WatermarkError::MajorTooLarge {
                text: self.0.to_string(),
            });
        }
        Ok(Lsn(major.as_u64()))
    }
}

impl fmt::Display for Watermark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Watermark {
    type Err = WatermarkError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Watermark::parse(text)
    }
}

impl From<Lsn> for Watermark {
    fn from(lsn: Lsn) -> Self {
        lsn.to_watermark()
    }
}

impl AsRef<str> for Watermark {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for Watermark {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Watermark {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl serde::Serialize for Watermark {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Watermark {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Watermark::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// Compares two watermark strings after validating both. String order is the order.
pub fn compare_watermarks(a: &str, b: &str) -> Result<Ordering, WatermarkError> {
    Ok(Watermark::parse(a)?.cmp(&Watermark::parse(b)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lexi_worked_examples_of_reference_6_1() {
        let table: &[(u128, &str)] = &[
            (0, "00"),
            (10, "0a"),
            (35, "0z"),
            (36, "110"),
            (46655, "2zzz"),
            (46656, "31000"),
            (1 << 32, "61z141z4"),
            ((1 << 53) - 1, "a2gosa7pa2gv"),
            (1 << 64, "c3w5e11264sgsg"),
        ];
        for &(value, lexi) in table {
            assert_eq!(encode_lexi(value), lexi, "encode {value}");
            assert_eq!(decode_lexi(lexi), Ok(U256::from(value)), "decode {lexi}");
        }
    }

    /// The encoding by plain `U256` division, digit by digit: what the `u64` fast path of
    /// [`LexiText`] must agree with.
    fn reference_lexi(value: U256) -> Option<String> {
        if value > U256::from(36u8).pow(36) - 1 {
            return None;
        }
        let (mut digits, mut v) = (Vec::new(), value);
        loop {
            digits.push(DIGITS[(v % U256::from(36u8)).as_usize()] as char);
            v /= U256::from(36u8);
            if v == U256::ZERO {
                break;
            }
        }
        let prefix = DIGITS[digits.len() - 1] as char;
        Some(
            std::iter::once(prefix)
                .chain(digits.into_iter().rev())
                .collect(),
        )
    }

    #[test]
    fn the_widest_lexi_value_is_36_to_the_36_minus_1() {
        assert_eq!(max_lexi_value(), U256::from(36u8).pow(36) - 1);
    }

    #[test]
    fn lexi_agrees_with_plain_division_at_the_64_bit_boundary() {
        let edge = U256::from(u64::MAX);
        for value in [
            U256::ZERO,
            edge - 1,
            edge,
            edge + 1,
            U256::from(u128::MAX),
            max_lexi_value(),
            max_lexi_value() + 1,
        ] {
            assert_eq!(try_encode_lexi(value), reference_lexi(value), "{value}");
        }
    }

    #[test]
    fn lexi_extremes() {
        let max = encode_lexi(u128::MAX);
        assert_eq!(decode_lexi(&max), Ok(U256::from(u128::MAX)));
        // 36^36 − 1, the widest LexiVersion, is beyond u128 and still round-trips.
        let widest = format!("z{}", "z".repeat(36));
        assert_eq!(decode_lexi(&widest), Ok(max_lexi_value()));
        assert_eq!(try_encode_lexi(max_lexi_value()), Some(widest.clone()));
        assert_eq!(try_encode_lexi(max_lexi_value() + 1), None);
        let w = Watermark::parse(&widest).expect("valid");
        assert!(matches!(
            w.to_lsn(),
            Err(WatermarkError::MajorTooLarge { .. })
        ));
    }

    #[test]
    fn lsn_worked_examples_of_reference_6_2() {
        let table: &[(&str, u64, &str)] = &[
            ("0/0", 0, "00"),
            ("0/A", 10, "0a"),
            ("0/16B3748", 23803720, "4e672g"),
            ("0/1A2B3C4D", 439041101, "579e6a5"),
            ("1/0", 4294967296, "61z141z4"),
            ("16/B374D848", 97500059720, "718sh0nk8"),
            ("FFFFFFFF/FFFFFFFF", u64::MAX, "c3w5e11264sgsf"),
        ];
        for &(text, value, wm) in table {
            let lsn: Lsn = text.parse().expect(text);
            assert_eq!(lsn, Lsn(value));
            assert_eq!(lsn.to_string(), text);
            assert_eq!(lsn.to_watermark(), wm);
            assert_eq!(Watermark::parse(wm).and_then(|w| w.to_lsn()), Ok(lsn));
        }
    }

    #[test]
    fn lsn_accepts_lowercase_and_prints_uppercase() {
        assert_eq!(
            "16/b374d848".parse::<Lsn>().map(|l| l.to_string()),
            Ok("16/B374D848".into())
        );
    }

    #[test]
    fn state_versions_of_reference_6_3() {
        let base = Watermark::parse("579e6a5").expect("valid");
        let sv = base.state_version();
        let first = sv.next_minor().to_watermark().expect("fits");
        let second = sv.next_minor().next_minor().to_watermark().expect("fits");
        assert_eq!(first, "579e6a5.01");
        assert_eq!(second, "579e6a5.02");
        let next_major = StateVersion::major(sv.major + 1)
            .to_watermark()
            .expect("fits");
        assert!(base < first && first < second && second < next_major);
        assert_eq!(first.to_lsn(), base.to_lsn());
        // Minor versions of lsn.test.ts.
        let minor = Watermark::parse("00.01").map(|w| w.state_version());
        assert_eq!(
            minor,
            Ok(StateVersion {
                major: U256::ZERO,
                minor: Some(U256::ONE)
            })
        );
        let w = Watermark::parse("718sh0nk8.123").expect("valid");
        assert_eq!(w.to_lsn().map(|l| l.to_string()), Ok("16/B374D848".into()));
    }

    #[test]
    fn invalid_strings_are_typed_errors() {
        assert_eq!(decode_lexi(""), Err(WatermarkError::Empty));
        assert!(matches!(
            decode_lexi("0A"),
            Err(WatermarkError::BadDigit { .. })
        ));
        assert!(matches!(
            decode_lexi("1a"),
            Err(WatermarkError::LengthMismatch { .. })
        ));
        assert!(matches!(
            decode_lexi("0ab"),
            Err(WatermarkError::LengthMismatch { .. })
        ));
        assert!(matches!(
            decode_lexi("101"),
            Err(WatermarkError::LeadingZero { .. })
        ));
        assert!(matches!(
            decode_lexi("é0"),
            Err(WatermarkError::BadDigit { .. })
        ));
        for bad in ["", ".", "00.", ".01", "00.01.01", "00..01", "0a-", " 00"] {
            assert!(
                matches!(
                    Watermark::parse(bad),
                    Err(WatermarkError::BadStateVersion { .. })
                ),
                "{bad:?}"
            );
        }
        for bad in [
            "",
            "0",
            "/",
            "0/",
            "/0",
            "G/0",
            "1/2/3",
            "123456789/0",
            "-1/0",
            "+1/0",
        ] {
            assert!(
                matches!(bad.parse::<Lsn>(), Err(WatermarkError::BadLsn { .. })),
                "{bad:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn lexi_agrees_with_plain_division(
            small in any::<u64>(),
            wide in any::<u128>(),
            widest in any::<[u64; 3]>(),
        ) {
            let widest = ((U256::from(widest[0]) << 128) + (U256::from(widest[1]) << 64)
                + U256::from(widest[2])) % (max_lexi_value() + 1);
            for value in [U256::from(small), U256::from(wide), widest] {
                let encoded = try_encode_lexi(value);
                prop_assert_eq!(&encoded, &reference_lexi(value));
                prop_assert_eq!(decode_lexi(&encoded.unwrap_or_default()), Ok(value));
            }
            prop_assert_eq!(Lsn(small).to_watermark().into_string(), encode_lexi(u128::from(small)));
        }

        #[test]
        fn lexi_round_trips(v in any::<u128>()) {
            prop_assert_eq!(decode_lexi(&encode_lexi(v)), Ok(U256::from(v)));
        }

        #[test]
        fn wide_lexi_round_trips_and_orders(a in any::<[u64; 3]>(), b in any::<[u64; 3]>()) {
            let wide = |x: [u64; 3]| {
                (U256::from(x[0]) << 128) + (U256::from(x[1]) << 64) + U256::from(x[2])
            };
            let (a, b) = (wide(a) % (max_lexi_value() + 1), wide(b) % (max_lexi_value() + 1));
            let (ea, eb) = (try_encode_lexi(a).unwrap_or_default(), try_encode_lexi(b).unwrap_or_default());
            prop_assert_eq!(decode_lexi(&ea), Ok(a));
            prop_assert_eq!(ea.cmp(&eb), a.cmp(&b));
        }

        #[test]
        fn lexi_string_order_is_numeric_order(a in any::<u128>(), b in any::<u128>()) {
            prop_assert_eq!(encode_lexi(a).cmp(&encode_lexi(b)), a.cmp(&b));
        }

        #[test]
        fn small_values_keep_order_too(a in 0u128..5000, b in 0u128..5000) {
            prop_assert_eq!(encode_lexi(a).cmp(&encode_lexi(b)), a.cmp(&b));
        }

        #[test]
        fn state_version_order_is_watermark_order(
            a in (any::<u64>(), proptest::option::of(0u128..1000)),
            b in (any::<u64>(), proptest::option::of(0u128..1000)),
        ) {
            let (a, b) = (
                StateVersion { major: U256::from(a.0), minor: a.1.map(U256::from) },
                StateVersion { major: U256::from(b.0), minor: b.1.map(U256::from) },
            );
            let (wa, wb) = (a.to_watermark().expect("fits"), b.to_watermark().expect("fits"));
            prop_assert_eq!(wa.cmp(&wb), a.cmp(&b));
            prop_assert_eq!(wa.state_version(), a);
        }

        #[test]
        fn lsn_text_round_trips(v in any::<u64>()) {
            let lsn = Lsn(v);
            prop_assert_eq!(lsn.to_string().parse::<Lsn>(), Ok(lsn));
            prop_assert_eq!(lsn.to_watermark().to_lsn(), Ok(lsn));
        }

        #[test]
        fn arbitrary_text_never_panics(s in "\\PC{0,40}") {
            let _ = Watermark::parse(&s);
            let _ = s.parse::<Lsn>();
        }
    }
}
