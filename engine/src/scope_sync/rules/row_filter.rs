//! A table's row filter: the `where` of its rules, a SQL boolean expression over the table's
//! own columns, literals and the token's claims (`auth.<claim>`), such as
//! `owner = auth.sub OR (shared AND deleted_at IS NULL)`.
//!
//! The text is parsed with `sqlparser` (Postgres dialect) into a restricted tree, refused at
//! start with a reason when it holds anything else. Allowed: comparisons (`=`, `<>`, `!=`,
//! `<`, `<=`, `>`, `>=`) between a column and a literal or a claim, `[NOT] IN (…)` lists,
//! `[NOT] BETWEEN`, `IS [NOT] NULL`, a boolean column alone (`shared` is `shared = true`),
//! `AND`, `OR`, `NOT`, parentheses, and `true`/`false`. Values compare as
//! [`Conditions`](crate::scope_sync::Conditions) compares them (a column's type, text by code
//! point), with SQL's three-valued logic: a comparison with NULL is unknown, `NOT` unknown is
//! unknown, and a row is in only when the filter is true.
//!
//! [`RuleFilter::bind`] puts a token's claims in place, giving the [`RowFilter`] a
//! subscription is served by: the scope server matches live rows with it and the replica's
//! replay reads render it as SQL, so both say the same.
//!
//! Rows reached through another table: `col IN (SELECT c FROM t WHERE …)`, where the
//! subquery's `WHERE` is a row filter of `t` (claims, literals and further subqueries, nested
//! to any depth). A subquery is one column of one table: no joins, `DISTINCT`, `LIMIT`,
//! grouping, aliases or qualified names. It may only widen what a row can see: `NOT IN
//! (SELECT …)`, or a subquery under `NOT`, is refused, so a membership added can only bring rows
//! in and one removed can only take rows out (the scope server's move-ins and move-outs rely on
//! it). Bound, a subquery becomes a [`SetQuery`]: the values of `c` over the rows of `t` its
//! filter holds for. NULLs are never in it, and a NULL column is never in a set.
//!
//! A column the filter names that the table (or a subquery's table) lacks stops the server at
//! its start ([`SyncRules::schema_problems`](crate::scope_sync::rules::SyncRules::schema_problems)).

use std::fmt;

use serde_json::{Map, Number, Value};
use sqlparser::ast::{
    BinaryOperator, Expr, Query, SelectItem, SetExpr, TableFactor, UnaryOperator, Value as Literal,
};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::parser::Parser;
use sqlparser::tokenizer::Token;

use crate::scope_sync::Test;

/// The longest `where` text a rules file may hold.
pub const MAX_FILTER_CHARS: usize = 16 * 1024;

/// A comparison operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Lte,
    Gt,
    Gte,
}

/// An operand in the rules: a literal, or a claim of the token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operand {
    Literal(Value),
    Claim(String),
}

/// A test of one column, operands not yet bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleTest {
    Compare(Cmp, Operand),
    In(Vec<Operand>),
    NotIn(Vec<Operand>),
    IsNull(bool),
}

/// A parsed row filter, as the rules file states it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleFilter {
    /// All must hold; empty is `true`.
    And(Vec<RuleFilter>),
    /// One must hold; empty is `false`.
    Or(Vec<RuleFilter>),
    Not(Box<RuleFilter>),
    Test(String, RuleTest),
    /// `column IN (SELECT …)`.
    InSubquery(String, Box<Subquery<RuleFilter>>),
}

/// `SELECT column FROM table WHERE filter` (no `WHERE` is `true`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Subquery<F> {
    pub table: String,
    pub column: String,
    pub filter: F,
}

/// A bound subquery: the set of values of `column` over the rows of `table` that `filter`
/// holds for (NULLs left out).
pub type SetQuery = Subquery<RowFilter>;

/// A row filter with a token's claims in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowFilter {
    /// All must hold; empty is `true`.
    And(Vec<RowFilter>),
    /// One must hold; empty is `false`.
    Or(Vec<RowFilter>),
    Not(Box<RowFilter>),
    Test(String, Test),
    /// The column's value is in the set (a NULL column is unknown).
    InSet(String, Box<SetQuery>),
}

impl RuleFilter {
    /// Parses a `where` text; `Err` is the reason it is refused.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.len() > MAX_FILTER_CHARS {
            return Err(format!(
                "the filter is {} characters long; at most {MAX_FILTER_CHARS} are allowed",
                text.len()
            ));
        }
        let dialect = PostgreSqlDialect {};
        let mut parser = Parser::new(&dialect)
            .try_with_sql(text)
            .map_err(|error| error.to_string())?;
        let expr = parser.parse_expr().map_err(|error| error.to_string())?;
        let next = parser.peek_token();
        if next.token != Token::EOF {
            return Err(format!(
                "unexpected {} after the expression at {}",
                next.token, next.span.start
            ));
        }
        let parsed = filter(&expr)?;
        parsed.refuse_negated_subqueries(false)?;
        Ok(parsed)
    }

    /// Refuses a subquery under `NOT`: a subquery may only let rows in.
    fn refuse_negated_subqueries(&self, negated: bool) -> Result<(), String> {
        match self {
            RuleFilter::And(items) | RuleFilter::Or(items) => items
                .iter()
                .try_for_each(|item| item.refuse_negated_subqueries(negated)),
            RuleFilter::Not(item) => item.refuse_negated_subqueries(!negated),
            RuleFilter::Test(..) => Ok(()),
            RuleFilter::InSubquery(column, subquery) => {
                if negated {
                    return Err(format!(
                        "`{column} IN (SELECT {} FROM {} …)` is under NOT: a subquery may only \
                         let rows in, not keep them out",
                        subquery.column, subquery.table
                    ));
                }
                subquery.filter.refuse_negated_subqueries(false)
            }
        }
    }

    /// The columns of the table the filter reads (not those of its subqueries' tables), in
    /// order, without repeats.
    pub fn columns(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for column in self.own_columns_in_order() {
            if !out.contains(&column) {
                out.push(column);
            }
        }
        out
    }

    fn own_columns_in_order(&self) -> Vec<String> {
        match self {
            RuleFilter::And(items) | RuleFilter::Or(items) => items
                .iter()
                .flat_map(RuleFilter::own_columns_in_order)
                .collect(),
            RuleFilter::Not(item) => item.own_columns_in_order(),
            RuleFilter::Test(column, _) | RuleFilter::InSubquery(column, _) => {
                vec![column.clone()]
            }
        }
    }

    /// The subqueries the filter holds directly (theirs are in their own filters).
    pub fn subqueries(&self) -> Vec<&Subquery<RuleFilter>> {
        let mut out = Vec::new();
        self.visit_own(&mut |_, _| {}, &mut |_, subquery| out.push(subquery));
        out
    }

    /// Every subquery the filter holds, its subqueries' own included, outermost first.
    pub fn all_subqueries(&self) -> Vec<&Subquery<RuleFilter>> {
        let mut out = Vec::new();
        let mut todo = self.subqueries();
        while let Some(subquery) = todo.pop() {
            todo.extend(subquery.filter.subqueries());
            out.push(subquery);
        }
        out
    }

    /// The claims the filter reads, its subqueries' included, in order, without repeats.
    pub fn claims(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let mut nested = Vec::new();
        self.visit_own(
            &mut |_, test| {
                let operands: &[Operand] = match test {
                    RuleTest::Compare(_, operand) => std::slice::from_ref(operand),
                    RuleTest::In(operands) | RuleTest::NotIn(operands) => operands,
                    RuleTest::IsNull(_) => &[],
                };
                for operand in operands {
                    if let Operand::Claim(claim) = operand {
                        if !out.contains(claim) {
                            out.push(claim.clone());
                        }
                    }
                }
            },
            &mut |_, subquery| nested.push(subquery.filter.claims()),
        );
        for claim in nested.into_iter().flatten() {
            if !out.contains(&claim) {
                out.push(claim);
            }
        }
        out
    }

    /// Calls `test` for each test of the table's columns and `subquery` for each subquery
    /// (with the column it tests), not descending into subqueries.
    fn visit_own<'a>(
        &'a self,
        test: &mut impl FnMut(&'a str, &'a RuleTest),
        subquery: &mut impl FnMut(&'a str, &'a Subquery<RuleFilter>),
    ) {
        match self {
            RuleFilter::And(items) | RuleFilter::Or(items) => {
                items.iter().for_each(|item| item.visit_own(test, subquery));
            }
            RuleFilter::Not(item) => item.visit_own(test, subquery),
            RuleFilter::Test(column, t) => test(column, t),
            RuleFilter::InSubquery(column, s) => subquery(column, s),
        }
    }

    /// The filter for a token with these (verified) claims; `Err` names a claim the filter
    /// reads that the token lacks or holds as something other than a string, number or
    /// boolean.
    pub fn bind(&self, claims: &Map<String, Value>) -> Result<RowFilter, String> {
        let value = |operand: &Operand| -> Result<Value, String> {
            match operand {
                Operand::Literal(value) => Ok(value.clone()),
                Operand::Claim(claim) => match claims.get(claim) {
                    Some(value @ (Value::String(_) | Value::Number(_) | Value::Bool(_))) => {
                        Ok(value.clone())
                    }
                    _ => Err(claim.clone()),
                },
            }
        };
        Ok(match self {
            RuleFilter::And(items) => RowFilter::And(
                items
                    .iter()
                    .map(|item| item.bind(claims))
                    .collect::<Result<_, _>>()?,
            ),
            RuleFilter::Or(items) => RowFilter::Or(
                items
                    .iter()
                    .map(|item| item.bind(claims))
                    .collect::<Result<_, _>>()?,
            ),
            RuleFilter::Not(item) => RowFilter::Not(Box::new(item.bind(claims)?)),
            RuleFilter::InSubquery(column, subquery) => RowFilter::InSet(
                column.clone(),
                Box::new(SetQuery {
                    table: subquery.table.clone(),
                    column: subquery.column.clone(),
                    filter: subquery.filter.bind(claims)?,
                }),
            ),
            RuleFilter::Test(column, test) => {
                let test = match test {
                    RuleTest::Compare(cmp, operand) => {
                        let operand = value(operand)?;
                        match cmp {
                            Cmp::Eq => Test::Eq(operand),
                            Cmp::Ne => Test::Ne(operand),
                            Cmp::Lt => Test::Lt(operand),
                            Cmp::Lte => Test::Lte(operand),
                            Cmp::Gt => Test::Gt(operand),
                            Cmp::Gte => Test::Gte(operand),
                        }
                    }
                    RuleTest::In(operands) => {
                        Test::In(operands.iter().map(value).collect::<Result<_, _>>()?)
                    }
                    RuleTest::NotIn(operands) => {
                        Test::NotIn(operands.iter().map(value).collect::<Result<_, _>>()?)
                    }
                    RuleTest::IsNull(null) => Test::IsNull(*null),
                };
                RowFilter::Test(column.clone(), test)
            }
        })
    }
}

/// Whether a value is in a subquery's set; `None` when the set is not known.
pub trait Sets {
    fn contains(&self, set: &SetQuery, value: &Value) -> Option<bool>;
}

/// No set is known: a subquery's test is unknown.
pub struct NoSets;

impl Sets for NoSets {
    fn contains(&self, _: &SetQuery, _: &Value) -> Option<bool> {
        None
    }
}

impl RowFilter {
    /// SQL's three-valued answer for a row (its column values; a missing column is NULL):
    /// `None` is unknown. A subquery's test is unknown here: see [`RowFilter::eval_with`].
    pub fn eval(&self, row: &Map<String, Value>) -> Option<bool> {
        self.eval_with(row, &NoSets)
    }

    /// [`RowFilter::eval`], with subqueries' sets answered by `sets`.
    pub fn eval_with(&self, row: &Map<String, Value>, sets: &dyn Sets) -> Option<bool> {
        self.eval_leaves(&mut |leaf| match leaf {
            RowFilter::InSet(column, set) => match row.get(column) {
                None | Some(Value::Null) => None,
                Some(value) => sets.contains(set, value),
            },
            RowFilter::Test(column, test) => {
                let value = row.get(column).filter(|value| !value.is_null());
                match (test, value) {
                    (Test::IsNull(_), _) => Some(test.passes(value)),
                    (_, None) => None,
                    (_, Some(_)) => Some(test.passes(value)),
                }
            }
            _ => unreachable!("only leaves are passed"),
        })
    }

    /// SQL's three-valued logic over the leaves' answers (`Test` and `InSet`, each asked once,
    /// in the order they are written, with no short cut: the n-th call is the n-th leaf).
    pub fn eval_leaves(&self, leaf: &mut dyn FnMut(&RowFilter) -> Option<bool>) -> Option<bool> {
        match self {
            RowFilter::And(items) => {
                let mut answer = Some(true);
                for item in items {
                    match item.eval_leaves(leaf) {
                        Some(false) => answer = Some(false),
                        None if answer != Some(false) => answer = None,
                        _ => {}
                    }
                }
                answer
            }
            RowFilter::Or(items) => {
                let mut answer = Some(false);
                for item in items {
                    match item.eval_leaves(leaf) {
                        Some(true) => answer = Some(true),
                        None if answer != Some(true) => answer = None,
                        _ => {}
                    }
                }
                answer
            }
            RowFilter::Not(item) => item.eval_leaves(leaf).map(|answer| !answer),
            RowFilter::Test(..) | RowFilter::InSet(..) => leaf(self),
        }
    }

    /// Whether the row is in: the filter is true for it.
    pub fn matches(&self, row: &Map<String, Value>) -> bool {
        self.eval(row) == Some(true)
    }

    /// Whether the filter holds a subquery.
    pub fn has_sets(&self) -> bool {
        match self {
            RowFilter::And(items) | RowFilter::Or(items) => items.iter().any(RowFilter::has_sets),
            RowFilter::Not(item) => item.has_sets(),
            RowFilter::Test(..) => false,
            RowFilter::InSet(..) => true,
        }
    }

    /// The subqueries the filter holds directly, with the column each tests, and whether the
    /// test is one of the filter's top-level conjuncts (then a value leaving the set takes every
    /// row with that value out, whatever the rest of the filter says).
    pub fn sets(&self) -> Vec<(&str, &SetQuery, bool)> {
        fn walk<'a>(
            filter: &'a RowFilter,
            top: bool,
            out: &mut Vec<(&'a str, &'a SetQuery, bool)>,
        ) {
            match filter {
                RowFilter::And(items) => items.iter().for_each(|item| walk(item, top, out)),
                RowFilter::Or(items) if items.len() == 1 => walk(&items[0], top, out),
                RowFilter::Or(items) => items.iter().for_each(|item| walk(item, false, out)),
                RowFilter::Not(item) => walk(item, false, out),
                RowFilter::Test(..) => {}
                RowFilter::InSet(column, set) => out.push((column, set, top)),
            }
        }
        let mut out = Vec::new();
        walk(self, true, &mut out);
        out
    }

    /// The tables the filter's subqueries read, nested ones included, without repeats.
    pub fn set_tables(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for (_, set, _) in self.sets() {
            if !out.contains(&set.table) {
                out.push(set.table.clone());
            }
            for table in set.filter.set_tables() {
                if !out.contains(&table) {
                    out.push(table);
                }
            }
        }
        out
    }

    /// The filter with every row also needing `column` in `values` (a move's read).
    pub fn and_in(&self, column: &str, values: Vec<Value>) -> RowFilter {
        RowFilter::And(vec![
            self.clone(),
            RowFilter::Test(column.to_owned(), Test::In(values)),
        ])
    }
}

/// Canonical text, claims in place: two filters that print the same select the same rows (the
/// scope server shares one set among the subscriptions whose subqueries print alike).
impl fmt::Display for RowFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |f: &mut fmt::Formatter<'_>, items: &[RowFilter], op: &str, empty: &str| {
            if items.is_empty() {
                return f.write_str(empty);
            }
            f.write_str("(")?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    f.write_str(op)?;
                }
                write!(f, "{item}")?;
            }
            f.write_str(")")
        };
        match self {
            RowFilter::And(items) => list(f, items, " AND ", "true"),
            RowFilter::Or(items) => list(f, items, " OR ", "false"),
            RowFilter::Not(item) => write!(f, "(NOT {item})"),
            RowFilter::Test(column, test) => write!(f, "({column:?} {test:?})"),
            RowFilter::InSet(column, set) => write!(f, "({column:?} IN {set})"),
        }
    }
}

impl fmt::Display for SetQuery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "(SELECT {:?} FROM {:?} WHERE {})",
            self.column, self.table, self.filter
        )
    }
}

fn filter(expr: &Expr) -> Result<RuleFilter, String> {
    match expr {
        Expr::Nested(inner) => filter(inner),
        Expr::BinaryOp {
            left,
            op: BinaryOperator::And,
            right,
        } => Ok(RuleFilter::And(flatten(
            vec![filter(left)?, filter(right)?],
            true,
        ))),
        Expr::BinaryOp {
            left,
            op: BinaryOperator::Or,
            right,
        } => Ok(RuleFilter::Or(flatten(
            vec![filter(left)?, filter(right)?],
            false,
        ))),
        Expr::UnaryOp {
            op: UnaryOperator::Not,
            expr,
        } => Ok(RuleFilter::Not(Box::new(filter(expr)?))),
        Expr::BinaryOp { left, op, right } => {
            let cmp = match op {
                BinaryOperator::Eq => Cmp::Eq,
                BinaryOperator::NotEq => Cmp::Ne,
                BinaryOperator::Lt => Cmp::Lt,
                BinaryOperator::LtEq => Cmp::Lte,
                BinaryOperator::Gt => Cmp::Gt,
                BinaryOperator::GtEq => Cmp::Gte,
                other => return Err(format!("the operator {other} is not allowed in `{expr}`")),
            };
            match (column(left), column(right)) {
                (Some(column), None) => Ok(RuleFilter::Test(
                    column,
                    RuleTest::Compare(cmp, operand(right, expr)?),
                )),
                // `5 < priority` is `priority > 5`.
                (None, Some(column)) => Ok(RuleFilter::Test(
                    column,
                    RuleTest::Compare(flip(cmp), operand(left, expr)?),
                )),
                _ => Err([left, right]
                    .into_iter()
                    .find_map(|side| unsupported(side))
                    .unwrap_or_else(|| {
                        format!(
                            "`{expr}` must compare one column of the table with a literal \
                                 or auth.<claim>"
                        )
                    })),
            }
        }
        Expr::IsNull(inner) | Expr::IsNotNull(inner) => {
            let Some(column) = column(inner) else {
                return Err(format!("`{expr}` must test a column of the table"));
            };
            Ok(RuleFilter::Test(
                column,
                RuleTest::IsNull(matches!(expr, Expr::IsNull(_))),
            ))
        }
        Expr::InList {
            expr: inner,
            list,
            negated,
        } => {
            let Some(column) = column(inner) else {
                return Err(format!("`{expr}` must test a column of the table"));
            };
            let operands = list
                .iter()
                .map(|item| operand(item, expr))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(RuleFilter::Test(
                column,
                if *negated {
                    RuleTest::NotIn(operands)
                } else {
                    RuleTest::In(operands)
                },
            ))
        }
        Expr::Between {
            expr: inner,
            negated,
            low,
            high,
        } => {
            let Some(column) = column(inner) else {
                return Err(format!("`{expr}` must test a column of the table"));
            };
            let between = RuleFilter::And(vec![
                RuleFilter::Test(
                    column.clone(),
                    RuleTest::Compare(Cmp::Gte, operand(low, expr)?),
                ),
                RuleFilter::Test(column, RuleTest::Compare(Cmp::Lte, operand(high, expr)?)),
            ]);
            Ok(if *negated {
                RuleFilter::Not(Box::new(between))
            } else {
                between
            })
        }
        Expr::Value(value) => match &value.value {
            Literal::Boolean(true) => Ok(RuleFilter::And(Vec::new())),
            Literal::Boolean(false) => Ok(RuleFilter::Or(Vec::new())),
            _ => Err(format!("`{expr}` is not a condition")),
        },
        Expr::InSubquery {
            expr: inner,
            subquery,
            negated,
        } => {
            let Some(column) = column(inner) else {
                return Err(format!("`{expr}` must test a column of the table"));
            };
            if *negated {
                return Err(format!(
                    "`{expr}`: NOT IN (SELECT …) is not allowed: a subquery may only let rows \
                     in (write `col IN (SELECT …)`)"
                ));
            }
            Ok(RuleFilter::InSubquery(
                column,
                Box::new(subquery_of(subquery)?),
            ))
        }
        Expr::Subquery(_) | Expr::Exists { .. } => Err(format!(
            "`{expr}`: a subquery may only be the list of `column IN (SELECT column FROM \
             table WHERE …)`"
        )),
        Expr::Function(function) => Err(format!(
            "`{expr}`: functions ({}) are not allowed",
            function.name
        )),
        other => match column(other) {
            // A boolean column alone: `shared` is `shared = true`.
            Some(column) => Ok(RuleFilter::Test(
                column,
                RuleTest::Compare(Cmp::Eq, Operand::Literal(Value::Bool(true))),
            )),
            None => Err(format!(
                "`{other}` is not allowed: a row filter compares the table's columns with \
                 literals and auth.<claim>, joined by AND, OR and NOT"
            )),
        },
    }
}

/// The reason a part of a comparison is refused, when it is something a row filter cannot
/// hold at all (rather than a misplaced column or literal).
fn unsupported(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Nested(inner) => unsupported(inner),
        Expr::Function(function) => Some(format!(
            "`{expr}`: functions ({}) are not allowed",
            function.name
        )),
        Expr::Subquery(_) => Some(format!(
            "`{expr}`: a subquery may only be the list of `column IN (SELECT column FROM \
             table WHERE …)`"
        )),
        Expr::CompoundIdentifier(parts)
            if !(parts.len() == 2 && parts[0].value.eq_ignore_ascii_case("auth")) =>
        {
            Some(format!(
                "`{expr}`: only auth.<claim> may be qualified; another table's columns are \
                 reached through a subquery"
            ))
        }
        _ => None,
    }
}

/// `SELECT column FROM table [WHERE filter]`, and nothing else.
fn subquery_of(query: &Query) -> Result<Subquery<RuleFilter>, String> {
    let shape = || {
        format!(
            "`{query}`: a subquery must be `SELECT column FROM table [WHERE …]`, with no \
             joins, aliases, DISTINCT, grouping, ordering or limit"
        )
    };
    let SetExpr::Select(select) = query.body.as_ref() else {
        return Err(shape());
    };
    let [from] = select.from.as_slice() else {
        return Err(shape());
    };
    let [SelectItem::UnnamedExpr(projected)] = select.projection.as_slice() else {
        return Err(shape());
    };
    let TableFactor::Table {
        name, alias: None, ..
    } = &from.relation
    else {
        return Err(shape());
    };
    let [part] = name.0.as_slice() else {
        return Err(format!(
            "`{query}`: name the table as the rules do, without a schema"
        ));
    };
    let table = part
        .as_ident()
        .map(|ident| {
            if ident.quote_style.is_some() {
                ident.value.clone()
            } else {
                ident.value.to_lowercase()
            }
        })
        .ok_or_else(shape)?;
    let Some(selected) = column(projected) else {
        return Err(format!(
            "`{query}`: a subquery selects one column of its table"
        ));
    };
    // Anything the parts above do not account for (joins, DISTINCT, GROUP BY, ORDER BY,
    // LIMIT, WITH, …) prints differently.
    let rebuilt = match &select.selection {
        Some(selection) => format!("SELECT {projected} FROM {name} WHERE {selection}"),
        None => format!("SELECT {projected} FROM {name}"),
    };
    if query.to_string() != rebuilt || !from.joins.is_empty() {
        return Err(shape());
    }
    let filter = match &select.selection {
        Some(selection) => filter(selection)?,
        None => RuleFilter::And(Vec::new()),
    };
    Ok(Subquery {
        table,
        column: selected,
        filter,
    })
}

/// Merges nested `AND`s (or `OR`s) into one list.
fn flatten(items: Vec<RuleFilter>, and: bool) -> Vec<RuleFilter> {
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        match item {
            RuleFilter::And(inner) if and => out.extend(inner),
            RuleFilter::Or(inner) if !and => out.extend(inner),
            other => out.push(other),
        }
    }
    out
}

fn flip(cmp: Cmp) -> Cmp {
    match cmp {
        Cmp::Lt => Cmp::Gt,
        Cmp::Lte => Cmp::Gte,
        Cmp::Gt => Cmp::Lt,
        Cmp::Gte => Cmp::Lte,
        same => same,
    }
}

/// The column an expression names, if it is a plain (unqualified) column. A name is folded
/// to lower case unless quoted, as Postgres folds it.
fn column(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Nested(inner) => column(inner),
        Expr::Identifier(ident) => Some(if ident.quote_style.is_some() {
            ident.value.clone()
        } else {
            ident.value.to_lowercase()
        }),
        _ => None,
    }
}

/// A literal or `auth.<claim>`; `within` names the whole test in errors.
fn operand(expr: &Expr, within: &Expr) -> Result<Operand, String> {
    match expr {
        Expr::Nested(inner) => operand(inner, within),
        Expr::Value(value) => match &value.value {
            Literal::Number(text, _) => text
                .parse::<Number>()
                .map(|n| Operand::Literal(Value::Number(n)))
                .map_err(|_| format!("`{text}` in `{within}` is not a number")),
            Literal::SingleQuotedString(text) => Ok(Operand::Literal(Value::String(text.clone()))),
            Literal::Boolean(flag) => Ok(Operand::Literal(Value::Bool(*flag))),
            Literal::Null => Err(format!(
                "`{within}` compares with NULL, which is never true: use IS NULL or IS NOT NULL"
            )),
            other => Err(format!("the literal {other} in `{within}` is not allowed")),
        },
        Expr::UnaryOp {
            op: UnaryOperator::Minus,
            expr: inner,
        } => match operand(inner, within)? {
            Operand::Literal(Value::Number(n)) => format!("-{n}")
                .parse::<Number>()
                .map(|n| Operand::Literal(Value::Number(n)))
                .map_err(|_| format!("`{expr}` in `{within}` is not a number")),
            _ => Err(format!("`{expr}` in `{within}` is not a number")),
        },
        Expr::CompoundIdentifier(parts)
            if parts.len() == 2 && parts[0].value.eq_ignore_ascii_case("auth") =>
        {
            Ok(Operand::Claim(parts[1].value.clone()))
        }
        Expr::CompoundIdentifier(_) => Err(format!(
            "`{expr}` in `{within}`: only auth.<claim> may be qualified; another table's \
             columns are reached through a subquery"
        )),
        other => Err(format!(
            "`{other}` in `{within}` must be a literal or auth.<claim>"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => panic!("an object"),
        }
    }

    fn claims() -> Map<String, Value> {
        row(json!({"sub": "ada", "org": 7, "admin": false, "groups": ["a"]}))
    }

    fn holds(text: &str, data: Value) -> Option<bool> {
        RuleFilter::parse(text)
            .expect("parses")
            .bind(&claims())
            .expect("binds")
            .eval(&row(data))
    }

    #[test]
    fn filters_parse_into_tests_of_columns_against_literals_and_claims() {
        let parsed = RuleFilter::parse(
            "owner = auth.sub OR (Shared AND NOT \"Deleted\" IS NOT NULL) OR 3 < priority",
        )
        .expect("parses");
        assert_eq!(parsed.columns(), ["owner", "shared", "Deleted", "priority"]);
        assert_eq!(parsed.claims(), ["sub"]);
        assert_eq!(
            parsed,
            RuleFilter::Or(vec![
                RuleFilter::Test(
                    "owner".into(),
                    RuleTest::Compare(Cmp::Eq, Operand::Claim("sub".into()))
                ),
                RuleFilter::And(vec![
                    RuleFilter::Test(
                        "shared".into(),
                        RuleTest::Compare(Cmp::Eq, Operand::Literal(json!(true)))
                    ),
                    RuleFilter::Not(Box::new(RuleFilter::Test(
                        "Deleted".into(),
                        RuleTest::IsNull(false)
                    ))),
                ]),
                RuleFilter::Test(
                    "priority".into(),
                    RuleTest::Compare(Cmp::Gt, Operand::Literal(json!(3)))
                ),
            ])
        );
    }

    #[test]
    fn anything_else_is_refused_with_a_reason() {
        for (text, reason) in [
            ("lower(owner) = 'ada'", "functions (lower) are not allowed"),
            (
                "project_id NOT IN (SELECT project_id FROM members)",
                "may only let rows in",
            ),
            (
                "NOT (project_id IN (SELECT project_id FROM members))",
                "under NOT",
            ),
            (
                "p IN (SELECT project_id FROM members m)",
                "a subquery must be",
            ),
            (
                "p IN (SELECT DISTINCT project_id FROM members)",
                "a subquery must be",
            ),
            (
                "p IN (SELECT project_id FROM members LIMIT 3)",
                "a subquery must be",
            ),
            (
                "p IN (SELECT project_id FROM members JOIN x ON true)",
                "a subquery must be",
            ),
            (
                "p IN (SELECT project_id FROM members GROUP BY project_id)",
                "a subquery must be",
            ),
            (
                "p IN (SELECT project_id, user_id FROM members)",
                "a subquery must be",
            ),
            (
                "p IN (SELECT project_id FROM public.members)",
                "without a schema",
            ),
            (
                "p IN (SELECT project_id FROM members WHERE todos.x = 1)",
                "only auth.<claim> may be qualified",
            ),
            (
                "p IN (SELECT lower(project_id) FROM members)",
                "selects one column",
            ),
            ("EXISTS (SELECT 1 FROM members)", "a subquery may only be"),
            (
                "p = (SELECT 1 FROM members)",
                "must be a literal or auth.<claim>",
            ),
            ("todos.owner = 'ada'", "only auth.<claim> may be qualified"),
            ("owner = NULL", "use IS NULL"),
            ("owner LIKE 'a%'", "not allowed"),
            ("a = b", "must compare one column"),
            ("1 = 1", "must compare one column"),
            ("owner = 'ada' garbage", "unexpected"),
            ("owner = ", "Expected"),
            ("owner + 1 > 2", "must compare one column"),
        ] {
            let error = RuleFilter::parse(text).expect_err(text);
            assert!(error.contains(reason), "{text}: {error}");
        }
        assert!(RuleFilter::parse(&"a = 1 OR ".repeat(2000)).is_err());
    }

    #[test]
    fn three_valued_logic_as_sql_has_it() {
        assert_eq!(
            holds("owner = auth.sub", json!({"owner": "ada"})),
            Some(true)
        );
        assert_eq!(holds("owner = auth.sub", json!({"owner": null})), None);
        assert_eq!(holds("NOT owner = auth.sub", json!({"owner": null})), None);
        assert_eq!(
            holds("owner = 'x' OR n > 1", json!({"owner": null, "n": 2})),
            Some(true)
        );
        assert_eq!(
            holds("owner = 'x' OR n > 1", json!({"owner": null, "n": 0})),
            None
        );
        assert_eq!(
            holds("owner = 'x' AND n > 1", json!({"owner": "y"})),
            Some(false)
        );
        assert_eq!(holds("n NOT BETWEEN 1 AND 3", json!({"n": 5})), Some(true));
        assert_eq!(holds("n BETWEEN -1 AND 3", json!({"n": -1})), Some(true));
        assert_eq!(
            holds("org IN (1, auth.org)", json!({"org": "7"})),
            Some(true)
        );
        assert_eq!(holds("shared", json!({"shared": true})), Some(true));
        assert_eq!(holds("NOT shared", json!({})), None);
        assert_eq!(holds("deleted_at IS NULL", json!({})), Some(true));
        assert_eq!(holds("true", json!({})), Some(true));
        assert_eq!(
            holds("admin = auth.admin", json!({"admin": false})),
            Some(true)
        );
    }

    #[test]
    fn subqueries_nest_bind_their_claims_and_answer_through_the_sets() {
        let parsed = RuleFilter::parse(
            "todo_id IN (SELECT id FROM Todos WHERE project_id IN \
             (SELECT project_id FROM members WHERE user_id = auth.sub AND role <> 'gone')) \
             AND NOT hidden",
        )
        .expect("parses");
        assert_eq!(parsed.columns(), ["todo_id", "hidden"]);
        assert_eq!(parsed.claims(), ["sub"]);
        let [todos] = parsed.subqueries()[..] else {
            panic!("one subquery")
        };
        assert_eq!(
            (todos.table.as_str(), todos.column.as_str()),
            ("todos", "id")
        );
        let [members] = todos.filter.subqueries()[..] else {
            panic!("one nested subquery")
        };
        assert_eq!(members.filter.columns(), ["user_id", "role"]);
        assert!(RuleFilter::parse("p IN (SELECT project_id FROM members)").is_ok());

        let bound = parsed.bind(&claims()).expect("binds");
        assert!(bound.has_sets());
        assert_eq!(bound.set_tables(), ["todos", "members"]);
        let [(column, set, top)] = bound.sets()[..] else {
            panic!("one set")
        };
        assert_eq!((column, top), ("todo_id", true));
        // The sets answer: todo 7 is in, 8 is not; NULL is unknown, as SQL has it.
        struct Todos;
        impl Sets for Todos {
            fn contains(&self, set: &SetQuery, value: &Value) -> Option<bool> {
                assert_eq!(set.table, "todos");
                Some(value == &json!(7))
            }
        }
        let eval = |row: Value| bound.eval_with(&super::tests::row(row), &Todos);
        assert_eq!(eval(json!({"todo_id": 7, "hidden": false})), Some(true));
        assert_eq!(eval(json!({"todo_id": 8, "hidden": false})), Some(false));
        assert_eq!(eval(json!({"todo_id": null, "hidden": false})), None);
        assert_eq!(eval(json!({"todo_id": 7, "hidden": true})), Some(false));
        assert_eq!(set.to_string().matches("SELECT").count(), 2, "{set}");
        // A claim the token lacks inside a subquery fails to bind, as outside one.
        assert_eq!(parsed.bind(&row(json!({"org": 1}))), Err("sub".to_owned()));
    }

    #[test]
    fn a_claim_the_token_lacks_or_holds_as_a_list_fails_to_bind() {
        let filter = RuleFilter::parse("owner = auth.sub AND team IN (auth.team)").expect("parses");
        assert_eq!(filter.bind(&claims()), Err("team".to_owned()));
        let groups = RuleFilter::parse("g = auth.groups").expect("parses");
        assert_eq!(groups.bind(&claims()), Err("groups".to_owned()));
    }
}
