//! `highwater doctor --upstream URL`: checks what `serve` and `replicate` need from Postgres
//! and says what to run to fix each miss, before the first start.
//!
//! Read-only: it creates nothing (no publication, no slot), and exits 0 only when every check
//! passes (warnings allowed).

use std::fmt::Write as _;

use tokio_postgres::Client;

use crate::replication::setup::{ReplicationNames, UpstreamTarget, ALL_TABLES_WHERE};
use crate::replication::{ConnectParams, ReplicationConnection};

/// Command-line arguments of `highwater doctor`.
#[derive(Debug, Clone, clap::Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub target: UpstreamTarget,
}

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// Works, with a limit worth knowing.
    Warn,
    /// `serve` would not work.
    Fail,
}

/// One check: what, how it came out, what was found, and what to run to fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: &'static str,
    pub outcome: Outcome,
    pub detail: String,
    pub fix: Option<String>,
}

impl Check {
    fn ok(name: &'static str, detail: impl Into<String>) -> Self {
        Self {
            name,
            outcome: Outcome::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            name,
            outcome: Outcome::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            name,
            outcome: Outcome::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

/// Runs the checks, prints them, and fails when one failed.
pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    crate::runtime::init_tracing("warn");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let checks = runtime.block_on(diagnose(&args));
    print!("{}", report(&checks));
    let failed = checks.iter().filter(|c| c.outcome == Outcome::Fail).count();
    if failed > 0 {
        // The table said it all: a short last line and the exit code, no error trace.
        eprintln!("{failed} check(s) failed: `highwater serve` would not work yet");
        std::process::exit(1);
    }
    Ok(())
}

/// The checks' table: one line each, the fix indented under a miss.
pub fn report(checks: &[Check]) -> String {
    let mut out = String::new();
    for check in checks {
        let mark = match check.outcome {
            Outcome::Ok => "ok  ",
            Outcome::Warn => "WARN",
            Outcome::Fail => "FAIL",
        };
        let _ = writeln!(out, "{mark}  {:<22} {}", check.name, check.detail);
        if let Some(fix) = &check.fix {
            for line in fix.lines() {
                let _ = writeln!(out, "      {:<22} {line}", "");
            }
        }
    }
    out
}

/// Every check, in order; a check that cannot run (no connection) ends the list.
pub(crate) async fn diagnose(args: &DoctorArgs) -> Vec<Check> {
    let mut checks = Vec::new();
    let names = match ReplicationNames::for_app(&args.target.app_id) {
        Ok(names) => names,
        Err(error) => {
            checks.push(Check::fail(
                "app id",
                error.to_string(),
                "pick an app id of lower-case letters, digits and _",
            ));
            return checks;
        }
    };
    let params: ConnectParams = match args.target.upstream.parse() {
        Ok(params) => params,
        Err(error) => {
            checks.push(Check::fail(
                "upstream URL",
                error.to_string(),
                "postgres://USER@HOST:PORT/DATABASE?sslmode=require",
            ));
            return checks;
        }
    };
    let client = match params.upstream().connect().await {
        Ok((client, connection)) => {
            tokio::spawn(connection);
            client
        }
        Err(error) => {
            checks.push(Check::fail(
                "connect",
                error.to_string(),
                "check the host, port, user, password and pg_hba.conf",
            ));
            return checks;
        }
    };
    match query_checks(&client, args, &names).await {
        Ok(found) => checks.extend(found),
        Err(error) => checks.push(Check::fail(
            "catalog queries",
            error.to_string(),
            "the user must be able to read pg_settings, pg_roles and pg_publication",
        )),
    }
    checks.push(match ReplicationConnection::connect(&params).await {
        Ok(_) => Check::ok("replication connection", "opened (replication=database)"),
        Err(error) => Check::fail(
            "replication connection",
            error.to_string(),
            "the role needs REPLICATION (see role), and pg_hba.conf must let it connect for \
             replication: host replication USER ADDRESS scram-sha-256; then SELECT pg_reload_conf()",
        ),
    });
    checks
}

async fn query_checks(
    client: &Client,
    args: &DoctorArgs,
    names: &ReplicationNames,
) -> Result<Vec<Check>, tokio_postgres::Error> {
    let mut checks = Vec::new();
    let row = client
        .query_one(
            "SELECT current_setting('server_version'), current_setting('server_version_num')::int4, \
                    current_setting('wal_level'), \
                    current_setting('max_replication_slots')::int4, \
                    (SELECT count(*)::int4 FROM pg_replication_slots), \
                    current_setting('max_wal_senders')::int4, \
                    (SELECT count(*)::int4 FROM pg_stat_replication), \
                    current_user::text, \
                    (SELECT rolsuper FROM pg_roles WHERE rolname = current_user), \
                    (SELECT rolreplication FROM pg_roles WHERE rolname = current_user), \
                    coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false)",
            &[],
        )
        .await?;
    let version: String = row.get(0);
    let version_num: i32 = row.get(1);
    checks.push(if version_num >= 100_000 {
        Check::ok("server version", version)
    } else {
        Check::fail(
            "server version",
            version,
            "Postgres 10 or newer is needed (logical replication with pgoutput)",
        )
    });
    let wal_level: String = row.get(2);
    checks.push(if wal_level == "logical" {
        Check::ok("wal_level", "logical")
    } else {
        Check::fail(
            "wal_level",
            format!("{wal_level}, logical replication needs logical"),
            "ALTER SYSTEM SET wal_level = logical;  -- then restart Postgres",
        )
    });
    let slot = slot_row(client, &names.slot).await?;
    let (max_slots, used_slots): (i32, i32) = (row.get(3), row.get(4));
    checks.push(if slot.is_some() || used_slots < max_slots {
        Check::ok(
            "max_replication_slots",
            format!("{used_slots} of {max_slots} in use"),
        )
    } else {
        Check::fail(
            "max_replication_slots",
            format!("all {max_slots} in use, and {} needs one", names.slot),
            format!(
                "ALTER SYSTEM SET max_replication_slots = {};  -- then restart Postgres \
                 (or drop an unused slot)",
                max_slots + 1
            ),
        )
    });
    let (max_senders, used_senders): (i32, i32) = (row.get(5), row.get(6));
    checks.push(if used_senders < max_senders {
        Check::ok(
            "max_wal_senders",
            format!("{used_senders} of {max_senders} in use"),
        )
    } else {
        Check::fail(
            "max_wal_senders",
            format!("all {max_senders} in use"),
            format!(
                "ALTER SYSTEM SET max_wal_senders = {};  -- then restart Postgres",
                max_senders + 2
            ),
        )
    });
    let user: String = row.get(7);
    let superuser: bool = row.get::<_, Option<bool>>(8).unwrap_or(false);
    let replication: bool = row.get::<_, Option<bool>>(9).unwrap_or(false);
    checks.push(if superuser || replication {
        Check::ok(
            "role",
            format!(
                "{user}: {}",
                if superuser {
                    "superuser"
                } else {
                    "REPLICATION"
                }
            ),
        )
    } else {
        Check::fail(
            "role",
            format!("{user} has neither REPLICATION nor superuser"),
            format!("ALTER ROLE {} REPLICATION;", quote_ident(&user)),
        )
    });
    if !superuser {
        checks.push(Check::warn(
            "schema changes",
            format!("{user} is not a superuser: no DDL event trigger"),
            "a column added, renamed or dropped upstream is followed only once a row of its table \
             changes; run as a superuser (or install the trigger as one) to follow DDL at once",
        ));
    }
    checks.extend(publication_checks(client, args, names, superuser, &user).await?);
    checks.push(match slot {
        None => Check::ok(
            "slot",
            format!(
                "{} does not exist yet: created at the first start",
                names.slot
            ),
        ),
        Some(slot) => slot_check(&names.slot, &slot),
    });
    let ssl: bool = row.get(10);
    checks.push(if ssl {
        Check::ok("TLS", "this connection is encrypted")
    } else {
        Check::warn(
            "TLS",
            "this connection is not encrypted",
            "fine on a private network or a Unix socket; otherwise turn on ssl in Postgres and \
             add sslmode=require to the URL",
        )
    });
    Ok(checks)
}

/// A slot: its plugin, whether a process holds it, its WAL status and how much WAL it keeps.
struct SlotRow {
    plugin: Option<String>,
    active_pid: Option<i32>,
    wal_status: Option<String>,
    retained_bytes: Option<i64>,
}

async fn slot_row(client: &Client, slot: &str) -> Result<Option<SlotRow>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT plugin::text, active_pid, wal_status, \
                    (pg_current_wal_lsn() - restart_lsn)::int8 \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|row| SlotRow {
        plugin: row.get(0),
        active_pid: row.get(1),
        wal_status: row.get(2),
        retained_bytes: row.get(3),
    }))
}

fn slot_check(name: &str, slot: &SlotRow) -> Check {
    if slot.wal_status.as_deref() == Some("lost") || slot.retained_bytes.is_none() {
        return Check::fail(
            "slot",
            format!("{name} was invalidated: the WAL it needed is gone"),
            format!(
                "start serve with --auto-reset (a fresh initial sync), or SELECT \
                 pg_drop_replication_slot('{name}');"
            ),
        );
    }
    if slot.plugin.as_deref() != Some("pgoutput") {
        return Check::fail(
            "slot",
            format!(
                "{name} uses the plugin {}, not pgoutput",
                slot.plugin.as_deref().unwrap_or("none")
            ),
            format!("SELECT pg_drop_replication_slot('{name}');  -- or pick another --app-id"),
        );
    }
    let retained = slot.retained_bytes.unwrap_or(0);
    let mib = retained as f64 / (1024.0 * 1024.0);
    match slot.active_pid {
        Some(pid) => Check::warn(
            "slot",
            format!("{name} is in use by process {pid}; it keeps {mib:.1} MiB of WAL"),
            "another server runs with this app id: stop it, or give this one another --app-id",
        ),
        None => Check::ok(
            "slot",
            format!("{name} exists and keeps {mib:.1} MiB of WAL until a server reads it"),
        ),
    }
}

async fn publication_checks(
    client: &Client,
    args: &DoctorArgs,
    names: &ReplicationNames,
    superuser: bool,
    user: &str,
) -> Result<Vec<Check>, tokio_postgres::Error> {
    let mut checks = Vec::new();
    let wanted = args.target.wanted_publications(names);
    let mut existing = Vec::new();
    for publication in &wanted {
        let exists = client
            .query_opt(
                "SELECT 1 FROM pg_publication WHERE pubname = $1",
                &[publication],
            )
            .await?
            .is_some();
        if exists {
            existing.push(publication.clone());
            checks.push(Check::ok("publication", format!("{publication} exists")));
        } else if args.target.publications.is_empty() && superuser {
            checks.push(Check::ok(
                "publication",
                format!(
                    "{publication} does not exist yet: created FOR ALL TABLES at the first start"
                ),
            ));
        } else if args.target.publications.is_empty() {
            checks.push(Check::fail(
                "publication",
                format!("{publication} does not exist, and only a superuser can create it FOR ALL TABLES"),
                format!(
                    "as a superuser: CREATE PUBLICATION {} FOR ALL TABLES;  -- or FOR TABLE a, b",
                    quote_ident(publication)
                ),
            ));
        } else {
            checks.push(Check::fail(
                "publication",
                format!("{publication} does not exist"),
                format!(
                    "CREATE PUBLICATION {} FOR TABLE …;  -- the tables to sync",
                    quote_ident(publication)
                ),
            ));
        }
    }
    // The tables that will be replicated: those the publications hold now, or every table
    // when the default publication is still to be created FOR ALL TABLES.
    let all_tables = args.target.publications.is_empty() && existing.is_empty();
    let columns = "n.nspname::text, c.relname::text, c.relreplident::text, \
         EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary), \
         has_table_privilege(c.oid, 'SELECT')";
    let rows = if all_tables {
        client
            .query(
                &format!(
                    "SELECT {columns} FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                     WHERE {ALL_TABLES_WHERE} ORDER BY 1, 2"
                ),
                &[],
            )
            .await?
    } else {
        client
            .query(
                &format!(
                    "SELECT DISTINCT {columns} FROM pg_publication_tables pt \
                     JOIN pg_namespace n ON n.nspname = pt.schemaname \
                     JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename \
                     WHERE pt.pubname = ANY($1) ORDER BY 1, 2"
                ),
                &[&existing],
            )
            .await?
    };
    if !existing.is_empty() || all_tables {
        checks.push(if rows.is_empty() {
            Check::warn(
                "published tables",
                "none: nothing would be replicated",
                "ALTER PUBLICATION … ADD TABLE …;",
            )
        } else {
            Check::ok("published tables", format!("{}", rows.len()))
        });
    }
    for row in rows {
        let schema: String = row.get(0);
        let table: String = row.get(1);
        let identity: String = row.get(2);
        let has_key: bool = row.get(3);
        let readable: bool = row.get(4);
        let qualified = format!("{}.{}", quote_ident(&schema), quote_ident(&table));
        if !readable {
            checks.push(Check::fail(
                "table privilege",
                format!("{user} cannot SELECT {qualified}: the initial sync copies it"),
                format!("GRANT SELECT ON {qualified} TO {};", quote_ident(user)),
            ));
        }
        let keyless = match identity.as_str() {
            "n" => Some("REPLICA IDENTITY NOTHING"),
            "d" if !has_key => Some("no primary key"),
            _ => None,
        };
        if let Some(why) = keyless {
            checks.push(Check::fail(
                "replica identity",
                format!("{qualified} has {why}: its updates and deletes cannot be replicated"),
                format!(
                    "ALTER TABLE {qualified} ADD PRIMARY KEY (…);  -- or: ALTER TABLE {qualified} \
                     REPLICA IDENTITY FULL;"
                ),
            ));
        }
    }
    Ok(checks)
}

fn quote_ident(name: &str) -> String {
    if name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && name.bytes().next().is_some_and(|b| !b.is_ascii_digit())
    {
        name.to_owned()
    } else {
        format!("\"{}\"", name.replace('"', "\"\""))
    }
}
