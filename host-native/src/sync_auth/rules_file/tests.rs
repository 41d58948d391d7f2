use std::path::PathBuf;

use super::*;

/// The same rules in JSON and in YAML (block and flow style, a folded `where`, a plain
/// multi-line `where`, an anchor and its alias, comments).
const JSON: &str = r#"{"tables": {
  "todos": {"filterColumns": ["owner", "done"], "omitColumns": ["secret_note"],
            "require": {"owner": "sub"},
            "write": {"insert": true, "update": ["owner", "done"], "delete": false}},
  "docs": {"filterColumns": ["priority"],
           "where": "(owner = auth.sub OR (shared AND org = auth.org)) AND deleted_at IS NULL"},
  "notes": {"filterColumns": ["owner"], "where": "owner = auth.sub OR shared"}
}}"#;

const YAML: &str = "\
# Which tables apps may read, and which rows of them.
tables:
  todos:
    filterColumns: &columns [owner, done]
    omitColumns:
      - secret_note
    require: { owner: sub }
    write:
      insert: true
      update: *columns
      delete: false
  docs:
    filterColumns: [\"priority\"]
    where: >-
      (owner = auth.sub OR (shared AND org = auth.org))
      AND deleted_at IS NULL
  notes:
    filterColumns: [owner]
    where: owner = auth.sub
      OR shared
";

fn yaml(text: &str) -> Result<SyncRules, RulesFileError> {
    parse_rules(text, RulesFormat::Yaml)
}

/// The line, column and reason of a YAML refusal.
fn refused(text: &str) -> (usize, usize, String) {
    match yaml(text) {
        Err(RulesFileError::Yaml {
            line,
            column,
            reason,
        }) => (line, column, reason),
        other => panic!("expected a YAML refusal, got {other:?}"),
    }
}

/// The line and the engine's error of a rule refused in YAML.
fn refused_rule(text: &str) -> (usize, RulesError) {
    match yaml(text) {
        Err(RulesFileError::RulesAt { line, source }) => (line, source),
        other => panic!("expected a rule refused at a line, got {other:?}"),
    }
}

#[test]
fn yaml_and_json_forms_read_as_the_same_rules() {
    let from_json = parse_rules(JSON, RulesFormat::Json).expect("JSON rules");
    assert_eq!(from_json, SyncRules::from_json(JSON).expect("JSON rules"));
    assert_eq!(yaml(YAML).expect("YAML rules"), from_json);
    // JSON is YAML too (flow style).
    assert_eq!(yaml(JSON).expect("JSON read as YAML"), from_json);
}

#[test]
fn a_yaml_syntax_error_names_its_line_and_column() {
    let (line, column, reason) = refused("tables:\n  todos:\n    filterColumns: [owner\n");
    assert_eq!(line, 4, "{reason}");
    assert!(column >= 1, "{column}");
    assert!(reason.starts_with("not valid YAML: "), "{reason}");
    let (line, column, reason) =
        refused("tables:\n  todos:\n    filterColumns: [owner]\n    omitColumns: [a]: b\n");
    assert_eq!((line, column), (4, 21), "{reason}");
    let shown = yaml("tables:\n  todos: {\n")
        .expect_err("refused")
        .to_string();
    assert!(
        shown.starts_with("line 3, column 1: not valid YAML: "),
        "{shown}"
    );
}

#[test]
fn a_key_twice_in_a_map_is_refused_with_both_lines() {
    let (line, column, reason) =
        refused("tables:\n  todos:\n    filterColumns: [owner]\n    filterColumns: [done]\n");
    assert_eq!((line, column), (4, 5));
    assert_eq!(
        reason,
        r#"expected each key once in a map, got "filterColumns" again (first on line 3)"#
    );
    // The same key written another way is the same key.
    let (line, _, reason) = refused("tables:\n  todos: {}\n  \"todos\": {}\n");
    assert_eq!(line, 3);
    assert!(
        reason.contains(r#""todos" again (first on line 2)"#),
        "{reason}"
    );
    // A key of another map may be the same.
    yaml("tables:\n  a: {filterColumns: [id]}\n  b: {filterColumns: [id]}\n").expect("rules");
}

#[test]
fn tags_are_refused_and_the_core_schema_s_are_kept() {
    for (text, tag, line) in [
        (
            "tables:\n  todos:\n    where: !sql owner = auth.sub\n",
            "!sql",
            3,
        ),
        ("tables: !rules\n  todos: {}\n", "!rules", 1),
        (
            "tables:\n  todos:\n    filterColumns: !cols [owner]\n",
            "!cols",
            3,
        ),
        (
            "tables:\n  todos:\n    where: !!binary b3duZXI=\n",
            "!!binary",
            3,
        ),
        ("tables:\n  todos:\n    write: !!set {insert}\n", "!!set", 3),
    ] {
        let (at, _, reason) = refused(text);
        assert_eq!(at, line, "{text}");
        assert!(
            reason.starts_with(&format!("expected a plain value, got the tag {tag} ")),
            "{reason}"
        );
    }
    let tagged = "tables: !!map\n  todos:\n    filterColumns: !!seq [!!str true]\n    write: {insert: !!bool true}\n";
    let rules = yaml(tagged).expect("core tags");
    let plain = yaml("tables: {todos: {filterColumns: [\"true\"], write: {insert: true}}}\n")
        .expect("rules");
    assert_eq!(rules, plain);
    let (_, _, reason) = refused("tables:\n  todos:\n    write: {insert: !!bool yes}\n");
    assert_eq!(reason, r#"expected a value !!bool can hold, got "yes""#);
}

#[test]
fn keys_that_are_not_strings_are_refused() {
    for (text, got) in [
        ("tables:\n  1: {}\n", "got 1 (quote it"),
        ("tables:\n  true: {}\n", "got true (quote it"),
        ("tables:\n  ~: {}\n", "got null"),
        ("tables:\n  ? [a, b]\n  : {}\n", "got a list"),
        ("tables:\n  {a: b}: {}\n", "got a map"),
    ] {
        let (line, _, reason) = refused(text);
        assert_eq!(line, 2, "{text}");
        assert!(
            reason.starts_with("expected a string as a key, ") && reason.contains(got),
            "{text}: {reason}"
        );
    }
    // Quoted, the same keys are strings.
    yaml("tables:\n  \"1\": {}\n  'true': {}\n").expect("string keys");
}

#[test]
fn numbers_that_are_not_finite_are_refused() {
    for number in [".inf", "-.Inf", ".nan"] {
        let (line, _, reason) = refused(&format!("tables:\n  todos:\n    where: {number}\n"));
        assert_eq!(line, 3);
        assert_eq!(reason, format!("expected a finite number, got {number}"));
    }
}

#[test]
fn one_document_only() {
    let (line, _, reason) = refused("tables: {}\n---\ntables: {}\n");
    assert_eq!(line, 2);
    assert_eq!(reason, "expected one YAML document, got a second one");
    yaml("---\ntables: {}\n...\n").expect("one document with its markers");
    // Nothing at all is not an object, as in JSON.
    let empty = yaml("# no rules\n").expect_err("refused").to_string();
    assert_eq!(empty, "the rules: expected an object, got null");
}

#[test]
fn aliases_expand_within_a_budget_and_nesting_is_bounded() {
    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for level in b'b'..=b'h' {
        let previous = level - 1;
        let items = vec![format!("*{}", previous as char); 10].join(", ");
        bomb.push_str(&format!(
            "{}: &{} [{items}]\n",
            level as char, level as char
        ));
    }
    let (_, _, reason) = refused(&bomb);
    assert!(
        reason.starts_with("expected aliases to expand to at most 100000 values"),
        "{reason}"
    );
    let (_, _, reason) = refused("tables: &t\n  todos: *t\n");
    assert_eq!(
        reason,
        "expected an alias of a finished value, got one inside the value it names"
    );
    let deep = format!("tables: {}{}\n", "[".repeat(100), "]".repeat(100));
    let (line, _, reason) = refused(&deep);
    assert_eq!(line, 1);
    assert_eq!(reason, "expected at most 64 levels of nesting, got more");
}

#[test]
fn a_refused_rule_in_yaml_names_the_line_its_path_starts_on() {
    let bad_filter = "\
tables:
  todos:
    filterColumns: [owner]
  docs:
    filterColumns: [priority]
    where: >-
      owner = auth.sub
      OR title LIKE 'a%'
";
    let (line, error) = refused_rule(bad_filter);
    assert_eq!(line, 6);
    assert!(
        error
            .to_string()
            .starts_with("tables.docs.where: the row filter is refused: "),
        "{error}"
    );
    let shown = yaml(bad_filter).expect_err("refused");
    assert_eq!(shown.to_string(), "at line 6");

    let (line, error) =
        refused_rule("tables:\n  todos:\n    filterColumns:\n      - owner\n      - 5\n");
    assert_eq!(line, 5);
    assert!(
        error
            .to_string()
            .starts_with("tables.todos.filterColumns[1]: "),
        "{error}"
    );
    let (line, error) =
        refused_rule("tables:\n  todos:\n    filterColumns: [owner]\n    wher: owner = auth.sub\n");
    assert_eq!(line, 4);
    assert!(
        error
            .to_string()
            .starts_with("tables.todos.wher: unknown key"),
        "{error}"
    );
    let (line, error) = refused_rule("# rules\ntabels:\n  todos: {}\n");
    assert_eq!(line, 2);
    assert!(
        error
            .to_string()
            .starts_with("the rules.tabels: unknown key"),
        "{error}"
    );
    // A place the file does not have gets its path alone, as in JSON.
    let missing = yaml("{}\n").expect_err("refused");
    assert!(
        matches!(
            missing,
            RulesFileError::Rules(RulesError::MissingTables { .. })
        ),
        "{missing:?}"
    );
    // JSON errors stay as they were: the path, no line.
    let json = parse_rules(r#"{"tables":{"todos":{"wher":"x"}}}"#, RulesFormat::Json)
        .expect_err("refused");
    assert!(
        matches!(json, RulesFileError::Rules(RulesError::UnknownKey { .. })),
        "{json:?}"
    );
}

/// A folder of rules files, removed when dropped.
struct Folder(PathBuf);

impl Folder {
    fn new(name: &str) -> Folder {
        let dir =
            std::env::temp_dir().join(format!("highwater-rules-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        Folder(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("written");
        path
    }
}

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_file_is_json_or_yaml_by_its_extension_else_by_its_first_character() {
    let folder = Folder::new("formats");
    let want = SyncRules::from_json(JSON).expect("rules");
    for (name, text, format) in [
        ("rules.json", JSON, RulesFormat::Json),
        ("rules.yaml", YAML, RulesFormat::Yaml),
        ("rules.yml", YAML, RulesFormat::Yaml),
        ("RULES.YAML", YAML, RulesFormat::Yaml),
        ("rules", JSON, RulesFormat::Json),
        ("rules-yaml", YAML, RulesFormat::Yaml),
        ("rules.conf", &format!("\n  {JSON}"), RulesFormat::Json),
        (
            "rules-bom.json",
            &format!("\u{feff}{JSON}"),
            RulesFormat::Json,
        ),
        ("rules-bom", &format!("\u{feff}{YAML}"), RulesFormat::Yaml),
    ] {
        let path = folder.write(name, text);
        assert_eq!(RulesFormat::of(&path, text), format, "{name}");
        assert_eq!(
            crate::sync_auth::read_rules(&path).expect(name),
            want,
            "{name}"
        );
    }
    // The extension decides: YAML in a .json file is not valid JSON.
    let path = folder.write("yaml.json", YAML);
    let error = crate::sync_auth::read_rules(&path).expect_err("not JSON");
    assert!(
        matches!(
            &error,
            crate::sync_auth::AuthConfigError::Rules {
                source: RulesFileError::Rules(RulesError::NotJson { .. }),
                ..
            }
        ),
        "{error:?}"
    );
    // The file's name leads the message, the line follows.
    let path = folder.write(
        "bad.yaml",
        "tables:\n  todos:\n    filterColumns: [owner]\n    filterColumns: []\n",
    );
    let error = crate::sync_auth::read_rules(&path).expect_err("refused");
    let shown = format!("{:#}", anyhow::Error::from(error));
    assert_eq!(
        shown,
        format!(
            "the sync rules file {} is not valid: line 4, column 5: expected each key once in a map, got \"filterColumns\" again (first on line 3)",
            path.display()
        )
    );
}
