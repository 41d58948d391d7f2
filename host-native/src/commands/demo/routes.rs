//! The demo's HTTP routes, mounted in front of `serve`'s own: the page and the npm package's
//! files, demo tokens, the schema-change button's endpoint and the membership switches'. The
//! page writes its todos through the client (`client.mutate` over `/sync`), like any app;
//! memberships are an admin's business, so the switches change them upstream here, and the
//! rows they let in or out reach the pages through `/sync`.

use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

/// The demo users; each reads the todos of the projects it is a member of.
pub(super) const USERS: [&str; 3] = ["ada", "grace", "linus"];
/// How long a demo token is valid.
pub(super) const TOKEN_TTL_SECONDS: u64 = 3600;
/// Columns the "add a column" button adds, in order; after these, `extra_<n>` text columns.
const COLUMNS: [(&str, &str); 3] = [
    ("priority", "integer NOT NULL DEFAULT 3"),
    ("tag", "text NOT NULL DEFAULT 'inbox'"),
    ("estimate_minutes", "integer NOT NULL DEFAULT 25"),
];

/// Signs a demo token for a user (`sub`) valid for `ttl_seconds`.
pub(super) type TokenSigner = Arc<dyn Fn(&str, u64) -> Result<String, String> + Send + Sync>;

/// What the routes need.
pub(super) struct DemoState {
    /// The page: `index.html`, its script and stylesheet, the committed screenshot.
    pub(crate) web_dir: PathBuf,
    /// The built npm package (`bindings-wasm/dist`), served under `/pkg/`.
    pub(crate) package_dir: PathBuf,
    pub postgres: Arc<tokio_postgres::Client>,
    pub(crate) sign: TokenSigner,
}

/// The routes: `/` (the page), `/demo/<file>`, `/pkg/<path>`, `/demo/token`, `/demo/columns`,
/// `/demo/projects` and `/demo/projects/<id>/members/<user>`.
pub(super) fn router(state: Arc<DemoState>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/demo/token", get(token))
        .route("/demo/columns", post(add_column))
        .route("/demo/projects", get(projects))
        // PUT and DELETE, not POST: a page of another origin cannot send them without a CORS
        // preflight, which the demo never grants.
        .route(
            "/demo/projects/{project}/members/{user}",
            put(join_project).delete(leave_project),
        )
        .route("/demo/{file}", get(page_file))
        .route("/pkg/{*path}", get(package_file))
        .with_state(state)
}

/// A failed demo request: a status and a sentence for the page.
#[derive(Debug)]
struct Failure(StatusCode, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<tokio_postgres::Error> for Failure {
    fn from(error: tokio_postgres::Error) -> Self {
        tracing::warn!(%error, "a demo request to Postgres failed");
        Failure(
            StatusCode::BAD_GATEWAY,
            format!("The upstream Postgres answered with an error: {error}"),
        )
    }
}

fn bad_request(message: String) -> Failure {
    Failure(StatusCode::BAD_REQUEST, message)
}

async fn index(State(state): State<Arc<DemoState>>) -> Response {
    send_file(&state.web_dir, "index.html").await
}

async fn page_file(State(state): State<Arc<DemoState>>, Path(file): Path<String>) -> Response {
    if !is_plain_name(&file) {
        return not_found();
    }
    send_file(&state.web_dir, &file).await
}

async fn package_file(State(state): State<Arc<DemoState>>, Path(path): Path<String>) -> Response {
    // Only plain names below the package directory: no `..`, no hidden files, no absolute paths.
    if path.is_empty() || !path.split('/').all(is_plain_name) {
        return not_found();
    }
    send_file(&state.package_dir, &path).await
}

/// `[A-Za-z0-9_.-]+`, not starting with a dot.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

fn content_type(path: &str) -> &'static str {
    match path.rsplit('.').next() {
        Some("html") => "text/html; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("wasm") => "application/wasm",
        Some("json" | "map") => "application/json",
        Some("png") => "image/png",
        Some("svg") => "image/svg+xml",
        _ => "application/octet-stream",
    }
}

async fn send_file(dir: &FsPath, relative: &str) -> Response {
    match tokio::fs::read(dir.join(relative)).await {
        Ok(bytes) => (
            [
                (header::CONTENT_TYPE, content_type(relative)),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            bytes,
        )
            .into_response(),
        Err(_) => not_found(),
    }
}

fn not_found() -> Response {
    (StatusCode::NOT_FOUND, "Not found").into_response()
}

fn check_user(owner: &str) -> Result<(), Failure> {
    if USERS.contains(&owner) {
        Ok(())
    } else {
        Err(bad_request(format!(
            "Expected a demo user ({}), found {owner:?}.",
            USERS.join(", ")
        )))
    }
}

#[derive(Deserialize)]
struct TokenQuery {
    sub: String,
}

/// `GET /demo/token?sub=ada` → `{token, sub, expiresInSeconds}`.
async fn token(
    State(state): State<Arc<DemoState>>,
    Query(query): Query<TokenQuery>,
) -> Result<Json<serde_json::Value>, Failure> {
    check_user(&query.sub)?;
    let token = (state.sign)(&query.sub, TOKEN_TTL_SECONDS)
        .map_err(|e| Failure(StatusCode::INTERNAL_SERVER_ERROR, e))?;
    Ok(Json(json!({
        "token": token,
        "sub": query.sub,
        "expiresInSeconds": TOKEN_TTL_SECONDS,
    })))
}

/// `POST /demo/columns` → `{column}`: adds the next demo column to `todos` upstream, with a
/// default, so every existing row gains a value and the replica backfills it.
async fn add_column(
    State(state): State<Arc<DemoState>>,
) -> Result<Json<serde_json::Value>, Failure> {
    let existing: Vec<String> = state
        .postgres
        .query(
            "SELECT column_name::text FROM information_schema.columns
             WHERE table_schema = current_schema() AND table_name = 'todos'",
            &[],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    let (column, definition) = next_column(&existing);
    // Both parts come from this file, never from the request.
    state
        .postgres
        .batch_execute(&format!(
            "ALTER TABLE todos ADD COLUMN IF NOT EXISTS {column} {definition}"
        ))
        .await?;
    Ok(Json(json!({ "column": column })))
}

/// `GET /demo/projects` → `{projects: [{id, name}]}`: every project, for the membership
/// switches (a user reads only the projects it is in).
async fn projects(State(state): State<Arc<DemoState>>) -> Result<Json<serde_json::Value>, Failure> {
    let projects: Vec<serde_json::Value> = state
        .postgres
        .query("SELECT id, name FROM projects ORDER BY id", &[])
        .await?
        .iter()
        .map(|row| json!({ "id": row.get::<_, i64>(0), "name": row.get::<_, String>(1) }))
        .collect();
    Ok(Json(json!({ "projects": projects })))
}

/// `PUT /demo/projects/<id>/members/<user>` → `{project, user, member: true}`: makes `user` a
/// member of the project upstream (once; again is a no-op).
async fn join_project(
    State(state): State<Arc<DemoState>>,
    Path((project, user)): Path<(i64, String)>,
) -> Result<Json<serde_json::Value>, Failure> {
    check_user(&user)?;
    check_project(&state, project).await?;
    state
        .postgres
        .execute(
            "INSERT INTO members (project_id, user_id) VALUES ($1, $2)
             ON CONFLICT (project_id, user_id) DO NOTHING",
            &[&project, &user],
        )
        .await?;
    Ok(Json(
        json!({ "project": project, "user": user, "member": true }),
    ))
}

/// `DELETE /demo/projects/<id>/members/<user>` → `{project, user, member: false}`: ends the
/// membership upstream (a no-op when there is none).
async fn leave_project(
    State(state): State<Arc<DemoState>>,
    Path((project, user)): Path<(i64, String)>,
) -> Result<Json<serde_json::Value>, Failure> {
    check_user(&user)?;
    check_project(&state, project).await?;
    state
        .postgres
        .execute(
            "DELETE FROM members WHERE project_id = $1 AND user_id = $2",
            &[&project, &user],
        )
        .await?;
    Ok(Json(
        json!({ "project": project, "user": user, "member": false }),
    ))
}

async fn check_project(state: &DemoState, project: i64) -> Result<(), Failure> {
    let found = state
        .postgres
        .query_opt("SELECT 1 FROM projects WHERE id = $1", &[&project])
        .await?;
    match found {
        Some(_) => Ok(()),
        None => Err(Failure(
            StatusCode::NOT_FOUND,
            format!("Expected the id of a demo project, found {project}."),
        )),
    }
}

/// The first demo column `todos` lacks.
fn next_column(existing: &[String]) -> (String, String) {
    let has = |name: &str| existing.iter().any(|c| c == name);
    if let Some((name, definition)) = COLUMNS.iter().find(|(name, _)| !has(name)) {
        return ((*name).to_owned(), (*definition).to_owned());
    }
    let n = (1..)
        .find(|n| !has(&format!("extra_{n}")))
        .unwrap_or_default();
    (
        format!("extra_{n}"),
        format!("text NOT NULL DEFAULT 'value {n}'"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_exclude_traversal_and_hidden_files() {
        assert!(is_plain_name("app.js"));
        assert!(is_plain_name("highwater_wasm_bg.wasm"));
        for bad in ["", "..", ".env", "a/b", "a\\b", "%2e%2e", "a b"] {
            assert!(!is_plain_name(bad), "{bad:?} must be refused");
        }
    }

    #[test]
    fn wasm_is_served_as_application_wasm() {
        // instantiateStreaming refuses any other type.
        assert_eq!(
            content_type("wasm/highwater_wasm_bg.wasm"),
            "application/wasm"
        );
        assert_eq!(content_type("web.js"), "text/javascript; charset=utf-8");
    }

    #[test]
    fn columns_are_added_in_order_then_numbered() {
        let mut existing = vec!["id".to_owned(), "owner".to_owned()];
        for expected in ["priority", "tag", "estimate_minutes", "extra_1", "extra_2"] {
            let (column, _) = next_column(&existing);
            assert_eq!(column, expected);
            existing.push(column);
        }
    }

    #[test]
    fn only_demo_users_get_tokens() {
        assert!(check_user("ada").is_ok());
        assert!(check_user("eve").is_err());
    }
}
