//! `highwater-bench apply`: the replica's apply path alone, on one thread, without Postgres or a
//! socket: pgoutput Insert messages of the ingest benchmark's table, mapped and applied to a
//! file replica in one transaction (made durable at its commit), once with JSON rows (what
//! `serve` stores, its change stream carrying them) and once with rows that kept their text
//! (what `replicate` stores), alternately, so that both forms meet the same machine.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use highwater_engine::change_stream::{
    Begin, Change, ColumnSpec, Commit, CreateTable, DownstreamMessage, PgTypeClass, TableSpec,
};
use highwater_engine::pgoutput::{
    self as pg, PgTimestamp, PgoutputEvent, PgoutputMapper, PgoutputMessage, RelationColumn, Tuple,
    TupleValue,
};
use highwater_engine::watermark::Lsn;
use serde_json::Number;

use super::common::{replica_row_count, thousands, WorkDir};
use super::workload::TABLE;
use highwater_host::replica::{Replica, ReplicaState, ReplicaWriter};

#[derive(Debug, Clone, clap::Args)]
pub struct ApplyArgs {
    /// Rows inserted by the one transaction of each run.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    /// Runs of each row form, alternating.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Directory for the replicas; by default a temporary one, removed afterwards.
    #[arg(long)]
    pub work_dir: Option<std::path::PathBuf>,
}

/// The ingest benchmark's table: name, type OID, replica data type.
const COLUMNS: &[(&str, u32, &str)] = &[
    ("id", 20, "int8"),
    ("account_id", 23, "int4"),
    ("status", 25, "text"),
    ("title", 25, "text"),
    ("amount", 1700, "numeric"),
    ("created_at", 1184, "timestamptz"),
    ("attributes", 3802, "jsonb"),
];
const RELATION_OID: u32 = 16_384;
/// Rows whose texts are made before the clock runs, at a time.
const BATCH: u64 = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Json,
    Text,
}

struct Run {
    round: u32,
    form: Form,
    elapsed: Duration,
}

pub fn run(args: ApplyArgs) -> anyhow::Result<()> {
    if args.rows == 0 || args.rounds == 0 {
        bail!("--rows and --rounds must be at least 1");
    }
    let work = WorkDir::new(args.work_dir.as_deref(), "highwater-bench-apply")?;
    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        for form in [Form::Json, Form::Text] {
            let dir = work.replica_dir().join(format!("{round}-{form:?}"));
            let elapsed = apply_once(&dir, form, args.rows)?;
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
            runs.push(Run {
                round,
                form,
                elapsed,
            });
        }
    }
    print!("{}", table(&runs, args.rows));
    Ok(())
}

/// Maps and applies `rows` inserts in one transaction into a new replica at `dir`; returns the
/// time spent mapping, applying and committing (not making the rows' texts).
fn apply_once(dir: &std::path::Path, form: Form, rows: u64) -> anyhow::Result<Duration> {
    let mut replica = Replica::open_in_dir(dir)?;
    let start = Lsn(0x100);
    replica.store_initial_state(&ReplicaState {
        replica_version: start.to_watermark(),
        watermark: start.to_watermark(),
        lsn: start,
        publications: vec!["bench".into()],
        slot: "bench".into(),
        app_id: "highwater".into(),
        next_seq: 1,
    })?;
    let mut writer = ReplicaWriter::new(replica);
    create_table(&mut writer)?;
    let mut mapper = PgoutputMapper::new();
    if form == Form::Text {
        mapper.keep_row_text();
    }
    mapper.map_message(PgoutputMessage::Relation(relation()))?;
    let lsn = Lsn(0x300);
    let mut elapsed = Duration::ZERO;
    let clock = Instant::now();
    let begin = PgoutputMessage::Begin(pg::Begin {
        final_lsn: lsn,
        commit_time: PgTimestamp(0),
        xid: 1,
    });
    apply(&mut writer, &mut mapper, begin)?;
    elapsed += clock.elapsed();
    let mut texts: Vec<[String; 7]> = Vec::with_capacity(BATCH as usize);
    let mut id = 1;
    while id <= rows {
        texts.clear();
        let last = rows.min(id + BATCH - 1);
        texts.extend((id..=last).map(row_texts));
        id = last + 1;
        let clock = Instant::now();
        for row in &texts {
            let new = Tuple(row.iter().map(|t| TupleValue::Text(t.as_bytes())).collect());
            let insert = PgoutputMessage::Insert(pg::Insert {
                relation_oid: RELATION_OID,
                new,
            });
            apply(&mut writer, &mut mapper, insert)?;
        }
        elapsed += clock.elapsed();
    }
    let clock = Instant::now();
    let commit = PgoutputMessage::Commit(pg::Commit {
        flags: 0,
        commit_lsn: lsn,
        end_lsn: Lsn(lsn.0 + 8),
        commit_time: PgTimestamp(0),
    });
    apply(&mut writer, &mut mapper, commit)?;
    elapsed += clock.elapsed();
    drop(writer);
    let stored = replica_row_count(dir)?;
    if stored != rows {
        bail!("expected {rows} rows in the replica, found {stored}");
    }
    Ok(elapsed)
}

fn apply(
    writer: &mut ReplicaWriter,
    mapper: &mut PgoutputMapper,
    message: PgoutputMessage<'_>,
) -> anyhow::Result<()> {
    match mapper.map_message(message)? {
        Some(PgoutputEvent::Downstream(message)) => writer.apply(&message)?,
        Some(PgoutputEvent::Commit { commit, .. }) => {
            writer.apply(&DownstreamMessage::Commit(commit))?
        }
        Some(PgoutputEvent::RowText(change)) => writer.apply_text(&change)?,
        other => bail!("expected a row change, begin or commit, got {other:?}"),
    };
    Ok(())
}

fn create_table(writer: &mut ReplicaWriter) -> anyhow::Result<()> {
    let mut columns = indexmap::IndexMap::new();
    for (position, (name, _, data_type)) in COLUMNS.iter().enumerate() {
        let mut spec = ColumnSpec::new(Number::from(position + 1), *data_type);
        spec.pg_type_class = Some(PgTypeClass::Base);
        columns.insert((*name).to_owned(), spec);
    }
    let spec = TableSpec {
        schema: "public".into(),
        name: TABLE.into(),
        columns,
        primary_key: Some(vec!["id".into()]),
        extra: Default::default(),
    };
    let watermark = Lsn(0x200).to_watermark();
    writer.apply(&DownstreamMessage::Begin(Begin::new(watermark.clone())))?;
    writer.apply(&DownstreamMessage::Data(Change::CreateTable(CreateTable {
        spec,
        metadata: None,
        backfill: None,
        extra: Default::default(),
    })))?;
    writer.apply(&DownstreamMessage::Commit(Commit::new(watermark)))?;
    Ok(())
}

fn relation() -> pg::Relation {
    pg::Relation {
        oid: RELATION_OID,
        namespace: "public".into(),
        name: TABLE.into(),
        replica_identity: pg::ReplicaIdentity::Default,
        columns: COLUMNS
            .iter()
            .map(|(name, type_oid, _)| RelationColumn {
                flags: u8::from(*name == "id"),
                name: (*name).into(),
                type_oid: *type_oid,
                type_modifier: -1,
            })
            .collect(),
    }
}

/// Row `i` as Postgres writes the ingest benchmark's row `i` (the title's hash aside).
fn row_texts(i: u64) -> [String; 7] {
    let status = ["new", "paid", "shipped", "returned"][(i % 4) as usize];
    let cents = (i * 37) % 100_000;
    let seconds = i % 86_400;
    [
        i.to_string(),
        (i % 1000).to_string(),
        status.to_owned(),
        format!(
            "order {i} for customer {:032x}",
            u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ),
        format!("{}.{:02}", cents / 100, cents % 100),
        format!(
            "2024-01-{:02} {:02}:{:02}:{:02}+00",
            1 + (i / 86_400) % 28,
            seconds / 3600,
            seconds / 60 % 60,
            seconds % 60
        ),
        format!(
            "{{\"qty\": {}, \"sku\": \"SKU-{}\", \"gift\": {}, \"tags\": [\"retail\", \"eu\"]}}",
            i % 7 + 1,
            i % 5000,
            i.is_multiple_of(2)
        ),
    ]
}

fn table(runs: &[Run], rows: u64) -> String {
    let mut out = String::from(
        "| Round | Rows as | Rows | Seconds | Rows/s | µs per row |\n|---|---|---:|---:|---:|---:|\n",
    );
    for run in runs {
        let seconds = run.elapsed.as_secs_f64();
        out.push_str(&format!(
            "| {} | {} | {} | {:.3} | {} | {:.2} |\n",
            run.round,
            match run.form {
                Form::Json => "JSON (serve)",
                Form::Text => "text (replicate)",
            },
            thousands(rows as f64),
            seconds,
            thousands(rows as f64 / seconds.max(f64::EPSILON)),
            seconds * 1e6 / rows as f64,
        ));
    }
    let best = |form| {
        runs.iter()
            .filter(|r| r.form == form)
            .map(|r| r.elapsed)
            .min()
            .unwrap_or_default()
            .as_secs_f64()
    };
    let (json, text) = (best(Form::Json), best(Form::Text));
    if text > 0.0 {
        out.push_str(&format!(
            "\nbest run: JSON rows {json:.3} s, text rows {text:.3} s ({:.0} % less time)\n",
            (1.0 - text / json) * 100.0
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_run_stores_every_row_in_both_forms() {
        let work = WorkDir::new(None, "highwater-bench-apply-test").unwrap();
        for form in [Form::Json, Form::Text] {
            let dir = work.replica_dir().join(format!("{form:?}"));
            // `apply_once` checks the replica's row count itself.
            apply_once(&dir, form, 2_500).unwrap();
        }
    }

    #[test]
    fn rows_are_what_the_mapper_accepts() {
        let mut mapper = PgoutputMapper::new();
        mapper
            .map_message(PgoutputMessage::Relation(relation()))
            .unwrap();
        mapper
            .map_message(PgoutputMessage::Begin(pg::Begin {
                final_lsn: Lsn(1),
                commit_time: PgTimestamp(0),
                xid: 1,
            }))
            .unwrap();
        for i in [1, 86_399, 86_400 * 30, u64::from(u32::MAX)] {
            let texts = row_texts(i);
            let new = Tuple(
                texts
                    .iter()
                    .map(|t| TupleValue::Text(t.as_bytes()))
                    .collect(),
            );
            let mapped = mapper.map_message(PgoutputMessage::Insert(pg::Insert {
                relation_oid: RELATION_OID,
                new,
            }));
            assert!(
                matches!(mapped, Ok(Some(PgoutputEvent::Downstream(_)))),
                "{i}: {mapped:?}"
            );
        }
    }
}
