//! Scope-sync authorization rules: which tables an app may read, which columns a scope may
//! filter on, which columns are never sent, and which conditions must equal a token claim.
//!
//! Pure: the host reads the rules file and verifies the token; this module parses the rules
//! ([`SyncRules::from_json`]) and decides a subscription ([`SyncRules::decide`]) from the
//! verified claims, the `resourceType` and the `conditions`, as a value. The host must:
//! - on [`Grant`], serve the scope from `grant.table`, strip every column in
//!   `grant.omit_columns` from each row it sends (replay and live), and end the subscription
//!   with `auth-expired` once `grant.expires_at_ms` has passed;
//! - on [`Denial`], answer `channel-error` with `denial.code.as_str()` and the message, and send
//!   no rows;
//! - build its scope indexes from [`SyncRules::filter_columns`];
//! - on a write, decide each row with [`WriteGrant::admission`]: on
//!   [`Admission::ReadSets`], evaluate the filter over the row with its subqueries read from the
//!   tables they name (the host's replica), and admit the row only when that is true.
//!
//! The rules file (JSON):
//! ```json
//! { "tables": { "todos": {
//!     "filterColumns": ["owner", "done"],
//!     "omitColumns": ["secret_note"],
//!     "require": { "owner": "sub" },
//!     "where": "owner = auth.sub OR shared" } } }
//! ```
//! `where` is the table's row filter ([`row_filter`]): every subscription to the table sees only
//! the rows it is true for, with the subscriber's token claims in place.
//! Unknown keys are errors, not ignored: a misspelt `require` must not silently open a table.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value};

use crate::scope_sync::coercion::{describe, js_string_form};
use crate::scope_sync::{Conditions, MutationOp};

pub mod row_filter;

use row_filter::{RowFilter, RuleFilter};

/// The parsed rules: one entry per readable table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncRules {
    tables: BTreeMap<String, TableRules>,
}

/// What the rules say about one table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TableRules {
    filter_columns: Vec<String>,
    omit_columns: Vec<String>,
    /// Column → name of the claim its condition must equal.
    require: BTreeMap<String, String>,
    /// The `where` row filter.
    row_filter: Option<RuleFilter>,
    /// What sync clients may write (`write`); nothing without the key.
    write: WriteRules,
}

/// A table's `write` rules: `{"insert": true, "update": ["title", "done"], "delete": true}`.
/// `update` is `true` (any column but the key) or the columns an update may set.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WriteRules {
    pub insert: bool,
    pub update: Option<UpdateColumns>,
    pub delete: bool,
}

/// The columns an update may set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpdateColumns {
    Any,
    Only(Vec<String>),
}

/// A write the rules allow, with the checks its rows must pass: the row before the write (of
/// an update or delete) and after it (of an insert or update) must both be rows the writer may
/// read, so nobody writes another user's rows or moves a row out of their own reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteGrant {
    pub table: String,
    /// Column → the claim value it must equal (the table's `require`).
    require: Vec<(String, Value)>,
    /// The table's row filter with the writer's claims in place.
    row_filter: Option<RowFilter>,
    /// Columns the writer may not read: stripped from a conflict's current row.
    pub omit_columns: Vec<String>,
}

/// What decides whether a writer may have a row ([`WriteGrant::admission`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission<'a> {
    /// The row alone decides it.
    Decided(bool),
    /// The row passes `require`, and the row filter's answer hangs on its subqueries: the row
    /// is admitted only when this filter is true for it with the sets read from their tables
    /// (unknown is not admitted).
    ReadSets(&'a RowFilter),
}

impl WriteGrant {
    /// Whether the writer may read `row` (so may have it before or after a write), from the
    /// row alone: a row filter whose answer hangs on a subquery is not true here (see
    /// [`WriteGrant::admission`]).
    pub fn admits(&self, row: &Map<String, Value>) -> bool {
        self.admission(row) == Admission::Decided(true)
    }

    /// Whether the writer may read `row`, or what must be read to know. The `require` columns
    /// and the row filter's own tests are decided here; only a filter still unknown with its
    /// subqueries unknown needs them read. That is exact: an answer reached with some tests
    /// unknown is the same whatever they turn out to be (three-valued logic).
    pub fn admission(&self, row: &Map<String, Value>) -> Admission<'_> {
        let required = self.require.iter().all(|(column, claim)| {
            row.get(column).is_some_and(|value| {
                !value.is_null() && js_string_form(value) == js_string_form(claim)
            })
        });
        if !required {
            return Admission::Decided(false);
        }
        match &self.row_filter {
            None => Admission::Decided(true),
            Some(filter) => match filter.eval(row) {
                Some(answer) => Admission::Decided(answer),
                None if filter.has_sets() => Admission::ReadSets(filter),
                None => Admission::Decided(false),
            },
        }
    }

    /// `row` with the columns the writer may not read taken out.
    pub fn visible(&self, mut row: Map<String, Value>) -> Map<String, Value> {
        for column in &self.omit_columns {
            row.remove(column);
        }
        row
    }
}

/// A subscription the rules allow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The table to serve the scope from.
    pub table: String,
    /// Columns to strip from every row sent to this subscription.
    pub omit_columns: Vec<String>,
    /// When the token that allowed it expires (its `exp`, in ms); `None` without a token.
    pub expires_at_ms: Option<u64>,
    /// The table's row filter with the token's claims in place: only rows it is true for
    /// belong to the subscription.
    pub row_filter: Option<RowFilter>,
}

/// A subscription the rules refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Denial {
    pub code: DenialCode,
    pub message: String,
}

/// The stable `channel-error` code of a [`Denial`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DenialCode {
    /// The rules do not allow this table, filter column, or claim condition.
    Forbidden,
    /// The scope is malformed: no table, or a condition that is not a scalar.
    InvalidParams,
}

impl DenialCode {
    /// The wire code: `forbidden` or `invalid-params`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Forbidden => "forbidden",
            Self::InvalidParams => "invalid-params",
        }
    }
}

/// Why a rules file was rejected. `path` names the offending place, such as
/// `tables.todos.filterColumns[1]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RulesError {
    #[error("expected the rules to be JSON: {reason}")]
    NotJson { reason: String },
    #[error("{path}: expected {expected}, got {found}")]
    WrongType {
        path: String,
        expected: &'static str,
        found: String,
    },
    #[error("{path}: unknown key; expected one of {expected}")]
    UnknownKey {
        path: String,
        expected: &'static str,
    },
    #[error("{path}: expected a key \"tables\"")]
    MissingTables { path: String },
    #[error("{path}: expected a non-blank name without surrounding spaces, got {found:?}")]
    BadName { path: String, found: String },
    #[error("{path}: column {column:?} is listed twice")]
    Duplicate { path: String, column: String },
    #[error(
        "{path}: column {column:?} is in omitColumns and filterColumns; a filter on it would reveal the omitted values"
    )]
    OmittedFilter { path: String, column: String },
    #[error(
        "{path}: column {column:?} must equal a claim, so it must be listed in filterColumns too"
    )]
    RequireNotFilter { path: String, column: String },
    #[error("{path}: the row filter is refused: {reason}")]
    BadFilter { path: String, reason: String },
}

impl SyncRules {
    /// Parses the rules file text.
    pub fn from_json(text: &str) -> Result<Self, RulesError> {
        let value: Value = serde_json::from_str(text).map_err(|error| RulesError::NotJson {
            reason: error.to_string(),
        })?;
        Self::from_value(&value)
    }

    /// Parses rules already read as JSON.
    pub fn from_value(value: &Value) -> Result<Self, RulesError> {
        let root = object(value, "the rules")?;
        check_keys(root, "the rules", &["tables"], "\"tables\"")?;
        let tables_value = root.get("tables").ok_or(RulesError::MissingTables {
            path: "the rules".to_owned(),
        })?;
        let mut tables = BTreeMap::new();
        for (name, table) in object(tables_value, "tables")? {
            let path = format!("tables.{name}");
            check_name(name, "tables")?;
            tables.insert(name.clone(), TableRules::from_value(table, &path)?);
        }
        Ok(Self { tables })
    }

    /// Whether sync clients may write anything (then a primary takes writes).
    pub fn allows_writes(&self) -> bool {
        self.tables.values().any(|table| {
            let write = &table.write;
            write.insert || write.delete || write.update.is_some()
        })
    }

    /// The rules of one table, if it is readable.
    pub fn table(&self, name: &str) -> Option<&TableRules> {
        self.tables.get(name)
    }

    /// The readable tables and their rules, by name.
    pub fn tables(&self) -> impl Iterator<Item = (&str, &TableRules)> {
        self.tables
            .iter()
            .map(|(name, rules)| (name.as_str(), rules))
    }

    /// What the rules name that the replica does not have: a table, or a column of a listed
    /// table in `filterColumns` (which hold every `require` column), `omitColumns` or the
    /// `where` filter. `columns_of`
    /// gives a replicated table's columns (`None`: no such table). One message per miss,
    /// naming where in the rules it is; empty when the rules fit.
    pub fn schema_problems(&self, columns_of: impl Fn(&str) -> Option<Vec<String>>) -> Vec<String> {
        let mut problems = Vec::new();
        for (name, rules) in &self.tables {
            let Some(columns) = columns_of(name) else {
                problems.push(format!(
                    "tables.{name}: the replica has no table {name:?} (is it in the publication?)"
                ));
                continue;
            };
            let mut check = |place: &str, column: &str| {
                if !columns.iter().any(|c| c == column) {
                    problems.push(format!(
                        "tables.{name}.{place}: {name} has no column {column:?} (it has {})",
                        columns.join(", ")
                    ));
                }
            };
            for column in &rules.filter_columns {
                check("filterColumns", column);
            }
            for column in &rules.omit_columns {
                check("omitColumns", column);
            }
            for column in rules.row_filter.iter().flat_map(RuleFilter::columns) {
                check("where", &column);
            }
            for column in rules.write.columns() {
                check("write.update", column);
            }
            for subquery in rules.row_filter.iter().flat_map(RuleFilter::all_subqueries) {
                let table = &subquery.table;
                let Some(columns) = columns_of(table) else {
                    problems.push(format!(
                        "tables.{name}.where: its subquery reads table {table:?}, which the \
                         replica does not have (is it in the publication?)"
                    ));
                    continue;
                };
                let read =
                    std::iter::once(subquery.column.clone()).chain(subquery.filter.columns());
                for column in read {
                    if !columns.contains(&column) {
                        problems.push(format!(
                            "tables.{name}.where: its subquery reads column {column:?} of \
                             {table}, which has none (it has {})",
                            columns.join(", ")
                        ));
                    }
                }
            }
        }
        problems
    }

    /// The columns a scope's membership depends on, per table: its filter columns, then the
    /// columns its row filter reads. The server indexes these and keeps their old values in
    /// exits, so a row leaving a scope by a change of any of them is seen.
    ///
    /// The tables row filters' subqueries read are here too (readable or not), with the column
    /// each subquery selects and the columns its filter reads: the scope server keeps their
    /// sets from the feed, so their rows must be in it.
    pub fn filter_columns(&self) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut add = |table: &str, columns: Vec<String>| {
            let entry = out.entry(table.to_owned()).or_default();
            for column in columns {
                if !entry.contains(&column) {
                    entry.push(column);
                }
            }
        };
        for (name, rules) in &self.tables {
            let mut columns = rules.filter_columns.clone();
            columns.extend(rules.row_filter.iter().flat_map(RuleFilter::columns));
            add(name, columns);
        }
        for rules in self.tables.values() {
            for subquery in rules.row_filter.iter().flat_map(RuleFilter::all_subqueries) {
                let mut columns = vec![subquery.column.clone()];
                columns.extend(subquery.filter.columns());
                add(&subquery.table, columns);
            }
        }
        out
    }

    /// Decides a subscription to `resource_type` where `conditions`, for a caller holding
    /// `claims` (already verified; empty without a token). `expires_at_ms` is copied into the
    /// grant.
    ///
    /// Order of checks: a missing table name or a malformed condition is `invalid-params`; an
    /// unlisted table, a condition on a column outside `filterColumns`, or a `require` column
    /// without an equality test, or whose equality differs from its claim, is `forbidden`. The
    /// claim compares in JS string form (`5` equals `"5"`).
    pub fn decide(
        &self,
        claims: &Map<String, Value>,
        resource_type: &str,
        conditions: &Map<String, Value>,
        expires_at_ms: Option<u64>,
    ) -> Result<Grant, Denial> {
        if resource_type.trim().is_empty() {
            return Err(invalid(
                "expected resourceType to name a table, got nothing",
            ));
        }
        let conditions =
            Conditions::parse(conditions).map_err(|error| invalid(error.to_string()))?;
        let Some(rules) = self.tables.get(resource_type) else {
            return Err(forbidden(format!(
                "the sync rules do not allow reading table {resource_type:?}"
            )));
        };
        for column in conditions.columns() {
            if !rules.filter_columns.iter().any(|allowed| allowed == column) {
                return Err(forbidden(format!(
                    "table {resource_type:?} may not be filtered on column {column:?}; allowed: {}",
                    list(&rules.filter_columns)
                )));
            }
        }
        for (column, claim) in &rules.require {
            // The column must be tested for equality with the claim; other tests on it may
            // only narrow the scope further.
            let Some(condition) = conditions.equality(column) else {
                return Err(forbidden(format!(
                    "a scope of table {resource_type:?} must have the condition {column:?} equal to the token's {claim:?} claim"
                )));
            };
            let granted = match claims.get(claim) {
                Some(value @ (Value::String(_) | Value::Number(_) | Value::Bool(_))) => {
                    js_string_form(value) == js_string_form(condition)
                }
                Some(_) | None => {
                    return Err(forbidden(format!(
                        "a scope of table {resource_type:?} needs a token with a scalar {claim:?} claim"
                    )))
                }
            };
            if !granted {
                return Err(forbidden(format!(
                    "the condition {column:?} must equal the token's {claim:?} claim"
                )));
            }
        }
        let row_filter = match &rules.row_filter {
            None => None,
            Some(filter) => Some(filter.bind(claims).map_err(|claim| {
                forbidden(format!(
                    "a scope of table {resource_type:?} needs a token with a scalar {claim:?} claim"
                ))
            })?),
        };
        Ok(Grant {
            table: resource_type.to_owned(),
            omit_columns: rules.omit_columns.clone(),
            expires_at_ms,
            row_filter,
        })
    }

    /// Decides a write of `op` to `table` setting `columns`, for a caller holding `claims`
    /// (verified; empty without a token). `key` is the table's key columns: an update may
    /// always name them (they find the row), and must name them all, as must a delete.
    ///
    /// A table without `write` rules is read-only; an operation its rules do not list, or an
    /// update of a column outside its `update` list, is `forbidden`. The grant then checks the
    /// rows themselves ([`WriteGrant::admission`]).
    pub fn decide_write<'a>(
        &self,
        claims: &Map<String, Value>,
        table: &str,
        op: MutationOp,
        columns: impl IntoIterator<Item = &'a str>,
        key: &[String],
    ) -> Result<WriteGrant, Denial> {
        let Some(rules) = self.tables.get(table) else {
            return Err(forbidden(format!(
                "the sync rules do not allow writing table {table:?}"
            )));
        };
        let write = &rules.write;
        let columns: Vec<&str> = columns.into_iter().collect();
        match op {
            MutationOp::Insert if !write.insert => {
                return Err(forbidden(format!(
                    "the sync rules do not allow inserts into {table:?}"
                )))
            }
            MutationOp::Delete if !write.delete => {
                return Err(forbidden(format!(
                    "the sync rules do not allow deletes from {table:?}"
                )))
            }
            MutationOp::Update => match &write.update {
                None => {
                    return Err(forbidden(format!(
                        "the sync rules do not allow updates of {table:?}"
                    )))
                }
                Some(UpdateColumns::Any) => {}
                Some(UpdateColumns::Only(allowed)) => {
                    if let Some(column) = columns.iter().find(|column| {
                        !key.iter().any(|k| k == *column) && !allowed.iter().any(|a| a == *column)
                    }) {
                        return Err(forbidden(format!(
                            "an update of {table:?} may not set column {column:?}; allowed: {}",
                            list(allowed)
                        )));
                    }
                }
            },
            _ => {}
        }
        if op != MutationOp::Insert {
            if let Some(missing) = key.iter().find(|k| !columns.contains(&k.as_str())) {
                return Err(invalid(format!(
                    "an {} of {table:?} must name its key column {missing:?}",
                    op.as_str()
                )));
            }
        }
        let mut require = Vec::new();
        for (column, claim) in &rules.require {
            match claims.get(claim) {
                Some(value @ (Value::String(_) | Value::Number(_) | Value::Bool(_))) => {
                    require.push((column.clone(), value.clone()));
                }
                _ => {
                    return Err(forbidden(format!(
                        "a write to {table:?} needs a token with a scalar {claim:?} claim"
                    )))
                }
            }
        }
        let row_filter = match &rules.row_filter {
            None => None,
            Some(filter) => Some(filter.bind(claims).map_err(|claim| {
                forbidden(format!(
                    "a write to {table:?} needs a token with a scalar {claim:?} claim"
                ))
            })?),
        };
        Ok(WriteGrant {
            table: table.to_owned(),
            require,
            row_filter,
            omit_columns: rules.omit_columns.clone(),
        })
    }
}

impl TableRules {
    fn from_value(value: &Value, path: &str) -> Result<Self, RulesError> {
        let fields = object(value, path)?;
        check_keys(
            fields,
            path,
            &["filterColumns", "omitColumns", "require", "where", "write"],
            "\"filterColumns\", \"omitColumns\", \"require\", \"where\", \"write\"",
        )?;
        let filter_columns = columns(
            fields.get("filterColumns"),
            &format!("{path}.filterColumns"),
        )?;
        let omit_path = format!("{path}.omitColumns");
        let omit_columns = columns(fields.get("omitColumns"), &omit_path)?;
        if let Some(column) = omit_columns.iter().find(|c| filter_columns.contains(c)) {
            return Err(RulesError::OmittedFilter {
                path: omit_path,
                column: column.clone(),
            });
        }
        let mut require = BTreeMap::new();
        if let Some(value) = fields.get("require") {
            let require_path = format!("{path}.require");
            for (column, claim) in object(value, &require_path)? {
                check_name(column, &require_path)?;
                let claim_path = format!("{require_path}.{column}");
                let Value::String(claim) = claim else {
                    return Err(RulesError::WrongType {
                        path: claim_path,
                        expected: "a claim name (a string)",
                        found: describe(claim),
                    });
                };
                check_name(claim, &claim_path)?;
                if !filter_columns.contains(column) {
                    return Err(RulesError::RequireNotFilter {
                        path: require_path,
                        column: column.clone(),
                    });
                }
                require.insert(column.clone(), claim.clone());
            }
        }
        let row_filter = match fields.get("where") {
            None | Some(Value::Null) => None,
            Some(Value::String(text)) => {
                Some(
                    RuleFilter::parse(text).map_err(|reason| RulesError::BadFilter {
                        path: format!("{path}.where"),
                        reason,
                    })?,
                )
            }
            Some(other) => {
                return Err(RulesError::WrongType {
                    path: format!("{path}.where"),
                    expected: "a SQL boolean expression (a string)",
                    found: describe(other),
                })
            }
        };
        let write = match fields.get("write") {
            None | Some(Value::Null) => WriteRules::default(),
            Some(value) => WriteRules::from_value(value, &format!("{path}.write"))?,
        };
        Ok(Self {
            filter_columns,
            omit_columns,
            require,
            row_filter,
            write,
        })
    }

    /// What sync clients may write to the table.
    pub fn write(&self) -> &WriteRules {
        &self.write
    }

    /// The columns a scope of this table may filter on.
    pub fn filter_columns(&self) -> &[String] {
        &self.filter_columns
    }

    /// The columns never sent.
    pub fn omit_columns(&self) -> &[String] {
        &self.omit_columns
    }

    /// Column → the claim its condition must equal.
    pub fn require(&self) -> &BTreeMap<String, String> {
        &self.require
    }

    /// The `where` row filter, if any.
    pub fn row_filter(&self) -> Option<&RuleFilter> {
        self.row_filter.as_ref()
    }

    /// Whether a subscription to this table needs a token (some condition must equal a claim,
    /// or the row filter reads one).
    pub fn needs_claims(&self) -> bool {
        !self.require.is_empty()
            || self
                .row_filter
                .as_ref()
                .is_some_and(|filter| !filter.claims().is_empty())
    }
}

impl WriteRules {
    fn from_value(value: &Value, path: &str) -> Result<Self, RulesError> {
        let fields = object(value, path)?;
        check_keys(
            fields,
            path,
            &["insert", "update", "delete"],
            "\"insert\", \"update\", \"delete\"",
        )?;
        let flag = |key: &str| -> Result<bool, RulesError> {
            match fields.get(key) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(flag)) => Ok(*flag),
                Some(other) => Err(RulesError::WrongType {
                    path: format!("{path}.{key}"),
                    expected: "true or false",
                    found: describe(other),
                }),
            }
        };
        let update = match fields.get("update") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => None,
            Some(Value::Bool(true)) => Some(UpdateColumns::Any),
            Some(list @ Value::Array(_)) => Some(UpdateColumns::Only(columns(
                Some(list),
                &format!("{path}.update"),
            )?)),
            Some(other) => {
                return Err(RulesError::WrongType {
                    path: format!("{path}.update"),
                    expected: "true, false or a list of columns",
                    found: describe(other),
                })
            }
        };
        Ok(WriteRules {
            insert: flag("insert")?,
            update,
            delete: flag("delete")?,
        })
    }

    /// The columns the rules name (for the schema check).
    fn columns(&self) -> &[String] {
        match &self.update {
            Some(UpdateColumns::Only(columns)) => columns,
            _ => &[],
        }
    }
}

fn forbidden(message: impl Into<String>) -> Denial {
    Denial {
        code: DenialCode::Forbidden,
        message: message.into(),
    }
}

fn invalid(message: impl Into<String>) -> Denial {
    Denial {
        code: DenialCode::InvalidParams,
        message: message.into(),
    }
}

fn list(columns: &[String]) -> String {
    if columns.is_empty() {
        "none".to_owned()
    } else {
        columns.join(", ")
    }
}

fn object<'a>(value: &'a Value, path: &str) -> Result<&'a Map<String, Value>, RulesError> {
    match value {
        Value::Object(fields) => Ok(fields),
        other => Err(RulesError::WrongType {
            path: path.to_owned(),
            expected: "an object",
            found: describe(other),
        }),
    }
}

fn check_keys(
    fields: &Map<String, Value>,
    path: &str,
    known: &[&str],
    expected: &'static str,
) -> Result<(), RulesError> {
    match fields.keys().find(|key| !known.contains(&key.as_str())) {
        Some(key) => Err(RulesError::UnknownKey {
            path: format!("{path}.{key}"),
            expected,
        }),
        None => Ok(()),
    }
}

fn check_name(name: &str, path: &str) -> Result<(), RulesError> {
    if name.is_empty() || name.trim() != name {
        return Err(RulesError::BadName {
            path: path.to_owned(),
            found: name.to_owned(),
        });
    }
    Ok(())
}

fn columns(value: Option<&Value>, path: &str) -> Result<Vec<String>, RulesError> {
    let items = match value {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(RulesError::WrongType {
                path: path.to_owned(),
                expected: "an array of column names",
                found: describe(other),
            })
        }
    };
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let item_path = format!("{path}[{index}]");
        let Value::String(column) = item else {
            return Err(RulesError::WrongType {
                path: item_path,
                expected: "a column name (a string)",
                found: describe(item),
            });
        };
        check_name(column, &item_path)?;
        if !seen.insert(column.as_str()) {
            return Err(RulesError::Duplicate {
                path: item_path,
                column: column.clone(),
            });
        }
        out.push(column.clone());
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
