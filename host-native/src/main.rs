//! The `highwater` command.

fn main() -> anyhow::Result<()> {
    Ok(())
}
