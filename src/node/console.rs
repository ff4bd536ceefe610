//! Console recorder: copies each running VM's serial-console output into log
//! files on disk, one per boot, in the CRI container log format the kubelet uses
//! (`<RFC3339Nano> stdout <F|P> <content>`), so `kubectl logs` works like it does
//! for containers and survives a vmlet restart.
//!
//! Layout: `<stateDir>/vms/<namespace>_<vm name>_<vm uid>/` holds `0.log`,
//! `1.log`, ... (the highest is the current boot) and `state.json` (the boot and
//! byte offset read so far), so a restarted vmlet resumes where it stopped. Keyed
//! by the VM rather than the pod: a stop and start replaces the pod, and
//! `--previous` still shows the boot before.
//!
//! Timestamps are when vmlet read the bytes: output written while vmlet was down
//! is stamped when it catches up.

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use vmlet_provider::{Console, VmId};

/// Bytes asked of the provider per read.
const CHUNK: usize = 64 * 1024;
/// A line longer than this is written as partial (`P`) records.
const MAX_LINE: usize = 16 * 1024;

/// The directory holding a VM's console history.
pub fn vm_log_dir(state_dir: &Path, namespace: &str, vm_name: &str, vm_uid: &str) -> PathBuf {
    state_dir.join("vms").join(format!("{namespace}_{vm_name}_{vm_uid}"))
}

/// What was read so far, persisted in `state.json`.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct State {
    /// The provider's boot identifier of the current file.
    boot: Option<String>,
    /// Next console offset to read in that boot.
    offset: u64,
    /// Index of the current file (`<index>.log`).
    index: u32,
    /// Bytes of an unfinished line, not yet written.
    #[serde(default)]
    pending: Vec<u8>,
}

/// Errors while recording; the next pass retries.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The provider could not give the console output.
    #[error(transparent)]
    Provider(#[from] vmlet_provider::Error),
    /// Writing the log or state file failed.
    #[error("console log {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// How much history [`record`] keeps in a VM's directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Boot files kept (the newest); older ones are deleted when a boot starts.
    pub boots: u32,
    /// Bytes a boot's file may hold; past it, its older half is dropped.
    pub bytes_per_boot: u64,
}

impl From<crate::config::ConsoleHistoryConfig> for Limits {
    fn from(config: crate::config::ConsoleHistoryConfig) -> Self {
        Limits { boots: config.max_boots, bytes_per_boot: config.max_mib_per_boot.saturating_mul(1 << 20) }
    }
}

/// Read whatever new console output the provider has for `id` and append it to
/// the log in `dir`, within `limits`. Returns the number of console bytes
/// consumed.
pub async fn record(console: &dyn Console, id: &VmId, dir: &Path, limits: Limits) -> Result<u64, RecordError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| RecordError::Io { path, source }
    };
    let state_path = dir.join("state.json");
    let mut state: State = match tokio::fs::read(&state_path).await {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_default(),
        Err(_) => State::default(),
    };
    let before = state.clone();
    let mut consumed = 0;
    loop {
        let chunk = console.console_output(id, state.offset, CHUNK).await?;
        if state.boot.as_deref() != Some(chunk.boot.as_str()) {
            if state.boot.is_some() {
                // A new boot: flush the old one's unfinished line, start a new file.
                let pending = std::mem::take(&mut state.pending);
                append(dir, state.index, &records(&pending, true, &mut Vec::new()), limits).map_err(io(dir))?;
                state.index += 1;
                if let Some(oldest) = (state.index + 1).checked_sub(limits.boots).and_then(|kept| kept.checked_sub(1)) {
                    // Only the newest `boots` files stay.
                    let _ = std::fs::remove_file(dir.join(format!("{oldest}.log")));
                }
            }
            state.boot = Some(chunk.boot.clone());
            state.offset = 0;
            if chunk.next_offset != chunk.data.len() as u64 {
                // We asked from a stale offset; read this boot from its start.
                continue;
            }
        }
        if chunk.data.is_empty() {
            break;
        }
        consumed += chunk.data.len() as u64;
        state.offset = chunk.next_offset;
        let mut pending = std::mem::take(&mut state.pending);
        pending.extend_from_slice(&chunk.data);
        let text = records(&pending, false, &mut state.pending);
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        append(dir, state.index, &text, limits).map_err(io(dir))?;
        if chunk.data.len() < CHUNK {
            break;
        }
    }
    if state != before {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let json = serde_json::to_vec(&state).expect("state serializes");
        std::fs::write(&state_path, json).map_err(io(&state_path))?;
    }
    Ok(consumed)
}

/// CRI records for `data`: one `F` record per complete line (trailing `\r`
/// dropped), `P` records for over-long pieces. An unfinished last line goes to
/// `rest`, or is written as `F` when `flush`.
fn records(data: &[u8], flush: bool, rest: &mut Vec<u8>) -> Vec<u8> {
    let now = Timestamp::now();
    let stamp = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ").to_string();
    let mut out = Vec::new();
    let mut line_start = 0;
    let mut push = |content: &[u8], tag: &str| {
        let content = content.strip_suffix(b"\r").unwrap_or(content);
        out.extend_from_slice(stamp.as_bytes());
        out.extend_from_slice(b" stdout ");
        out.extend_from_slice(tag.as_bytes());
        out.push(b' ');
        out.extend_from_slice(content);
        out.push(b'\n');
    };
    for (i, byte) in data.iter().enumerate() {
        if *byte == b'\n' {
            let mut piece = &data[line_start..i];
            while piece.len() > MAX_LINE {
                push(&piece[..MAX_LINE], "P");
                piece = &piece[MAX_LINE..];
            }
            push(piece, "F");
            line_start = i + 1;
        }
    }
    let mut tail = &data[line_start..];
    while tail.len() > MAX_LINE {
        push(&tail[..MAX_LINE], "P");
        tail = &tail[MAX_LINE..];
    }
    if flush {
        if !tail.is_empty() {
            push(tail, "F");
        }
    } else {
        rest.extend_from_slice(tail);
    }
    out
}

/// Append `lines` (newline-separated text, stamped now) as `stdout` records
/// to `dir/0.log`, creating the directory: the log of a pod that is not a
/// VM's (a backup's progress), which has one "boot".
pub fn append_lines(dir: &Path, lines: &str) -> std::io::Result<()> {
    let limits = Limits::from(crate::config::ConsoleHistoryConfig::default());
    append(dir, 0, &records(lines.as_bytes(), true, &mut Vec::new()), limits)
}

/// Append `text` to `dir/<index>.log`; when that takes the file past
/// `limits.bytes_per_boot`, all but its newest half of that is dropped
/// ([`trim`]).
fn append(dir: &Path, index: u32, text: &[u8], limits: Limits) -> std::io::Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("{index}.log"));
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
    file.write_all(text)?;
    if file.metadata()?.len() > limits.bytes_per_boot {
        trim(&path, limits.bytes_per_boot / 2)?;
    }
    Ok(())
}

/// Keep about the last `keep` bytes of the log at `path` (from a record's
/// start), after a record saying older output was dropped; written to a new
/// file that replaces it, so a reader sees the old file or the new one.
fn trim(path: &Path, keep: u64) -> std::io::Result<()> {
    use std::io::{BufRead, Seek, SeekFrom};
    let mut old = std::io::BufReader::new(std::fs::File::open(path)?);
    let size = old.get_ref().metadata()?.len();
    old.seek(SeekFrom::Start(size.saturating_sub(keep)))?;
    // Skip to the start of the next record (records end with a newline).
    let mut skipped = Vec::new();
    old.read_until(b'\n', &mut skipped)?;
    let partial = path.with_extension("log.partial");
    let mut new = std::fs::File::create(&partial)?;
    let note = format!("older console output of this boot was dropped: vmlet keeps {} bytes per boot\n", keep * 2);
    new.write_all(&records(note.as_bytes(), true, &mut Vec::new()))?;
    std::io::copy(&mut old, &mut new)?;
    std::fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use vmlet_provider::{ConsoleChunk, StreamIo};

    /// A console whose output is set by the test (pure logic, no backend).
    struct FakeConsole(Mutex<(String, Vec<u8>)>);

    #[async_trait::async_trait]
    impl Console for FakeConsole {
        async fn console_output(&self, _: &VmId, offset: u64, max: usize) -> vmlet_provider::Result<ConsoleChunk> {
            let (boot, data) = self.0.lock().unwrap().clone();
            let start = (offset as usize).min(data.len());
            let end = (start + max).min(data.len());
            Ok(ConsoleChunk { boot, data: data[start..end].to_vec(), next_offset: end as u64 })
        }
        async fn attach(&self, _: &VmId, _: StreamIo) -> vmlet_provider::Result<()> {
            unreachable!()
        }
    }

    const LIMITS: Limits = Limits { boots: 5, bytes_per_boot: 1 << 20 };

    fn contents(dir: &Path, index: u32) -> Vec<String> {
        std::fs::read_to_string(dir.join(format!("{index}.log")))
            .unwrap_or_default()
            .lines()
            .map(|l| l.split_once(' ').unwrap().1.to_owned())
            .collect()
    }

    #[tokio::test]
    async fn lines_are_recorded_once_in_cri_format_and_partial_lines_wait() {
        let dir = tempfile::tempdir().unwrap();
        let console = FakeConsole(Mutex::new(("1".into(), b"booting\r\nvmlet-guest: boo".to_vec())));
        let id = VmId("u".into());
        assert_eq!(
            record(&console, &id, dir.path(), LIMITS).await.unwrap(),
            b"booting\r\nvmlet-guest: boo".len() as u64
        );
        assert_eq!(contents(dir.path(), 0), ["stdout F booting"]);
        console.0.lock().unwrap().1.extend_from_slice(b"ted\n");
        record(&console, &id, dir.path(), LIMITS).await.unwrap();
        record(&console, &id, dir.path(), LIMITS).await.unwrap();
        assert_eq!(contents(dir.path(), 0), ["stdout F booting", "stdout F vmlet-guest: booted"]);
        let first = std::fs::read_to_string(dir.path().join("0.log")).unwrap();
        let stamp = first.split(' ').next().unwrap();
        assert!(stamp.parse::<Timestamp>().is_ok(), "{stamp}");
    }

    #[tokio::test]
    async fn a_new_boot_starts_a_new_file_and_keeps_the_previous() {
        let dir = tempfile::tempdir().unwrap();
        let console = FakeConsole(Mutex::new(("1".into(), b"first boot\nhalf".to_vec())));
        let id = VmId("u".into());
        record(&console, &id, dir.path(), LIMITS).await.unwrap();
        *console.0.lock().unwrap() = ("2".into(), b"second boot\n".to_vec());
        record(&console, &id, dir.path(), LIMITS).await.unwrap();
        assert_eq!(contents(dir.path(), 0), ["stdout F first boot", "stdout F half"]);
        assert_eq!(contents(dir.path(), 1), ["stdout F second boot"]);
    }

    #[tokio::test]
    async fn a_restarted_recorder_resumes_from_its_saved_offset() {
        let dir = tempfile::tempdir().unwrap();
        let console = FakeConsole(Mutex::new(("7".into(), b"one\n".to_vec())));
        let id = VmId("u".into());
        record(&console, &id, dir.path(), LIMITS).await.unwrap();
        console.0.lock().unwrap().1.extend_from_slice(b"two\n");
        // A new process reads the same state.json.
        record(&console, &id, dir.path(), LIMITS).await.unwrap();
        assert_eq!(contents(dir.path(), 0), ["stdout F one", "stdout F two"]);
    }

    #[tokio::test]
    async fn only_the_newest_boots_are_kept_and_a_boot_keeps_its_newest_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let id = VmId("u".into());
        let limits = Limits { boots: 2, bytes_per_boot: 4096 };
        let console = FakeConsole(Mutex::new(("1".into(), Vec::new())));
        for boot in 1..=3 {
            *console.0.lock().unwrap() = (boot.to_string(), format!("boot {boot}\n").into_bytes());
            record(&console, &id, dir.path(), limits).await.unwrap();
        }
        let mut files: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        files.sort();
        assert_eq!(files, ["1.log", "2.log", "state.json"], "boot 1's file is gone");
        assert_eq!(contents(dir.path(), 2), ["stdout F boot 3"]);

        // 200 lines of about 60 bytes in one boot: the file stays within
        // its 4 KiB, starts with the note, and ends with the newest line.
        let lines: String = (0..200).map(|i| format!("line {i:03} of a guest that prints a lot\n")).collect();
        console.0.lock().unwrap().1.extend_from_slice(lines.as_bytes());
        for _ in 0..3 {
            record(&console, &id, dir.path(), limits).await.unwrap();
        }
        let size = std::fs::metadata(dir.path().join("2.log")).unwrap().len();
        assert!(size <= 4096, "{size} bytes");
        let kept = contents(dir.path(), 2);
        assert!(kept[0].starts_with("stdout F older console output of this boot was dropped"), "{kept:?}");
        assert_eq!(kept.last().unwrap(), "stdout F line 199 of a guest that prints a lot");
        assert!(kept[1].starts_with("stdout F line "), "whole records only: {kept:?}");
    }

    #[test]
    fn long_lines_are_split_into_partial_records() {
        let mut rest = vec![];
        let line = vec![b'x'; MAX_LINE + 10];
        let mut data = line.clone();
        data.push(b'\n');
        let out = String::from_utf8(records(&data, false, &mut rest)).unwrap();
        let tags: Vec<&str> = out.lines().map(|l| l.split(' ').nth(2).unwrap()).collect();
        assert_eq!(tags, ["P", "F"]);
        assert!(rest.is_empty());
    }
}
