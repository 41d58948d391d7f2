//! `serve --config FILE`: options from a TOML file, each named as its command-line option
//! (`upstream = "postgres://…"`, `port = 4848`, `publication = ["a", "b"]`,
//! `auto-reset = true`). An option given on the command line or in its environment variable
//! wins over the file.
//!
//! The file's options become command-line arguments before clap parses them, so they are
//! validated exactly as flags are; clap has no file source of its own.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;

/// Why the config file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("cannot read the config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not TOML: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("{path}: unknown option {key:?}; `highwater serve --help` lists them")]
    Unknown { path: PathBuf, key: String },
    #[error("{path}: option {key:?} cannot be {found}")]
    Value {
        path: PathBuf,
        key: String,
        found: String,
    },
}

/// The options a config file added, for `--print-config` to name their source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FromFile {
    pub path: Option<PathBuf>,
    /// Long option names.
    pub options: Vec<String>,
}

/// `args` (the whole command line) with the options of `serve --config FILE` (or
/// `HIGHWATER_CONFIG`) added after `serve`, unless the command line or the environment sets
/// them already. Unchanged for other commands or without a config file.
pub fn with_config_file(
    args: Vec<OsString>,
    command: &clap::Command,
) -> Result<(Vec<OsString>, FromFile), ConfigFileError> {
    let Some(serve_at) = args.iter().position(|arg| arg == "serve") else {
        return Ok((args, FromFile::default()));
    };
    let Some(serve) = command.find_subcommand("serve") else {
        return Ok((args, FromFile::default()));
    };
    let given = &args[serve_at + 1..];
    let path = flag_value(given, "config")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HIGHWATER_CONFIG").map(PathBuf::from));
    let Some(path) = path else {
        return Ok((args, FromFile::default()));
    };
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigFileError::Read {
        path: path.clone(),
        source,
    })?;
    let table: toml::Table =
        text.parse()
            .map_err(|error: toml::de::Error| ConfigFileError::Parse {
                path: path.clone(),
                reason: error.to_string(),
            })?;
    let mut added: Vec<OsString> = Vec::new();
    let mut options = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let arg = serve
            .get_arguments()
            .find(|arg| arg.get_long() == Some(long.as_str()) && long != "config")
            .ok_or_else(|| ConfigFileError::Unknown {
                path: path.clone(),
                key: key.clone(),
            })?;
        let on_command_line = given.iter().any(|arg| {
            let arg = arg.to_string_lossy();
            arg == format!("--{long}") || arg.starts_with(&format!("--{long}="))
        });
        let in_environment = arg
            .get_env()
            .is_some_and(|name| std::env::var_os(name).is_some());
        if on_command_line || in_environment {
            continue;
        }
        let takes_value = arg.get_action().takes_values();
        let wrong = |found: &str| ConfigFileError::Value {
            path: path.clone(),
            key: key.clone(),
            found: found.to_owned(),
        };
        let mut push = |value: String| {
            added.push(OsString::from(format!("--{long}")));
            added.push(OsString::from(value));
        };
        match value {
            toml::Value::Boolean(flag) if !takes_value => {
                if *flag {
                    added.push(OsString::from(format!("--{long}")));
                }
            }
            toml::Value::Boolean(_) => return Err(wrong("a boolean")),
            _ if !takes_value => return Err(wrong("anything but true or false")),
            toml::Value::String(text) => push(text.clone()),
            toml::Value::Integer(n) => push(n.to_string()),
            toml::Value::Float(n) => push(n.to_string()),
            toml::Value::Array(items) => {
                for item in items {
                    match item {
                        toml::Value::String(text) => push(text.clone()),
                        toml::Value::Integer(n) => push(n.to_string()),
                        _ => return Err(wrong("a list of anything but strings or numbers")),
                    }
                }
            }
            toml::Value::Datetime(_) | toml::Value::Table(_) => {
                return Err(wrong("a date or a table"))
            }
        }
        options.push(long);
    }
    let mut out = args;
    let at = serve_at + 1;
    out.splice(at..at, added);
    Ok((
        out,
        FromFile {
            path: Some(path),
            options,
        },
    ))
}

/// The value of `--name VALUE` or `--name=VALUE` among `args`.
fn flag_value(args: &[OsString], name: &str) -> Option<OsString> {
    let flag = format!("--{name}");
    let prefix = format!("--{name}=");
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        if arg == OsStr::new(&flag) {
            return iter.next().cloned();
        }
        if let Some(value) = arg.to_string_lossy().strip_prefix(&prefix) {
            return Some(OsString::from(value));
        }
    }
    None
}
