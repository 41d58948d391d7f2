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
//! Not supported yet: a filter reads the table's own columns only, so rows reached through
//! another table (a membership table, with rows moving in when it changes) cannot be filtered
//! for; subqueries are refused at load. A column the filter names that the table lacks stops
//! the server at its start ([`SyncRules::schema_problems`](crate::scope_rules::SyncRules::schema_problems)).

use serde_json::{Map, Number, Value};
use sqlparser::ast::{BinaryOperator, Expr, UnaryOperator, Value as Literal};
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
}

/// A row filter with a token's claims in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowFilter {
    /// All must hold; empty is `true`.
    And(Vec<RowFilter>),
    /// One must hold; empty is `false`.
    Or(Vec<RowFilter>),
    Not(Box<RowFilter>),
    Test(String, Test),
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
        filter(&expr)
    }

    /// The columns the filter reads, in order, without repeats.
    pub fn columns(&self) -> Vec<String> {
        let mut out = Vec::new();
        self.visit(&mut |column, _| {
            if !out.iter().any(|c| c == column) {
                out.push(column.to_owned());
            }
        });
        out
    }

    /// The claims the filter reads, in order, without repeats.
    pub fn claims(&self) -> Vec<String> {
        let mut out = Vec::new();
        self.visit(&mut |_, test| {
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
        });
        out
    }

    fn visit(&self, f: &mut impl FnMut(&str, &RuleTest)) {
        match self {
            RuleFilter::And(items) | RuleFilter::Or(items) => {
                items.iter().for_each(|item| item.visit(f));
            }
            RuleFilter::Not(item) => item.visit(f),
            RuleFilter::Test(column, test) => f(column, test),
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

impl RowFilter {
    /// SQL's three-valued answer for a row (its column values; a missing column is NULL):
    /// `None` is unknown.
    pub fn eval(&self, row: &Map<String, Value>) -> Option<bool> {
        match self {
            RowFilter::And(items) => {
                let mut answer = Some(true);
                for item in items {
                    match item.eval(row) {
                        Some(false) => return Some(false),
                        None => answer = None,
                        Some(true) => {}
                    }
                }
                answer
            }
            RowFilter::Or(items) => {
                let mut answer = Some(false);
                for item in items {
                    match item.eval(row) {
                        Some(true) => return Some(true),
                        None => answer = None,
                        Some(false) => {}
                    }
                }
                answer
            }
            RowFilter::Not(item) => item.eval(row).map(|answer| !answer),
            RowFilter::Test(column, test) => {
                let value = row.get(column).filter(|value| !value.is_null());
                match (test, value) {
                    (Test::IsNull(_), _) => Some(test.passes(value)),
                    (_, None) => None,
                    (_, Some(_)) => Some(test.passes(value)),
                }
            }
        }
    }

    /// Whether the row is in: the filter is true for it.
    pub fn matches(&self, row: &Map<String, Value>) -> bool {
        self.eval(row) == Some(true)
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
        Expr::InSubquery { .. } | Expr::Subquery(_) | Expr::Exists { .. } => Err(format!(
            "`{expr}`: subqueries (rows reached through another table) are not supported yet"
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
            "`{expr}`: subqueries (rows reached through another table) are not supported yet"
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
                "project_id IN (SELECT project_id FROM members)",
                "subqueries",
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
    fn a_claim_the_token_lacks_or_holds_as_a_list_fails_to_bind() {
        let filter = RuleFilter::parse("owner = auth.sub AND team IN (auth.team)").expect("parses");
        assert_eq!(filter.bind(&claims()), Err("team".to_owned()));
        let groups = RuleFilter::parse("g = auth.groups").expect("parses");
        assert_eq!(groups.bind(&claims()), Err("groups".to_owned()));
    }
}
