use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use serde_json::json;

use super::*;

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef-test";
const NOW_MS: u64 = 1_800_000_000_000;
const RULES: &str = r#"{"tables":{
  "todos":{"filterColumns":["owner","done"],"omitColumns":["secret_note"],"require":{"owner":"sub"}},
  "announcements":{"filterColumns":["lang"]}
}}"#;

fn secret() -> SyncSecret {
    SyncSecret::from_bytes(SECRET).expect("long enough")
}

fn auth() -> SyncAuth {
    SyncAuth::new(SyncRules::from_json(RULES).expect("rules"), &secret())
}

fn map(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("expected an object, got {other}"),
    }
}

fn sign(alg: Algorithm, key: &[u8], claims: Value) -> String {
    let key = EncodingKey::from_secret(key).expect("a non-empty key");
    jsonwebtoken::encode(&Header::new(alg), &claims, &key).expect("signs")
}

/// A token for `sub` expiring `exp_in_s` seconds after [`NOW_MS`].
fn token_for(sub: &str, exp_in_s: i64) -> String {
    let exp = (NOW_MS / 1000) as i64 + exp_in_s;
    sign(Algorithm::HS256, SECRET, json!({"sub": sub, "exp": exp}))
}

fn ada_scope() -> Map<String, Value> {
    map(json!({"owner": "ada"}))
}

fn denied_code(result: Result<Grant, AuthDenied>) -> &'static str {
    result.expect_err("denied").code
}

#[test]
fn a_valid_token_for_its_own_scope_is_granted_with_its_expiry() {
    let grant = auth()
        .authorize(Some(&token_for("ada", 3600)), "todos", &ada_scope(), NOW_MS)
        .expect("granted");
    assert_eq!(
        grant,
        Grant {
            table: "todos".to_owned(),
            omit_columns: vec!["secret_note".to_owned()],
            expires_at_ms: Some(NOW_MS + 3_600_000 + EXP_LEEWAY_MS),
            row_filter: None,
        }
    );
}

#[test]
fn a_token_for_someone_else_is_forbidden() {
    let denied = auth()
        .authorize(
            Some(&token_for("grace", 3600)),
            "todos",
            &ada_scope(),
            NOW_MS,
        )
        .expect_err("grace may not read ada's todos");
    assert_eq!(denied.code, "forbidden");
    assert!(denied.message.contains("\"sub\""), "{denied}");
}

#[test]
fn rules_decide_tables_and_filter_columns_after_verification() {
    let auth = auth();
    let token = token_for("ada", 3600);
    let code = |table: &str, conditions: Value| {
        denied_code(auth.authorize(Some(&token), table, &map(conditions), NOW_MS))
    };
    assert_eq!(code("users", json!({"owner": "ada"})), "forbidden");
    assert_eq!(
        code("todos", json!({"owner": "ada", "secret_note": "x"})),
        "forbidden"
    );
    assert_eq!(code("todos", json!({"done": true})), "forbidden");
    // The require column needs an equality: a list, even of the claim alone, is no grant.
    assert_eq!(code("todos", json!({"owner": ["ada"]})), "forbidden");
    assert_eq!(
        code("todos", json!({"owner": {"like": "a%"}})),
        "invalid-params"
    );
    assert_eq!(code("", json!({})), "invalid-params");
    let grant = auth
        .authorize(
            Some(&token),
            "announcements",
            &map(json!({"lang": "en"})),
            NOW_MS,
        )
        .expect("a table without require is readable with any valid token");
    assert!(grant.omit_columns.is_empty());
}

#[test]
fn a_tampered_payload_fails_the_signature_check() {
    let ada = token_for("ada", 3600);
    let forged = sign(
        Algorithm::HS256,
        b"an attacker's own secret of 32 bytes....",
        json!({"sub": "grace", "exp": NOW_MS / 1000 + 3600}),
    );
    // grace's header and payload with ada's genuine signature.
    let (forged_body, _) = forged.rsplit_once('.').expect("three parts");
    let (_, ada_signature) = ada.rsplit_once('.').expect("three parts");
    let spliced = format!("{forged_body}.{ada_signature}");
    for token in [spliced, forged] {
        let denied = auth()
            .authorize(
                Some(&token),
                "todos",
                &map(json!({"owner": "grace"})),
                NOW_MS,
            )
            .expect_err("tampered");
        assert_eq!(denied.code, "auth-invalid");
        assert!(denied.message.contains("signature"), "{denied}");
    }
    let mut flipped = ada.clone();
    let last = flipped.pop().expect("non-empty");
    flipped.push(if last == 'A' { 'B' } else { 'A' });
    assert_eq!(
        denied_code(auth().authorize(Some(&flipped), "todos", &ada_scope(), NOW_MS)),
        "auth-invalid"
    );
}

#[test]
fn malformed_tokens_are_invalid_not_panics() {
    for token in ["x", "a.b", "a.b.c", "...", "eyJ.eyJ.sig", "\u{0}", "ä.ö.ü"] {
        assert_eq!(
            denied_code(auth().authorize(Some(token), "todos", &ada_scope(), NOW_MS)),
            "auth-invalid",
            "{token:?}"
        );
    }
    let huge = "a".repeat(MAX_TOKEN_BYTES + 1);
    let denied = auth()
        .authorize(Some(&huge), "todos", &ada_scope(), NOW_MS)
        .expect_err("too long");
    assert_eq!(denied.code, "auth-invalid");
    assert!(denied.message.contains("at most 8192 bytes"), "{denied}");
}

#[test]
fn expiry_is_checked_against_the_callers_clock_with_a_small_leeway() {
    let auth = auth();
    let check = |exp_in_s: i64| {
        auth.authorize(
            Some(&token_for("ada", exp_in_s)),
            "todos",
            &ada_scope(),
            NOW_MS,
        )
    };
    assert_eq!(denied_code(check(-31)), "auth-expired");
    assert_eq!(denied_code(check(-3600)), "auth-expired");
    // Within the clock-skew leeway the token still works.
    assert!(check(-29).is_ok());
    assert!(check(1).is_ok());
    // The same token is fine now and expired an hour later.
    let token = token_for("ada", 60);
    assert!(auth
        .authorize(Some(&token), "todos", &ada_scope(), NOW_MS)
        .is_ok());
    assert_eq!(
        denied_code(auth.authorize(Some(&token), "todos", &ada_scope(), NOW_MS + 3_600_000)),
        "auth-expired"
    );
}

#[test]
fn exp_and_nbf_are_strictly_typed_and_exp_is_required() {
    let auth = auth();
    let now_s = NOW_MS / 1000;
    let cases = [
        // A string exp must not count as "no exp" (the jsonwebtoken < 10.3 type confusion).
        (json!({"sub": "ada", "exp": "99999999999"}), "auth-invalid"),
        (json!({"sub": "ada"}), "auth-invalid"),
        (json!({"sub": "ada", "exp": null}), "auth-invalid"),
        (json!({"sub": "ada", "exp": -5}), "auth-invalid"),
        (
            json!({"sub": "ada", "exp": now_s + 60, "nbf": "0"}),
            "auth-invalid",
        ),
        (
            json!({"sub": "ada", "exp": now_s + 7200, "nbf": now_s + 3600}),
            "auth-invalid",
        ),
    ];
    for (claims, code) in cases {
        let token = sign(Algorithm::HS256, SECRET, claims.clone());
        assert_eq!(
            denied_code(auth.authorize(Some(&token), "todos", &ada_scope(), NOW_MS)),
            code,
            "{claims}"
        );
    }
    let fractional = sign(
        Algorithm::HS256,
        SECRET,
        json!({"sub": "ada", "exp": now_s as f64 + 10.5, "nbf": now_s - 10}),
    );
    let grant = auth
        .authorize(Some(&fractional), "todos", &ada_scope(), NOW_MS)
        .expect("a fractional NumericDate is valid");
    assert_eq!(grant.expires_at_ms, Some(NOW_MS + 10_500 + EXP_LEEWAY_MS));
}

#[test]
fn only_hs256_is_accepted() {
    let claims = json!({"sub": "ada", "exp": NOW_MS / 1000 + 3600});
    for alg in [Algorithm::HS384, Algorithm::HS512] {
        let denied = auth()
            .authorize(
                Some(&sign(alg, SECRET, claims.clone())),
                "todos",
                &ada_scope(),
                NOW_MS,
            )
            .expect_err("other algorithm");
        assert_eq!(denied.code, "auth-invalid");
        assert!(denied.message.contains("HS256"), "{denied}");
    }
    let part = |value: Value| URL_SAFE_NO_PAD.encode(value.to_string());
    let payload = part(claims.clone());
    for header in [
        json!({"alg": "none", "typ": "JWT"}),
        json!({"alg": "None"}),
        json!({"typ": "JWT"}),
        json!({"alg": "RS256"}),
    ] {
        let unsigned = format!("{}.{payload}.", part(header.clone()));
        assert_eq!(
            denied_code(auth().authorize(Some(&unsigned), "todos", &ada_scope(), NOW_MS)),
            "auth-invalid",
            "{header}"
        );
    }
}

#[test]
fn a_missing_token_is_required_unless_the_table_needs_no_claims() {
    let auth = auth();
    for token in [None, Some("")] {
        let denied = auth
            .authorize(token, "todos", &ada_scope(), NOW_MS)
            .expect_err("todos needs a token");
        assert_eq!(denied.code, "auth-required");
        // An anonymous caller cannot tell an unlisted table from one that needs a token.
        assert_eq!(
            denied_code(auth.authorize(token, "users", &Map::new(), NOW_MS)),
            "auth-required"
        );
        let grant = auth
            .authorize(token, "announcements", &map(json!({"lang": "en"})), NOW_MS)
            .expect("open table");
        assert_eq!(grant.expires_at_ms, None);
        assert_eq!(
            denied_code(auth.authorize(token, "announcements", &map(json!({"x": 1})), NOW_MS)),
            "forbidden"
        );
        assert_eq!(
            denied_code(auth.authorize(
                token,
                "todos",
                &map(json!({"owner": {"like": "a%"}})),
                NOW_MS
            )),
            "invalid-params"
        );
    }
}

#[test]
fn a_present_token_is_verified_even_where_none_is_needed() {
    let open = map(json!({"lang": "en"}));
    assert_eq!(
        denied_code(auth().authorize(Some("garbage"), "announcements", &open, NOW_MS)),
        "auth-invalid"
    );
    assert_eq!(
        denied_code(auth().authorize(
            Some(&token_for("ada", -3600)),
            "announcements",
            &open,
            NOW_MS
        )),
        "auth-expired"
    );
}

#[test]
fn debug_output_never_holds_the_secret() {
    let secret_text = std::str::from_utf8(SECRET).expect("ascii");
    for text in [
        format!("{:?}", auth()),
        format!("{:?}", secret()),
        format!("{:?}", SecretSource::Secret(secret())),
    ] {
        assert!(!text.contains(secret_text), "{text}");
        assert!(!text.contains("0123456789abcdef"), "{text}");
        assert!(text.contains("redacted"), "{text}");
    }
}

#[test]
fn secrets_load_from_a_file_and_short_or_missing_ones_are_refused() {
    let dir = std::env::temp_dir().join(format!("highwater-sync-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("secret");
    std::fs::write(&file, [SECRET, b"\n"].concat()).expect("write");
    let loaded = SecretSource::file_or_env(Some(&file))
        .load()
        .expect("loads");
    let token = mint_token(&loaded, "ada", Duration::from_secs(60), &[], NOW_MS).expect("mints");
    assert!(
        auth().verify(&token, NOW_MS).is_ok(),
        "the trailing line end is not part of the secret"
    );

    std::fs::write(&file, b"short\n").expect("write");
    assert!(matches!(
        SecretSource::File(file.clone()).load(),
        Err(AuthConfigError::SecretTooShort)
    ));
    let missing = SecretSource::File(dir.join("absent"))
        .load()
        .expect_err("absent");
    assert!(missing.to_string().contains("absent"), "{missing}");

    let unset = SecretSource::Env("HIGHWATER_TEST_SECRET_NEVER_SET_7f3a".to_owned())
        .load()
        .expect_err("unset");
    assert!(
        unset
            .to_string()
            .contains("HIGHWATER_TEST_SECRET_NEVER_SET_7f3a"),
        "{unset}"
    );
    assert!(matches!(
        SecretSource::file_or_env(None),
        SecretSource::Env(var) if var == SYNC_SECRET_ENV
    ));
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn load_reads_the_rules_file_and_names_it_in_errors() {
    let dir = std::env::temp_dir().join(format!("highwater-sync-rules-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let rules = dir.join("rules.json");
    std::fs::write(&rules, RULES).expect("write");
    // By reference or by value: the server may keep its source for a later reload.
    let source = SecretSource::Secret(secret());
    let auth = SyncAuth::load(&rules, &source).expect("loads");
    assert_eq!(
        auth.filter_columns()["todos"],
        ["owner".to_owned(), "done".to_owned()]
    );
    assert!(auth
        .authorize(Some(&token_for("ada", 60)), "todos", &ada_scope(), NOW_MS)
        .is_ok());

    std::fs::write(&rules, r#"{"tables":{"todos":{"filterColumns":[1]}}}"#).expect("write");
    let error = SyncAuth::load(&rules, source).expect_err("bad rules");
    assert!(error.to_string().contains("rules.json"), "{error}");
    let source = std::error::Error::source(&error)
        .expect("has a source")
        .to_string();
    assert!(source.contains("tables.todos.filterColumns[0]"), "{source}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn minted_tokens_verify_and_carry_their_claims() {
    let extra = vec![("org".to_owned(), "42".to_owned())];
    let token =
        mint_token(&secret(), "ada", Duration::from_secs(600), &extra, NOW_MS).expect("mints");
    let verified = auth().verify(&token, NOW_MS).expect("verifies");
    assert_eq!(verified.claims["sub"], json!("ada"));
    assert_eq!(verified.claims["org"], json!("42"));
    assert_eq!(verified.claims["iat"], json!(NOW_MS / 1000));
    assert_eq!(verified.expires_at_ms, NOW_MS + 600_000 + EXP_LEEWAY_MS);
    assert_eq!(
        auth()
            .verify(&token, NOW_MS + 700_000)
            .expect_err("expired")
            .code,
        "auth-expired"
    );
    for key in ["sub", "exp", "iat", "nbf"] {
        let extra = vec![(key.to_owned(), "x".to_owned())];
        assert!(matches!(
            mint_token(&secret(), "ada", Duration::from_secs(1), &extra, NOW_MS),
            Err(MintError::ReservedClaim { .. })
        ));
    }
    let twice = vec![
        ("a".to_owned(), "1".to_owned()),
        ("a".to_owned(), "2".to_owned()),
    ];
    assert!(matches!(
        mint_token(&secret(), "ada", Duration::from_secs(1), &twice, NOW_MS),
        Err(MintError::DuplicateClaim { .. })
    ));
}
