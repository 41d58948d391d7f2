//! The yardstick: `pg_recvlogical` (from the same Postgres installation) streaming the
//! benchmark publication from its own pgoutput slot into a file, and a reader of that file.
//!
//! `pg_recvlogical` writes each pgoutput message followed by a newline. Messages may contain
//! newline bytes themselves, so the reader finds each message's end by decoding it with
//! `engine::pgoutput` (which rejects truncated and over-long input) at each candidate newline.
//! Reading also runs every message through Highwater's `PgoutputMapper`, timing that stage on
//! its own.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use highwater_engine::pgoutput::{PgoutputMapper, PgoutputMessage};
use highwater_engine::watermark::Lsn;
use tokio::process::{Child, Command};

/// The slot `pg_recvlogical` streams from.
pub const SLOT: &str = "hwbench_recvlogical";

/// A Commit message: tag, flags, commit LSN, end LSN, commit time.
const COMMIT_LEN: usize = 1 + 1 + 8 + 8 + 8;
const READ_CHUNK: usize = 4 << 20;

/// A running `pg_recvlogical --start`.
pub struct RecvLogical {
    child: Child,
    log: PathBuf,
}

impl RecvLogical {
    /// Streams the publication into `output` (appending, as `pg_recvlogical` does); with
    /// `endpos` it exits once it has received and fsynced everything up to that position.
    pub fn spawn(
        bin_dir: &Path,
        url: &str,
        publication: &str,
        output: &Path,
        endpos: Option<Lsn>,
    ) -> anyhow::Result<RecvLogical> {
        let log = output.with_extension("log");
        let stderr =
            File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        let mut command = Command::new(bin_dir.join("pg_recvlogical"));
        command
            .arg("--dbname")
            .arg(url)
            .args(["--slot", SLOT, "--start", "--no-loop"])
            .args(["-o", "proto_version=1", "-o"])
            .arg(format!("publication_names={publication}"))
            .arg("--file")
            .arg(output);
        if let Some(endpos) = endpos {
            command.arg("--endpos").arg(endpos.to_string());
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot run {}", bin_dir.join("pg_recvlogical").display()))?;
        Ok(RecvLogical { child, log })
    }

    /// Waits for an `--endpos` run to finish; fails unless it exited successfully.
    pub async fn wait(mut self) -> anyhow::Result<()> {
        let status = self.child.wait().await?;
        if !status.success() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            bail!("pg_recvlogical failed ({status}): {}", log.trim());
        }
        Ok(())
    }

    /// Whether it exited already (with its error output if so).
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                Some(format!("pg_recvlogical exited ({status}): {}", log.trim()))
            }
            Ok(None) => None,
            Err(error) => Some(format!("cannot check on pg_recvlogical: {error}")),
        }
    }

    /// Stops an open-ended run. What it wrote stays in the file.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.child.start_kill()?;
        self.child.wait().await?;
        Ok(())
    }
}

/// The commit LSN of the file's last message if that message is a complete Commit, and the
/// file's length.
///
/// The tail is only taken for a Commit when it starts a message (a newline, or the file's
/// start, before it), has the flags pgoutput sends (0) and ends at or after its commit: the
/// last bytes of a half-written transaction can decode as a Commit otherwise (a column whose
/// value is 67 bytes long has the length 0x00000043, a `C`), and a run took its text for a
/// commit past the workload's and stopped reading early.
pub fn last_commit(path: &Path) -> std::io::Result<(Option<Lsn>, u64)> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok((None, 0)),
        Err(error) => return Err(error),
    };
    let len = file.metadata()?.len();
    let tail_len = (COMMIT_LEN + 1) as u64;
    if len < tail_len {
        return Ok((None, len));
    }
    // With the byte before the message; the file's start counts as a newline there.
    let at_start = len == tail_len;
    let mut tail = [b'\n'; COMMIT_LEN + 2];
    file.seek(SeekFrom::Start(len - tail_len - u64::from(!at_start)))?;
    file.read_exact(&mut tail[usize::from(at_start)..])?;
    let starts_a_message = tail[0] == b'\n';
    let message = &tail[1..];
    let commit = match (
        starts_a_message,
        message[COMMIT_LEN],
        PgoutputMessage::decode(&message[..COMMIT_LEN]),
    ) {
        (true, b'\n', Ok(PgoutputMessage::Commit(commit)))
            if commit.flags == 0 && commit.end_lsn >= commit.commit_lsn =>
        {
            Some(commit.commit_lsn)
        }
        _ => None,
    };
    Ok((commit, len))
}

/// What a stretch of `pg_recvlogical` output holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputSummary {
    /// Time `engine::pgoutput` took to map the messages to change-stream messages (one
    /// thread, in memory, no I/O).
    pub mapping: Duration,
    pub messages: u64,
    /// pgoutput message bytes (the separating newlines not counted).
    pub payload_bytes: u64,
    pub inserts: u64,
    pub commits: u64,
    pub last_commit: Option<Lsn>,
}

impl OutputSummary {
    fn record(&mut self, message: &PgoutputMessage<'_>, len: usize) {
        self.messages += 1;
        self.payload_bytes += len as u64;
        match message {
            PgoutputMessage::Insert(_) => self.inserts += 1,
            PgoutputMessage::Commit(commit) => {
                self.commits += 1;
                self.last_commit = Some(commit.commit_lsn);
            }
            _ => {}
        }
    }
}

/// Reads the messages in `range` of the file (which must start and end on message boundaries),
/// in chunks so a large output needs little memory, mapping each with `mapper` (which must
/// have seen the Relation messages of earlier ranges).
pub fn summarize(
    path: &Path,
    range: Range<u64>,
    mapper: &mut PgoutputMapper,
) -> anyhow::Result<OutputSummary> {
    let mut file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    file.seek(SeekFrom::Start(range.start))?;
    let mut remaining = range.end.saturating_sub(range.start);
    let mut summary = OutputSummary::default();
    let mut buf: Vec<u8> = Vec::with_capacity(READ_CHUNK * 2);
    let mut offset = range.start;
    while remaining > 0 {
        let want = usize::try_from(remaining.min(READ_CHUNK as u64))?;
        let start = buf.len();
        buf.resize(start + want, 0);
        file.read_exact(&mut buf[start..])
            .with_context(|| format!("cannot read {}", path.display()))?;
        remaining -= want as u64;
        let consumed = scan(&buf, &mut summary, mapper)?;
        buf.drain(..consumed);
        offset += consumed as u64;
    }
    if !buf.is_empty() {
        bail!(
            "expected a pgoutput message followed by a newline at byte {offset} of {}, found {} \
             bytes that do not decode as one",
            path.display(),
            buf.len()
        );
    }
    Ok(summary)
}

/// Records and maps every complete message at the start of `buf`; returns the bytes consumed.
fn scan(
    buf: &[u8],
    summary: &mut OutputSummary,
    mapper: &mut PgoutputMapper,
) -> anyhow::Result<usize> {
    let mut start = 0;
    'messages: loop {
        let mut search = start;
        while let Some(found) = buf[search..].iter().position(|&b| b == b'\n') {
            let end = search + found;
            if let Ok(message) = PgoutputMessage::decode(&buf[start..end]) {
                summary.record(&message, end - start);
                let started = Instant::now();
                let mapped = mapper.map_message(message);
                summary.mapping += started.elapsed();
                mapped.context("Highwater's mapper rejected a message pg_recvlogical received")?;
                start = end + 1;
                continue 'messages;
            }
            search = end + 1;
        }
        return Ok(start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn begin(final_lsn: u64) -> Vec<u8> {
        let mut m = vec![b'B'];
        m.extend_from_slice(&final_lsn.to_be_bytes());
        m.extend_from_slice(&0i64.to_be_bytes());
        m.extend_from_slice(&10u32.to_be_bytes());
        m
    }

    /// Table 16384 `public.t (v text)`.
    fn relation() -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend_from_slice(&16384u32.to_be_bytes());
        m.extend_from_slice(b"public\0t\0d");
        m.extend_from_slice(&1u16.to_be_bytes());
        m.extend_from_slice(b"\x01v\0");
        m.extend_from_slice(&25u32.to_be_bytes());
        m.extend_from_slice(&(-1i32).to_be_bytes());
        m
    }

    fn insert(text: &[u8]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend_from_slice(&16384u32.to_be_bytes());
        m.push(b'N');
        m.extend_from_slice(&1u16.to_be_bytes());
        m.push(b't');
        m.extend_from_slice(&u32::try_from(text.len()).unwrap().to_be_bytes());
        m.extend_from_slice(text);
        m
    }

    fn commit(lsn: u64) -> Vec<u8> {
        let mut m = vec![b'C', 0];
        m.extend_from_slice(&lsn.to_be_bytes());
        m.extend_from_slice(&(lsn + 0x0A).to_be_bytes());
        m.extend_from_slice(&0i64.to_be_bytes());
        m
    }

    /// Messages as pg_recvlogical writes them: each followed by a newline.
    fn output(messages: &[Vec<u8>]) -> Vec<u8> {
        messages
            .iter()
            .flat_map(|m| m.iter().copied().chain([b'\n']))
            .collect()
    }

    fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
        let path = std::env::temp_dir().join(format!("hwbench-{name}-{}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn messages_containing_newline_bytes_are_framed_by_decoding() {
        // Ten-byte values have the length 0x0000000A, and the text itself holds newlines.
        let bytes = output(&[
            begin(0x0A0A),
            relation(),
            insert(b"line\nbreak"),
            insert(b"\n\n\n\n\n\n\n\n\n\n"),
            commit(0x0A0A),
        ]);
        let mut summary = OutputSummary::default();
        let mut mapper = PgoutputMapper::new();
        assert_eq!(
            scan(&bytes, &mut summary, &mut mapper).unwrap(),
            bytes.len()
        );
        assert_eq!(summary.messages, 5);
        assert_eq!(summary.inserts, 2);
        assert_eq!(summary.commits, 1);
        assert_eq!(summary.last_commit, Some(Lsn(0x0A0A)));
        assert_eq!(summary.payload_bytes, bytes.len() as u64 - 5);
        assert!(!mapper.in_transaction());
    }

    #[test]
    fn a_partial_message_is_left_for_the_next_chunk() {
        let bytes = output(&[begin(1), relation(), insert(b"abc")]);
        let cut = bytes.len() - 3;
        let mut summary = OutputSummary::default();
        let mut mapper = PgoutputMapper::new();
        let consumed = scan(&bytes[..cut], &mut summary, &mut mapper).unwrap();
        assert_eq!(consumed, begin(1).len() + relation().len() + 2);
        assert_eq!(summary.messages, 2);
        assert_eq!(summary.inserts, 0);
    }

    #[test]
    fn summarize_reads_a_byte_range_and_rejects_garbage() {
        let first = output(&[begin(100), relation(), insert(b"a"), commit(100)]);
        let second = output(&[begin(200), insert(b"b"), insert(b"c"), commit(200)]);
        let all = [first.clone(), second].concat();
        let path = temp_file("range", &all);
        let mut mapper = PgoutputMapper::new();
        let head = summarize(&path, 0..first.len() as u64, &mut mapper).unwrap();
        assert_eq!((head.inserts, head.commits), (1, 1));
        // The second range relies on the Relation message the mapper saw in the first.
        let tail = summarize(&path, first.len() as u64..all.len() as u64, &mut mapper).unwrap();
        assert_eq!((tail.inserts, tail.commits), (2, 1));
        assert_eq!(tail.last_commit, Some(Lsn(200)));
        assert_eq!(
            last_commit(&path).unwrap(),
            (Some(Lsn(200)), all.len() as u64)
        );

        let garbage = temp_file("garbage", &[all.as_slice(), b"xyz\n"].concat());
        let error = summarize(
            &garbage,
            0..all.len() as u64 + 4,
            &mut PgoutputMapper::new(),
        )
        .unwrap_err();
        assert!(
            error.to_string().contains("expected a pgoutput message"),
            "{error}"
        );
        assert_eq!(last_commit(&garbage).unwrap().0, None);
        let _ = std::fs::remove_file(path);
        let _ = std::fs::remove_file(garbage);
    }

    /// Found by CI (`tiny_live_runs_on_an_upstream_leave_no_slots_behind`, pg_recvlogical
    /// "received 147 of 200"): a file ending inside a transaction, in an insert whose last
    /// 26 bytes decode as a Commit (a 67-byte value's length field holds a `C`), was taken to
    /// end with a commit past the workload's.
    #[test]
    fn the_tail_of_an_insert_is_not_taken_for_a_commit() {
        // The insert's tail: its value's length 0x00000043 ("C" after three zeros), then
        // 67 bytes of text of which the last 24 follow the `C` and its "flags" byte.
        let mut value = vec![b'x'; 67];
        value[..3].copy_from_slice(b"abc");
        let mut tail_insert = insert(&value);
        // Make the 26 bytes before the final newline start at the length's `C`.
        let c_at = tail_insert.len() - 67 - 1;
        assert_eq!(tail_insert[c_at], b'C');
        tail_insert.truncate(c_at + COMMIT_LEN);
        let bytes = [
            output(&[begin(100), relation(), commit(100), begin(200)]),
            tail_insert,
            vec![b'\n'],
        ]
        .concat();
        let path = temp_file("fake-commit", &bytes);
        let (found, len) = last_commit(&path).unwrap();
        assert_eq!(found, None, "{found:?}");
        assert_eq!(len, bytes.len() as u64);
        // A real one right after the file's start still counts.
        let only = temp_file("only-commit", &output(&[commit(7)]));
        assert_eq!(last_commit(&only).unwrap().0, Some(Lsn(7)));
        let _ = std::fs::remove_file(path);
        let _ = std::fs::remove_file(only);
    }
}
