//! Access through memberships: the row filters the simulation's rules give a user's scopes
//! (`project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub)` and kin), and
//! the sets their subqueries select, computed in memory from whole tables (the replica's
//! rows to answer the server's reads, upstream's rows for the oracle).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};

use highwater_engine::scope_sync::rules::row_filter::{RowFilter, RuleFilter, SetQuery, Sets};
use highwater_engine::scope_sync::server::routing_form;
use serde_json::{json, Map, Value};

use crate::rng::Rng;

/// A user's todos or items: those of the projects they are a member of.
pub const MEMBER_OF: &str =
    "project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub)";
/// As [`MEMBER_OF`], or the user's own rows (the set's test is not the only way in).
pub const MEMBER_OR_OWNER: &str =
    "project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub) OR owner = auth.sub";
/// A user's items: those of the todos of their projects (a subquery inside a subquery).
pub const TODO_OF_MEMBER: &str = "todo_id IN (SELECT id FROM todos WHERE project_id IN \
     (SELECT project_id FROM members WHERE user_id = auth.sub))";

/// The row filters of one run's rules, by table; a client with a user gets them bound to its
/// token's `sub`, a client without one reads its tables whole.
#[derive(Debug, Clone)]
pub struct Rules {
    filters: BTreeMap<String, (&'static str, RuleFilter)>,
}

impl Rules {
    /// A filter for each scoped table, drawn for the run.
    pub fn random(rng: &mut Rng) -> Self {
        let todos = *rng
            .pick(&[MEMBER_OF, MEMBER_OF, MEMBER_OR_OWNER])
            .expect("filters");
        let items = *rng
            .pick(&[MEMBER_OF, MEMBER_OR_OWNER, TODO_OF_MEMBER, TODO_OF_MEMBER])
            .expect("filters");
        let parse = |text: &'static str| {
            (
                text,
                RuleFilter::parse(text).expect("the simulation's filters parse"),
            )
        };
        Rules {
            filters: BTreeMap::from([
                ("todos".to_owned(), parse(todos)),
                ("items".to_owned(), parse(items)),
            ]),
        }
    }

    /// The filter of `table`'s rows for `user`, if the table has one.
    pub fn filter(&self, table: &str, user: &str) -> Option<RowFilter> {
        let claims = match json!({ "sub": user }) {
            Value::Object(claims) => claims,
            _ => unreachable!("an object"),
        };
        let (_, filter) = self.filters.get(table)?;
        Some(filter.bind(&claims).expect("the token holds every claim"))
    }

    /// One line per table, for the trace.
    pub fn describe(&self) -> String {
        self.filters
            .iter()
            .map(|(table, (text, _))| format!("{table} where {text}"))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// Subqueries' sets over whole tables, each computed once: a value is in a set when some row
/// of its table passes its filter and holds that value in its column (NULLs never are).
pub struct TableSets<'a> {
    tables: HashMap<&'a str, Vec<&'a Map<String, Value>>>,
    /// Set (as printed) → routing forms of its values.
    known: RefCell<HashMap<String, HashSet<String>>>,
}

impl<'a> TableSets<'a> {
    pub fn new(tables: impl IntoIterator<Item = (&'a str, Vec<&'a Map<String, Value>>)>) -> Self {
        TableSets {
            tables: tables.into_iter().collect(),
            known: RefCell::new(HashMap::new()),
        }
    }

    /// Whether `filter` is true for `row` (a row is in only then).
    pub fn passes(&self, filter: &RowFilter, row: &Map<String, Value>) -> bool {
        filter.eval_with(row, self) == Some(true)
    }
}

impl Sets for TableSets<'_> {
    fn contains(&self, set: &SetQuery, value: &Value) -> Option<bool> {
        let key = set.to_string();
        let form = routing_form(value);
        if let Some(values) = self.known.borrow().get(&key) {
            return Some(values.contains(&form));
        }
        let values: HashSet<String> = self
            .tables
            .get(set.table.as_str())
            .into_iter()
            .flatten()
            .filter(|row| self.passes(&set.filter, row))
            .filter_map(|row| row.get(&set.column).filter(|v| !v.is_null()))
            .map(routing_form)
            .collect();
        let found = values.contains(&form);
        self.known.borrow_mut().insert(key, values);
        Some(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn nested_sets_are_read_from_the_tables() {
        let members = [
            row(json!({"id": 1, "project_id": 1, "user_id": "ada"})),
            row(json!({"id": 2, "project_id": 2, "user_id": "bob"})),
            row(json!({"id": 3, "project_id": null, "user_id": "ada"})),
        ];
        let todos = [
            row(json!({"id": 10, "project_id": 1})),
            row(json!({"id": 11, "project_id": 2})),
        ];
        let sets = TableSets::new([
            ("members", members.iter().collect()),
            ("todos", todos.iter().collect()),
        ]);
        let filter = |text: &str| {
            RuleFilter::parse(text)
                .expect("parses")
                .bind(&row(json!({"sub": "ada"})))
                .expect("binds")
        };
        let nested = filter(TODO_OF_MEMBER);
        assert!(sets.passes(&nested, &row(json!({"todo_id": 10}))));
        assert!(!sets.passes(&nested, &row(json!({"todo_id": 11}))));
        assert!(!sets.passes(&nested, &row(json!({"todo_id": null}))));
        let either = filter(MEMBER_OR_OWNER);
        assert!(sets.passes(&either, &row(json!({"project_id": 2, "owner": "ada"}))));
        assert!(!sets.passes(&either, &row(json!({"project_id": 2, "owner": "bob"}))));
        // NULL project, other owner: unknown OR false is not true.
        assert!(!sets.passes(&either, &row(json!({"project_id": null, "owner": "bob"}))));
    }
}
