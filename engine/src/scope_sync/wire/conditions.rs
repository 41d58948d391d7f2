//! A scope's conditions: parsing, validation, matching a row, and the routing key.
//!
//! `conditions` in subscribe params map a column to what its value must satisfy:
//!
//! - a scalar (string, number, boolean) is equality, as velocious has it: `{"owner": "ada"}`;
//!   a scalar `null` is `{"isNull": true}`;
//! - an array is membership: `{"status": ["open", "doing"]}` (an empty array matches no row);
//! - an object holds operators, all of which must hold: `{"priority": {"gte": 3, "lt": 10}}`,
//!   with `eq`, `ne`, `in`, `notIn`, `lt`, `lte`, `gt`, `gte` and `isNull`.
//!
//! All conditions of a scope are ANDed. NULL (or a missing column) never satisfies a
//! comparison, `ne` and `notIn` included, as in SQL; only `isNull` tests for it.
//!
//! How a value compares with an operand follows the row value's type, which is its column's
//! type in the replica ([`compare`]): numbers numerically (timestamps are numbers, Unix
//! milliseconds, and an ISO-8601 operand is read as its instant), booleans with `false <
//! true`, text by code point (byte order of UTF-8, SQL's `COLLATE "C"`). A number or boolean
//! operand against a text column compares as its JS string form (`5` is `"5"`), and a numeric
//! string against a number column as its number, so the equality scopes of velocious keep
//! their meaning. An operand that cannot be read as the column's type matches nothing.
//!
//! This type is the only place these rules are written: the scope server's routing and
//! delivery, the client's validation, the simulation and the replica's SQL builder all use
//! it.

use std::cmp::Ordering;

use serde_json::{Map, Number, Value};

use crate::scope_sync::coercion::{describe, js_string_form};
use crate::scope_sync::cursor::instant_ms;

/// The most values one `in` or `notIn` list may hold.
pub const MAX_LIST_VALUES: usize = 1_000;

/// The operators of a condition object, as the protocol spells them.
pub const OPERATORS: [&str; 9] = [
    "eq", "ne", "in", "notIn", "lt", "lte", "gt", "gte", "isNull",
];

/// One test a column's value must pass. Operands are strings, numbers or booleans; lists may
/// also hold nulls, which equal nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Test {
    Eq(Value),
    Ne(Value),
    In(Vec<Value>),
    NotIn(Vec<Value>),
    Lt(Value),
    Lte(Value),
    Gt(Value),
    Gte(Value),
    /// `true`: the value is NULL (or missing); `false`: it is not.
    IsNull(bool),
}

/// A scope's conditions: per column, the tests its value must all pass.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Conditions {
    /// By column name, in order. A sorted list rather than a map: a scope tests a column or
    /// two, and each subscription holds its own copy (a map's node is allocated for eleven).
    columns: Vec<(String, Vec<Test>)>,
}

/// Why a condition was refused; the subscription fails with `invalid-params`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConditionError {
    #[error(
        "expected condition {column:?} to be a string, number, boolean, null, an array of those \
         or an object of operators, got {found}"
    )]
    BadValue { column: String, found: String },
    #[error(
        "condition {column:?} has the unknown operator {operator:?}; expected eq, ne, in, notIn, \
         lt, lte, gt, gte or isNull"
    )]
    UnknownOperator { column: String, operator: String },
    #[error("condition {column:?} is an object without operators")]
    NoOperator { column: String },
    #[error("expected {column:?}.{operator} to be {expected}, got {found}")]
    BadOperand {
        column: String,
        operator: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error("condition {column:?} lists {found} values; at most {MAX_LIST_VALUES} are allowed")]
    TooManyValues { column: String, found: usize },
}

impl Conditions {
    /// Parses and validates the `conditions` object of subscribe params.
    pub fn parse(conditions: &Map<String, Value>) -> Result<Self, ConditionError> {
        let mut columns = Vec::with_capacity(conditions.len());
        for (column, value) in conditions {
            columns.push((column.clone(), tests_of(column, value)?));
        }
        // The keys of a JSON object are unique.
        columns.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Self { columns })
    }

    /// No conditions: every row of the table.
    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }

    /// The columns the conditions test, in order.
    pub fn columns(&self) -> impl Iterator<Item = &str> {
        self.columns.iter().map(|(column, _)| column.as_str())
    }

    /// Every (column, test), columns in order.
    pub fn tests(&self) -> impl Iterator<Item = (&str, &Test)> {
        self.columns
            .iter()
            .flat_map(|(column, tests)| tests.iter().map(move |test| (column.as_str(), test)))
    }

    /// The value `column` must equal, if one of its tests is equality.
    pub fn equality(&self, column: &str) -> Option<&Value> {
        let (_, tests) = self.columns.iter().find(|(name, _)| name == column)?;
        tests.iter().find_map(|test| match test {
            Test::Eq(value) => Some(value),
            _ => None,
        })
    }

    /// The column and value a scope is routed by: the first column (in order) with an
    /// equality test. A scope without one is routed by its table alone.
    pub fn routing_key(&self) -> Option<(&str, &Value)> {
        self.columns.iter().find_map(|(column, tests)| {
            tests.iter().find_map(|test| match test {
                Test::Eq(value) => Some((column.as_str(), value)),
                _ => None,
            })
        })
    }

    /// Whether a row (its column values; a missing column is NULL) satisfies every condition.
    pub fn matches(&self, row: &Map<String, Value>) -> bool {
        self.columns.iter().all(|(column, tests)| {
            let value = row.get(column);
            tests.iter().all(|test| test.passes(value))
        })
    }
}

impl Test {
    /// Whether `value` (`None` or `null`: NULL) passes this test.
    pub fn passes(&self, value: Option<&Value>) -> bool {
        let value = value.filter(|value| !value.is_null());
        if let Test::IsNull(null) = self {
            return value.is_none() == *null;
        }
        let Some(value) = value else {
            return false;
        };
        let differs = |operand: &Value| {
            matches!(
                compare(value, operand),
                Some(Ordering::Less | Ordering::Greater)
            )
        };
        match self {
            Test::Eq(operand) => compare(value, operand) == Some(Ordering::Equal),
            Test::Ne(operand) => differs(operand),
            Test::In(operands) => operands
                .iter()
                .any(|operand| compare(value, operand) == Some(Ordering::Equal)),
            Test::NotIn(operands) => operands.iter().all(differs),
            Test::Lt(operand) => compare(value, operand) == Some(Ordering::Less),
            Test::Lte(operand) => matches!(
                compare(value, operand),
                Some(Ordering::Less | Ordering::Equal)
            ),
            Test::Gt(operand) => compare(value, operand) == Some(Ordering::Greater),
            Test::Gte(operand) => matches!(
                compare(value, operand),
                Some(Ordering::Greater | Ordering::Equal)
            ),
            Test::IsNull(_) => unreachable!("answered above"),
        }
    }
}

/// How a row's non-null `value` orders against an operand, by the value's type (see the
/// module docs); `None` when the operand cannot be read as that type, or the value is an
/// array or object.
pub fn compare(value: &Value, operand: &Value) -> Option<Ordering> {
    match value {
        Value::Number(number) => compare_numbers(number, &operand_number(operand)?),
        Value::String(text) => {
            let operand = match operand {
                Value::String(operand) => return Some(text.as_bytes().cmp(operand.as_bytes())),
                Value::Number(_) | Value::Bool(_) => js_string_form(operand),
                _ => return None,
            };
            Some(text.as_bytes().cmp(operand.as_bytes()))
        }
        Value::Bool(flag) => Some(flag.cmp(&operand_bool(operand)?)),
        _ => None,
    }
}

/// An operand read as a number column's value: a number, a numeric string, or an ISO-8601
/// timestamp (its Unix milliseconds).
pub fn operand_number(operand: &Value) -> Option<Number> {
    match operand {
        Value::Number(number) => Some(number.clone()),
        Value::String(text) => {
            let trimmed = text.trim();
            if let Ok(number) = trimmed.parse::<Number>() {
                return Some(number);
            }
            instant_ms(trimmed).map(Number::from)
        }
        _ => None,
    }
}

/// An operand read as a boolean column's value: a boolean, `"true"` or `"false"`.
pub fn operand_bool(operand: &Value) -> Option<bool> {
    match operand {
        Value::Bool(flag) => Some(*flag),
        Value::String(text) if text == "true" => Some(true),
        Value::String(text) if text == "false" => Some(false),
        _ => None,
    }
}

/// An operand read as a text column's value: a string, or a number's or boolean's JS string
/// form.
pub fn operand_text(operand: &Value) -> Option<String> {
    match operand {
        Value::String(text) => Some(text.clone()),
        Value::Number(_) | Value::Bool(_) => Some(js_string_form(operand)),
        _ => None,
    }
}

/// Orders two JSON numbers: exactly as integers when both are, otherwise as doubles.
fn compare_numbers(a: &Number, b: &Number) -> Option<Ordering> {
    let integer = |n: &Number| {
        n.as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from))
    };
    match (integer(a), integer(b)) {
        (Some(a), Some(b)) => Some(a.cmp(&b)),
        _ => a.as_f64()?.partial_cmp(&b.as_f64()?),
    }
}

fn tests_of(column: &str, value: &Value) -> Result<Vec<Test>, ConditionError> {
    match value {
        Value::Null => Ok(vec![Test::IsNull(true)]),
        Value::String(_) | Value::Number(_) | Value::Bool(_) => Ok(vec![Test::Eq(value.clone())]),
        Value::Array(_) => Ok(vec![Test::In(list(column, "in", value)?)]),
        Value::Object(operators) => {
            if operators.is_empty() {
                return Err(ConditionError::NoOperator {
                    column: column.to_owned(),
                });
            }
            let mut tests = Vec::with_capacity(operators.len());
            for (operator, operand) in operators {
                let Some(&name) = OPERATORS.iter().find(|name| **name == operator) else {
                    return Err(ConditionError::UnknownOperator {
                        column: column.to_owned(),
                        operator: operator.clone(),
                    });
                };
                let scalar = || scalar(column, name, operand);
                tests.push(match name {
                    "eq" => Test::Eq(scalar()?),
                    "ne" => Test::Ne(scalar()?),
                    "in" => Test::In(list(column, name, operand)?),
                    "notIn" => Test::NotIn(list(column, name, operand)?),
                    "lt" => Test::Lt(scalar()?),
                    "lte" => Test::Lte(scalar()?),
                    "gt" => Test::Gt(scalar()?),
                    "gte" => Test::Gte(scalar()?),
                    _ => match operand {
                        Value::Bool(null) => Test::IsNull(*null),
                        other => {
                            return Err(ConditionError::BadOperand {
                                column: column.to_owned(),
                                operator: name,
                                expected: "true or false",
                                found: describe(other),
                            })
                        }
                    },
                });
            }
            Ok(tests)
        }
    }
}

fn scalar(column: &str, operator: &'static str, operand: &Value) -> Result<Value, ConditionError> {
    match operand {
        Value::String(_) | Value::Number(_) | Value::Bool(_) => Ok(operand.clone()),
        other => Err(ConditionError::BadOperand {
            column: column.to_owned(),
            operator,
            expected: "a string, number or boolean (NULL is tested with isNull)",
            found: describe(other),
        }),
    }
}

fn list(
    column: &str,
    operator: &'static str,
    operand: &Value,
) -> Result<Vec<Value>, ConditionError> {
    let Value::Array(items) = operand else {
        return Err(ConditionError::BadOperand {
            column: column.to_owned(),
            operator,
            expected: "an array of strings, numbers, booleans or nulls",
            found: describe(operand),
        });
    };
    if items.len() > MAX_LIST_VALUES {
        return Err(ConditionError::TooManyValues {
            column: column.to_owned(),
            found: items.len(),
        });
    }
    items
        .iter()
        .map(|item| match item {
            // A null in a list is velocious-valid; it equals nothing, and makes `notIn`
            // unknown, as in SQL.
            Value::Null | Value::String(_) | Value::Number(_) | Value::Bool(_) => Ok(item.clone()),
            other => Err(ConditionError::BadOperand {
                column: column.to_owned(),
                operator,
                expected: "an array of strings, numbers, booleans or nulls",
                found: format!("an array holding {}", describe(other)),
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests;
