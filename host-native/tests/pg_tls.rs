//! TLS to Postgres (`sslmode`, `sslrootcert`) on the hand-written replication connection and on
//! tokio-postgres connections, against a private Postgres whose certificates the test makes.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use highwater_host::private_pg::{PgOptions, PrivatePg};
use highwater_host::replication::{ConnectParams, ReplicationConnection, ReplicationError};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// A CA and a server certificate it signed for `localhost` only.
struct Certs {
    ca_pem: String,
    server_pem: String,
    server_key_pem: String,
}

fn make_certs() -> Certs {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "highwater test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&server_key, &ca)
        .unwrap();
    Certs {
        ca_pem: ca.pem(),
        server_pem: server.pem(),
        server_key_pem: server_key.serialize_pem(),
    }
}

/// A CA that signed nothing the server holds.
fn other_ca_pem() -> String {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap())
        .unwrap()
        .pem()
}

/// A private server where `pw_user` logs in with a cleartext password over TCP, and
/// `scram_user` with SCRAM.
async fn server() -> PrivatePg {
    let hba = ["all", "replication"]
        .iter()
        .flat_map(|db| {
            [
                format!("host {db} pw_user 127.0.0.1/32 password"),
                format!("host {db} scram_user 127.0.0.1/32 scram-sha-256"),
            ]
        })
        .collect();
    let pg = PrivatePg::start(PgOptions {
        hba_lines: hba,
        settings: vec![],
    })
    .await
    .unwrap();
    pg.connect()
        .await
        .unwrap()
        .batch_execute(
            "CREATE ROLE pw_user LOGIN REPLICATION PASSWORD 'pw secret';
             SET password_encryption = 'scram-sha-256';
             CREATE ROLE scram_user LOGIN PASSWORD 'scram secret';",
        )
        .await
        .unwrap();
    pg
}

/// Turns TLS on: the certificate and key go into the data directory, owned like it.
async fn enable_tls(pg: &PrivatePg, certs: &Certs) {
    let data = pg.data_dir();
    let owner = std::fs::metadata(&data).unwrap();
    for (name, text) in [
        ("server.crt", &certs.server_pem),
        ("server.key", &certs.server_key_pem),
    ] {
        let path = data.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(&path, Some(owner.uid()), Some(owner.gid())).unwrap();
    }
    let admin = pg.connect().await.unwrap();
    admin
        .batch_execute("ALTER SYSTEM SET ssl = on")
        .await
        .unwrap();
    admin.simple_query("SELECT pg_reload_conf()").await.unwrap();
    for _ in 0..100 {
        let row = admin.query_one("SHOW ssl", &[]).await.unwrap();
        if row.get::<_, String>(0) == "on" {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("ssl did not turn on");
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A directory of the test's own. The tests of this file run in one process at once, so the
/// process id alone would give them one directory, and the first to finish would remove the
/// other's certificates.
fn scratch(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!("highwater-pg-tls-{}-{test}", std::process::id()))
}

fn url(pg: &PrivatePg, host: &str, user: &str, query: &str) -> String {
    format!("postgres://{user}@{host}:{}/postgres?{query}", pg.port())
}

async fn replication(url: &str) -> Result<ReplicationConnection, ReplicationError> {
    let params: ConnectParams = url.parse()?;
    ReplicationConnection::connect(&params).await
}

/// Whether the backend `pid` talks TLS.
async fn is_encrypted(pg: &PrivatePg, pid: i32) -> bool {
    let admin = pg.connect().await.unwrap();
    admin
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = $1", &[&pid])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_and_sslrootcert_govern_every_postgres_connection() {
    let pg = server().await;
    let dir = scratch("sslmode");
    let certs = make_certs();
    let ca = write(&dir, "ca.pem", &certs.ca_pem);
    let wrong_ca = write(&dir, "other-ca.pem", &other_ca_pem());
    let ca = ca.display();
    let wrong_ca = wrong_ca.display();

    // Without TLS on the server: require fails clearly, prefer falls back to plain TCP, and a
    // cleartext password is refused there unless sslmode=disable says so.
    let error = replication(&url(&pg, "127.0.0.1", "postgres", "sslmode=require"))
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("does not accept TLS"), "{error}");
    let plain = replication(&url(&pg, "127.0.0.1", "postgres", "sslmode=prefer"))
        .await
        .unwrap();
    assert!(!is_encrypted(&pg, plain.backend_pid()).await);
    let error = replication(&url(
        &pg,
        "127.0.0.1",
        "pw_user:pw%20secret",
        "sslmode=prefer",
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(error.contains("cleartext password"), "{error}");
    replication(&url(
        &pg,
        "127.0.0.1",
        "pw_user:pw%20secret",
        "sslmode=disable",
    ))
    .await
    .expect("sslmode=disable allows a cleartext password");
    // The same on tokio-postgres query connections: prefer over plain TCP refuses to answer
    // a cleartext-password request, disable answers it, and SCRAM still works under prefer.
    let query = |user: &str, query: &str| -> ConnectParams {
        url(&pg, "127.0.0.1", user, query).parse().unwrap()
    };
    let error = query("pw_user:pw%20secret", "sslmode=prefer")
        .upstream()
        .connect()
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(error, ReplicationError::Auth { .. }), "{error}");
    let error = error.to_string();
    assert!(error.contains("cleartext password"), "{error}");
    assert!(error.contains("sslmode=disable"), "{error}");
    for (user, mode) in [
        ("pw_user:pw%20secret", "sslmode=disable"),
        ("scram_user:scram%20secret", "sslmode=prefer"),
    ] {
        let (client, connection) = query(user, mode)
            .upstream()
            .connect()
            .await
            .unwrap_or_else(|e| panic!("{user} with {mode}: {e}"));
        tokio::spawn(connection);
        let one: i32 = client.query_one("SELECT 1", &[]).await.unwrap().get(0);
        assert_eq!(one, 1);
    }

    enable_tls(&pg, &certs).await;

    // verify-full with the right CA and host name: encrypted, and the password may go.
    let full = format!("sslmode=verify-full&sslrootcert={ca}");
    let conn = replication(&url(&pg, "localhost", "pw_user:pw%20secret", &full))
        .await
        .expect("verify-full with the right CA");
    assert!(is_encrypted(&pg, conn.backend_pid()).await);
    // prefer now encrypts too.
    let preferred = replication(&url(
        &pg,
        "127.0.0.1",
        "pw_user:pw%20secret",
        "sslmode=prefer",
    ))
    .await
    .unwrap();
    assert!(is_encrypted(&pg, preferred.backend_pid()).await);
    // The wrong CA, or a host name the certificate does not name, fail clearly.
    let error = replication(&url(
        &pg,
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={wrong_ca}"),
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(error.contains("TLS handshake failed"), "{error}");
    assert!(
        error.to_lowercase().contains("unknownissuer") || error.contains("issuer"),
        "{error}"
    );
    let error = replication(&url(&pg, "127.0.0.1", "postgres", &full))
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("not valid for name"), "{error}");
    // verify-ca checks the chain but not the name.
    replication(&url(
        &pg,
        "127.0.0.1",
        "postgres",
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    ))
    .await
    .expect("verify-ca ignores the host name");
    assert!(replication(&url(
        &pg,
        "127.0.0.1",
        "postgres",
        &format!("sslmode=verify-ca&sslrootcert={wrong_ca}"),
    ))
    .await
    .is_err());

    // Ordinary tokio-postgres connections follow the same settings.
    let params: ConnectParams = url(&pg, "localhost", "pw_user:pw%20secret", &full)
        .parse()
        .unwrap();
    let (client, connection) = params.upstream().connect().await.expect("query connection");
    tokio::spawn(connection);
    let encrypted: bool = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(encrypted);
    let params: ConnectParams = url(
        &pg,
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={wrong_ca}"),
    )
    .parse()
    .unwrap();
    assert!(params.upstream().connect().await.is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A client certificate and key for `user`, signed by `ca`, written into `dir`.
fn client_cert(dir: &Path, ca: &CertifiedIssuer<'_, KeyPair>, user: &str) -> (PathBuf, PathBuf) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, user);
    let cert = params.signed_by(&key, ca).unwrap();
    let cert_path = write(dir, &format!("{user}.crt"), &cert.pem());
    let key_path = write(dir, &format!("{user}.key"), &key.serialize_pem());
    (cert_path, key_path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_from_sslcert_and_sslkey_satisfy_clientcert_verify_full() {
    // Over TLS, `cert_user` needs a certificate the server's CA signed, naming it.
    let hba = ["all", "replication"]
        .iter()
        .map(|db| format!("hostssl {db} cert_user 127.0.0.1/32 trust clientcert=verify-full"))
        .collect();
    let pg = PrivatePg::start(PgOptions {
        hba_lines: hba,
        settings: vec![],
    })
    .await
    .unwrap();
    pg.connect()
        .await
        .unwrap()
        .batch_execute("CREATE ROLE cert_user LOGIN REPLICATION")
        .await
        .unwrap();
    let dir = scratch("client-certs");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "highwater client test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&server_key, &ca)
        .unwrap();
    let certs = Certs {
        ca_pem: ca.pem(),
        server_pem: server.pem(),
        server_key_pem: server_key.serialize_pem(),
    };
    // The server checks client certificates against the same CA.
    let data = pg.data_dir();
    let owner = std::fs::metadata(&data).unwrap();
    let root = data.join("root.crt");
    std::fs::write(&root, &certs.ca_pem).unwrap();
    std::os::unix::fs::chown(&root, Some(owner.uid()), Some(owner.gid())).unwrap();
    pg.connect()
        .await
        .unwrap()
        .batch_execute("ALTER SYSTEM SET ssl_ca_file = 'root.crt'")
        .await
        .unwrap();
    enable_tls(&pg, &certs).await;
    let ca_file = write(&dir, "ca.pem", &certs.ca_pem);
    let (cert, key) = client_cert(&dir, &ca, "cert_user");
    let (other_cert, other_key) = client_cert(&dir, &ca, "someone_else");
    let query = |extra: &str| {
        format!(
            "sslmode=verify-full&sslrootcert={}{extra}",
            ca_file.display()
        )
    };
    let with_cert = query(&format!(
        "&sslcert={}&sslkey={}",
        cert.display(),
        key.display()
    ));

    // With the certificate: the replication connection and a query connection get in.
    let conn = replication(&url(&pg, "localhost", "cert_user", &with_cert))
        .await
        .expect("replication with a client certificate");
    assert!(is_encrypted(&pg, conn.backend_pid()).await);
    let params: ConnectParams = url(&pg, "localhost", "cert_user", &with_cert)
        .parse()
        .unwrap();
    let (client, connection) = params.upstream().connect().await.expect("query connection");
    tokio::spawn(connection);
    let user: String = client
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, "cert_user");

    // Without one, or with one naming another user, the server refuses.
    for (what, extra, expected) in [
        ("no certificate", query(""), "certificate"),
        (
            "another user's certificate",
            query(&format!(
                "&sslcert={}&sslkey={}",
                other_cert.display(),
                other_key.display()
            )),
            "authentication failed",
        ),
    ] {
        let error = replication(&url(&pg, "localhost", "cert_user", &extra))
            .await
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(error.contains(expected), "{what}: {error}");
        let params: ConnectParams = url(&pg, "localhost", "cert_user", &extra).parse().unwrap();
        let error = params.upstream().connect().await.map(|_| ()).unwrap_err();
        assert!(
            matches!(error, ReplicationError::Auth { .. }),
            "{what}: {error}"
        );
        assert!(error.to_string().contains(expected), "{what}: {error}");
    }
    // A key that is not PEM is a clear configuration error.
    let junk = write(&dir, "junk.key", "not a key");
    let error = url(
        &pg,
        "localhost",
        "cert_user",
        &query(&format!(
            "&sslcert={}&sslkey={}",
            cert.display(),
            junk.display()
        )),
    )
    .parse::<ConnectParams>()
    .unwrap_err()
    .to_string();
    assert!(error.contains("cannot read sslkey"), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}
