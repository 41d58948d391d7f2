//! Scope-sync authorization on the host: the JWT that comes with a subscription is verified here
//! (HS256 only, with the `jsonwebtoken` crate), and the verified claims go to the engine's
//! rules ([`highwater_engine::scope_sync::rules`]) for the decision.
//!
//! The server calls [`SyncAuth::authorize`] once per `channel-subscribe`. On `Ok(grant)` it
//! serves `grant.table`, strips `grant.omit_columns` from every row, and ends the subscription
//! with `auth-expired` once `now_ms` passes `grant.expires_at_ms`. On `Err(denied)` it answers
//! `channel-error` with `denied.code` and `denied.message`, and sends no rows.
//!
//! The secret comes from `--sync-secret-file FILE` or the environment variable
//! [`SYNC_SECRET_ENV`], never from a command-line value, and no `Debug` output, error or
//! message here holds it or a token.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use highwater_engine::scope_sync::rules::{DenialCode, SyncRules};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde_json::{Map, Value};

pub(crate) use highwater_engine::scope_sync::rules::{Denial, Grant};
pub use rules_file::RulesFileError;
pub(crate) use rules_file::{parse_rules, RulesFormat};

mod rules_file;

/// The environment variable holding the token secret when no `--sync-secret-file` is given.
pub const SYNC_SECRET_ENV: &str = "HIGHWATER_SYNC_SECRET";
/// Shorter HS256 secrets are refused: a guessable secret lets anyone mint tokens.
pub(crate) const MIN_SECRET_BYTES: usize = 32;
/// Clock skew allowed between the token issuer and this server, on `exp` and `nbf`.
pub(crate) const EXP_LEEWAY_MS: u64 = 30_000;
/// Longer tokens are refused before they are decoded.
pub(crate) const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// `channel-error` code: no token, and the rules need one.
pub(crate) const AUTH_REQUIRED: &str = "auth-required";
/// `channel-error` code: bad signature, malformed token, or an algorithm other than HS256.
pub(crate) const AUTH_INVALID: &str = "auth-invalid";
/// `channel-error` code: the token's `exp` has passed.
pub(crate) const AUTH_EXPIRED: &str = "auth-expired";

/// A subscription refused: the stable `channel-error` code and a message for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct AuthDenied {
    /// One of `auth-required`, `auth-invalid`, `auth-expired`, `forbidden`, `invalid-params`.
    pub code: &'static str,
    pub message: String,
}

impl AuthDenied {
    fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl From<Denial> for AuthDenied {
    fn from(denial: Denial) -> Self {
        Self::new(denial.code.as_str(), denial.message)
    }
}

/// The token secret, as the keys that sign and verify with it. Its `Debug` is redacted.
#[derive(Clone)]
pub struct SyncSecret {
    encoding: EncodingKey,
    decoding: DecodingKey,
}

impl SyncSecret {
    /// A secret from its bytes; fewer than [`MIN_SECRET_BYTES`] is refused.
    pub fn from_bytes(bytes: impl AsRef<[u8]>) -> Result<Self, AuthConfigError> {
        let bytes = bytes.as_ref();
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(AuthConfigError::SecretTooShort);
        }
        // Both constructors fail only on an empty secret, excluded above.
        let short = |_| AuthConfigError::SecretTooShort;
        Ok(Self {
            encoding: EncodingKey::from_secret(bytes).map_err(short)?,
            decoding: DecodingKey::from_secret(bytes).map_err(short)?,
        })
    }

    fn from_text(mut bytes: Vec<u8>) -> Result<Self, AuthConfigError> {
        // `echo secret > file` and `export VAR=$(cat file)` differ only by the line end.
        while matches!(bytes.last(), Some(b'\n' | b'\r')) {
            bytes.pop();
        }
        Self::from_bytes(bytes)
    }
}

impl fmt::Debug for SyncSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SyncSecret(<redacted>)")
    }
}

/// Where the token secret comes from.
#[derive(Clone)]
pub enum SecretSource {
    /// A file holding the secret (one trailing line end is ignored).
    File(PathBuf),
    /// An environment variable, normally [`SYNC_SECRET_ENV`].
    Env(String),
    /// A secret already in memory (tests, embedding).
    Secret(SyncSecret),
}

impl SecretSource {
    /// The file when given, else the environment variable [`SYNC_SECRET_ENV`].
    pub(crate) fn file_or_env(file: Option<&Path>) -> Self {
        match file {
            Some(path) => Self::File(path.to_owned()),
            None => Self::Env(SYNC_SECRET_ENV.to_owned()),
        }
    }

    /// Reads the secret.
    pub fn load(&self) -> Result<SyncSecret, AuthConfigError> {
        match self {
            Self::File(path) => {
                let bytes = std::fs::read(path).map_err(|source| AuthConfigError::ReadSecret {
                    path: path.clone(),
                    source,
                })?;
                SyncSecret::from_text(bytes)
            }
            Self::Env(var) => match std::env::var(var) {
                Ok(text) => SyncSecret::from_text(text.into_bytes()),
                Err(std::env::VarError::NotPresent) => {
                    Err(AuthConfigError::SecretNotSet { var: var.clone() })
                }
                Err(std::env::VarError::NotUnicode(_)) => {
                    Err(AuthConfigError::SecretNotUnicode { var: var.clone() })
                }
            },
            Self::Secret(secret) => Ok(secret.clone()),
        }
    }
}

impl fmt::Debug for SecretSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => f.debug_tuple("File").field(path).finish(),
            Self::Env(var) => f.debug_tuple("Env").field(var).finish(),
            Self::Secret(secret) => f.debug_tuple("Secret").field(secret).finish(),
        }
    }
}

impl From<&SecretSource> for SecretSource {
    fn from(source: &SecretSource) -> Self {
        source.clone()
    }
}

impl From<SyncSecret> for SecretSource {
    fn from(secret: SyncSecret) -> Self {
        Self::Secret(secret)
    }
}

impl From<&SyncSecretArgs> for SecretSource {
    fn from(args: &SyncSecretArgs) -> Self {
        args.source()
    }
}

impl From<SyncSecretArgs> for SecretSource {
    fn from(args: SyncSecretArgs) -> Self {
        args.source()
    }
}

/// The secret option shared by `serve` and `token`; flatten it into a command's arguments.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SyncSecretArgs {
    /// File holding the HS256 secret that signs sync tokens (at least 32 bytes). Without it
    /// the secret is read from the environment variable HIGHWATER_SYNC_SECRET.
    #[arg(long, value_name = "FILE", env = "HIGHWATER_SYNC_SECRET_FILE")]
    pub sync_secret_file: Option<PathBuf>,
}

impl SyncSecretArgs {
    /// The file when given, else [`SYNC_SECRET_ENV`].
    pub fn source(&self) -> SecretSource {
        SecretSource::file_or_env(self.sync_secret_file.as_deref())
    }
}

/// Why the rules or the secret could not be loaded. No variant holds the secret.
#[derive(Debug, thiserror::Error)]
pub enum AuthConfigError {
    #[error("could not read the sync rules file {}", path.display())]
    ReadRules {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the sync rules file {} is not valid", path.display())]
    Rules {
        path: PathBuf,
        #[source]
        source: RulesFileError,
    },
    #[error("could not read the sync secret file {}", path.display())]
    ReadSecret {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("expected the sync token secret in --sync-secret-file FILE or the environment variable {var}, found neither")]
    SecretNotSet { var: String },
    #[error("expected the environment variable {var} to be valid UTF-8")]
    SecretNotUnicode { var: String },
    #[error("expected a sync token secret of at least {MIN_SECRET_BYTES} bytes, got a shorter one (make one with `openssl rand -base64 48`)")]
    SecretTooShort,
}

/// Reads a sync rules file, JSON or YAML by its name or its first character (see
/// [`RulesFormat::of`]).
pub(crate) fn read_rules(path: &Path) -> Result<SyncRules, AuthConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| AuthConfigError::ReadRules {
        path: path.to_owned(),
        source,
    })?;
    // Some editors start a UTF-8 file with a byte order mark; JSON parsers refuse it.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    parse_rules(text, RulesFormat::of(path, text)).map_err(|source| AuthConfigError::Rules {
        path: path.to_owned(),
        source,
    })
}

/// The claims of a verified token.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifiedToken {
    pub claims: Map<String, Value>,
    /// The instant after which the token is refused: `exp` plus [`EXP_LEEWAY_MS`].
    pub expires_at_ms: u64,
}

/// The sync rules and the key that verifies tokens. Its `Debug` omits the key.
pub struct SyncAuth {
    rules: SyncRules,
    key: DecodingKey,
    validation: Validation,
}

impl fmt::Debug for SyncAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncAuth")
            .field("rules", &self.rules)
            .field("key", &"<redacted>")
            .finish()
    }
}

impl SyncAuth {
    /// Reads the rules file (`serve --sync-rules FILE`, see [`read_rules`]) and the secret.
    pub fn load(
        rules_path: impl AsRef<Path>,
        secret: impl Into<SecretSource>,
    ) -> Result<Self, AuthConfigError> {
        let rules = read_rules(rules_path.as_ref())?;
        Ok(Self::new(rules, &secret.into().load()?))
    }

    /// From rules and a secret already loaded.
    pub fn new(rules: SyncRules, secret: &SyncSecret) -> Self {
        let mut validation = Validation::new(Algorithm::HS256);
        // `exp` and `nbf` are checked below against the caller's clock, and strictly typed:
        // a claim of the wrong type is an invalid token, never a missing one.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.validate_aud = false;
        validation.required_spec_claims.clear();
        Self {
            rules,
            key: secret.decoding.clone(),
            validation,
        }
    }

    /// The rules in force.
    pub fn rules(&self) -> &SyncRules {
        &self.rules
    }

    /// The columns a scope may filter on, per table: the server indexes these.
    pub(crate) fn filter_columns(&self) -> BTreeMap<String, Vec<String>> {
        self.rules.filter_columns()
    }

    /// Decides a subscription: verifies `token` (when given) at `now_ms`, then applies the
    /// rules to `resource_type` and `conditions`.
    ///
    /// A token that is present is always verified, even for a table that needs none. Without
    /// a token, only a table whose rules require no claim is readable; any other scope gets
    /// `auth-required`, so an anonymous caller learns nothing about which tables exist.
    pub fn authorize(
        &self,
        token: Option<&str>,
        resource_type: &str,
        conditions: &Map<String, Value>,
        now_ms: u64,
    ) -> Result<Grant, AuthDenied> {
        match token.filter(|token| !token.is_empty()) {
            Some(token) => {
                let verified = self.verify(token, now_ms)?;
                Ok(self.rules.decide(
                    &verified.claims,
                    resource_type,
                    conditions,
                    Some(verified.expires_at_ms),
                )?)
            }
            None => {
                let anonymous = self
                    .rules
                    .decide(&Map::new(), resource_type, conditions, None);
                let open = self
                    .rules
                    .table(resource_type)
                    .is_some_and(|table| !table.needs_claims());
                match anonymous {
                    Ok(grant) => Ok(grant),
                    Err(denial) if open || denial.code == DenialCode::InvalidParams => {
                        Err(denial.into())
                    }
                    Err(_) => Err(AuthDenied::new(
                        AUTH_REQUIRED,
                        "expected an authenticationToken in the subscribe params, got none",
                    )),
                }
            }
        }
    }

    /// Verifies a token's signature (HS256 only) and its `exp` (required) and `nbf` (when
    /// present) against `now_ms`, allowing [`EXP_LEEWAY_MS`] of clock skew.
    pub fn verify(&self, token: &str, now_ms: u64) -> Result<VerifiedToken, AuthDenied> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(AuthDenied::new(
                AUTH_INVALID,
                format!(
                    "expected a token of at most {MAX_TOKEN_BYTES} bytes, got {} bytes",
                    token.len()
                ),
            ));
        }
        let header = jsonwebtoken::decode_header(token).map_err(|error| {
            AuthDenied::new(
                AUTH_INVALID,
                format!(
                    "expected a JWT signed with HS256, got an unreadable token header ({error})"
                ),
            )
        })?;
        if header.alg != Algorithm::HS256 {
            return Err(AuthDenied::new(
                AUTH_INVALID,
                format!("expected a JWT signed with HS256, got {:?}", header.alg),
            ));
        }
        let data = jsonwebtoken::decode::<Map<String, Value>>(token, &self.key, &self.validation)
            .map_err(|error| {
            let message = match error.kind() {
                jsonwebtoken::errors::ErrorKind::InvalidSignature => {
                    "the token's signature does not match the server's secret".to_owned()
                }
                _ => format!("expected a valid JWT, got one that fails to decode ({error})"),
            };
            AuthDenied::new(AUTH_INVALID, message)
        })?;
        let claims = data.claims;
        let exp_ms = match claims.get("exp") {
            Some(value) => numeric_date_ms(value, "exp")?,
            None => {
                return Err(AuthDenied::new(
                    AUTH_INVALID,
                    "expected the token to carry an exp claim, got none",
                ))
            }
        };
        let expires_at_ms = exp_ms.saturating_add(EXP_LEEWAY_MS);
        if now_ms > expires_at_ms {
            return Err(AuthDenied::new(AUTH_EXPIRED, "the token has expired"));
        }
        if let Some(value) = claims.get("nbf") {
            let nbf_ms = numeric_date_ms(value, "nbf")?;
            if now_ms.saturating_add(EXP_LEEWAY_MS) < nbf_ms {
                return Err(AuthDenied::new(
                    AUTH_INVALID,
                    "the token is not valid yet (its nbf is in the future)",
                ));
            }
        }
        Ok(VerifiedToken {
            claims,
            expires_at_ms,
        })
    }
}

/// A JWT NumericDate (seconds since the epoch, a non-negative number) in milliseconds.
fn numeric_date_ms(value: &Value, claim: &str) -> Result<u64, AuthDenied> {
    let invalid = || {
        AuthDenied::new(
            AUTH_INVALID,
            format!(
                "expected the token's {claim} claim to be a non-negative number of seconds, got {}",
                kind(value)
            ),
        )
    };
    let Value::Number(number) = value else {
        return Err(invalid());
    };
    if let Some(seconds) = number.as_u64() {
        return Ok(seconds.saturating_mul(1000));
    }
    match number.as_f64() {
        // `as` saturates: a date beyond u64 milliseconds is simply far in the future.
        Some(seconds) if seconds.is_finite() && seconds >= 0.0 => Ok((seconds * 1000.0) as u64),
        _ => Err(invalid()),
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a negative or out-of-range number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Why a token could not be minted.
#[derive(Debug, thiserror::Error)]
pub enum MintError {
    #[error(transparent)]
    Config(#[from] AuthConfigError),
    #[error("expected --claim {key}=… to name a claim other than sub, exp, iat and nbf")]
    ReservedClaim { key: String },
    #[error("expected each --claim key once, got {key} twice")]
    DuplicateClaim { key: String },
    #[error("could not sign the token")]
    Sign(#[source] jsonwebtoken::errors::Error),
}

/// Signs an HS256 token for `sub` valid for `ttl` from `now_ms`, with extra string claims.
/// Claims: `sub`, `iat`, `exp` (seconds) and each of `extra`.
pub fn mint_token(
    secret: &SyncSecret,
    sub: &str,
    ttl: Duration,
    extra: &[(String, String)],
    now_ms: u64,
) -> Result<String, MintError> {
    let now_s = now_ms / 1000;
    let mut claims = Map::new();
    claims.insert("sub".to_owned(), Value::from(sub));
    claims.insert("iat".to_owned(), Value::from(now_s));
    claims.insert(
        "exp".to_owned(),
        Value::from(now_s.saturating_add(ttl.as_secs())),
    );
    for (key, value) in extra {
        if matches!(key.as_str(), "sub" | "exp" | "iat" | "nbf") {
            return Err(MintError::ReservedClaim { key: key.clone() });
        }
        if claims
            .insert(key.clone(), Value::from(value.as_str()))
            .is_some()
        {
            return Err(MintError::DuplicateClaim { key: key.clone() });
        }
    }
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &secret.encoding)
        .map_err(MintError::Sign)
}

/// Milliseconds since the Unix epoch by the system clock.
pub fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

#[cfg(test)]
mod tests;
