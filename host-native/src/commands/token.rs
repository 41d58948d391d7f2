//! `highwater token`: prints a development scope-sync token (HS256) signed with the
//! configured secret.

use std::time::Duration;

use crate::sync_auth::{mint_token, unix_now_ms, MintError, SyncSecretArgs};

/// Longest `--ttl`: development tokens should not outlive a year.
const MAX_TTL: Duration = Duration::from_secs(366 * 24 * 3600);

/// Command-line arguments of `highwater token`.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenArgs {
    /// The token's subject (`sub` claim): the user the rules compare conditions with.
    #[arg(long)]
    pub sub: String,
    /// How long the token is valid: a number with s, m, h or d.
    #[arg(long, default_value = "1h", value_parser = parse_ttl)]
    pub ttl: Duration,
    /// An extra string claim, `KEY=VALUE`; repeat for more.
    #[arg(long = "claim", value_name = "KEY=VALUE", value_parser = parse_claim)]
    pub claims: Vec<(String, String)>,
    #[command(flatten)]
    pub secret: SyncSecretArgs,
}

/// `highwater token`: prints a development token signed with the configured secret.
pub fn run(args: TokenArgs) -> Result<(), MintError> {
    let secret = args.secret.source().load()?;
    let token = mint_token(&secret, &args.sub, args.ttl, &args.claims, unix_now_ms())?;
    println!("{token}");
    Ok(())
}

fn parse_ttl(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let multiplier = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("expected a number with s, m, h or d, got {text:?}")),
    };
    let count: u64 = digits
        .parse()
        .map_err(|_| format!("expected a number with s, m, h or d, got {text:?}"))?;
    let ttl = Duration::from_secs(count.saturating_mul(multiplier));
    if ttl.is_zero() || ttl > MAX_TTL {
        return Err(format!("expected a ttl between 1s and 366d, got {text:?}"));
    }
    Ok(ttl)
}

fn parse_claim(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.trim().is_empty() => {
            Ok((key.trim().to_owned(), value.to_owned()))
        }
        _ => Err(format!("expected KEY=VALUE, got {text:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_and_claim_arguments_parse_strictly() {
        assert_eq!(parse_ttl("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_ttl("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_ttl("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_ttl("2d"), Ok(Duration::from_secs(172_800)));
        for bad in [
            "",
            "h",
            "0s",
            "1w",
            "-1h",
            "1.5h",
            "400d",
            "99999999999999999999d",
        ] {
            assert!(parse_ttl(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            parse_claim("org=a=b"),
            Ok(("org".to_owned(), "a=b".to_owned()))
        );
        assert_eq!(parse_claim("role="), Ok(("role".to_owned(), String::new())));
        assert!(parse_claim("novalue").is_err());
        assert!(parse_claim("=x").is_err());
    }
}
