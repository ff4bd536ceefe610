//! `GET /containerLogs/{namespace}/{pod}/{container}`: the VM's serial-console
//! history from the CRI log files the recorder keeps (`<n>.log` per boot), with
//! the kubelet's options and semantics (`cri-client/pkg/logs`):
//!
//! - `tailLines=N`: start N newline-terminated file lines before the end (and,
//!   without `follow`, stop after N records);
//! - `sinceSeconds` / `sinceTime`: skip records stamped before;
//! - `limitBytes`: stop after that many output bytes (cut mid-line);
//! - `timestamps`: prefix each output line (not continuations of a partial
//!   record) with its RFC 3339 timestamp, nine fraction digits;
//! - `previous`: the boot before the current one;
//! - `follow`: keep streaming appended records until the client goes away, the
//!   pod is gone, or a newer boot starts.

use k8s_openapi::jiff::{tz::TimeZone, Timestamp};
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Options of one log request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogOptions {
    /// Last N lines only.
    pub tail_lines: Option<u64>,
    /// At most this many bytes.
    pub limit_bytes: Option<u64>,
    /// Records from this time on.
    pub since: Option<Timestamp>,
    /// Prefix lines with their timestamp.
    pub timestamps: bool,
    /// Keep streaming.
    pub follow: bool,
    /// The previous boot instead of the current one.
    pub previous: bool,
}

/// Parse the query (decoded pairs) as the kubelet does; `now` anchors
/// `sinceSeconds`. Errors are the kubelet's 422 cases.
pub fn options_from_query(query: &[(String, String)], now: Timestamp) -> Result<LogOptions, String> {
    let get = |name: &str| query.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    let flag = |name: &str| -> Result<bool, String> {
        match get(name) {
            None | Some("") | Some("false") | Some("0") => Ok(false),
            Some("true") | Some("1") => Ok(true),
            Some(other) => Err(format!("{name}: {other:?} is not a boolean")),
        }
    };
    let int = |name: &str| -> Result<Option<i64>, String> {
        get(name).map(|v| v.parse::<i64>().map_err(|_| format!("{name}: {v:?} is not an integer"))).transpose()
    };
    // The legacy `tail` parameter; "all" means no limit.
    let tail = match get("tail") {
        Some("all") => None,
        Some(_) => int("tail")?,
        None => int("tailLines")?,
    };
    if tail.is_some_and(|t| t < 0) {
        return Err("tailLines: must be greater than or equal to 0".into());
    }
    let limit = int("limitBytes")?;
    if limit.is_some_and(|l| l < 1) {
        return Err("limitBytes: must be greater than 0".into());
    }
    let since_seconds = int("sinceSeconds")?;
    let since_time = get("sinceTime").filter(|s| !s.is_empty());
    let since = match (since_seconds, since_time) {
        (Some(_), Some(_)) => return Err("at most one of sinceTime or sinceSeconds may be specified".into()),
        (Some(s), None) if s < 1 => return Err("sinceSeconds: must be greater than 0".into()),
        (Some(s), None) => Some(now - std::time::Duration::from_secs(s as u64)),
        (None, Some(t)) => Some(t.parse::<Timestamp>().map_err(|e| format!("sinceTime: {t:?}: {e}"))?),
        (None, None) => None,
    };
    Ok(LogOptions {
        tail_lines: tail.map(|t| t as u64),
        limit_bytes: limit.map(|l| l as u64),
        since,
        timestamps: flag("timestamps")?,
        follow: flag("follow")?,
        previous: flag("previous")?,
    })
}

/// The boot files of `dir`, oldest first: `(boot number, path)`.
pub fn boot_files(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let boot = name.to_str()?.strip_suffix(".log")?.parse::<u64>().ok()?;
            Some((boot, entry.path()))
        })
        .collect();
    files.sort();
    files
}

/// One record of a CRI log file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// When it was written.
    pub timestamp: Timestamp,
    /// The content; ends with `\n` for a full line (`F`), not for a partial one (`P`).
    pub content: Vec<u8>,
}

/// Parse a CRI log line `<RFC3339Nano> <stdout|stderr> <F|P>[:…] <content>\n`.
pub fn parse_cri_line(line: &[u8]) -> Option<Record> {
    let mut fields = line.splitn(4, |&b| b == b' ');
    let timestamp = std::str::from_utf8(fields.next()?).ok()?.parse::<Timestamp>().ok()?;
    let stream = fields.next()?;
    if stream != b"stdout" && stream != b"stderr" {
        return None;
    }
    let tag = fields.next()?;
    let mut content = fields.next()?.to_vec();
    let partial = tag.split(|&b| b == b':').next() == Some(b"P");
    if partial && content.last() == Some(&b'\n') {
        content.pop();
    }
    Some(Record { timestamp, content })
}

/// `2006-01-02T15:04:05.000000000Z`: RFC 3339 with nine fraction digits, UTC.
pub fn format_timestamp(ts: Timestamp) -> String {
    let dt = ts.to_zoned(TimeZone::UTC).datetime();
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:09}Z",
        dt.year(),
        dt.month(),
        dt.day(),
        dt.hour(),
        dt.minute(),
        dt.second(),
        dt.subsec_nanosecond()
    )
}

/// Where `tail` newline-terminated lines before the end start (the kubelet's
/// `findTailLineStartIndex`).
pub fn find_tail_start(file: &mut File, tail: u64) -> std::io::Result<u64> {
    const BLOCK: u64 = 1024;
    let size = file.seek(SeekFrom::End(0))?;
    let mut right = size;
    let mut newlines = 0u64;
    let mut block = Vec::new();
    let mut left = size;
    while right > 0 && newlines <= tail {
        left = right.saturating_sub(BLOCK);
        block.resize((right - left) as usize, 0);
        file.seek(SeekFrom::Start(left))?;
        file.read_exact(&mut block)?;
        newlines += block.iter().filter(|&&b| b == b'\n').count() as u64;
        right = left;
    }
    // Skip lines at the front of the scanned region (at most one block past
    // what is kept) until `tail` remain, reading it a block at a time.
    let mut start = left;
    let mut skip = newlines.saturating_sub(tail);
    file.seek(SeekFrom::Start(left))?;
    while skip > 0 && start < size {
        let len = BLOCK.min(size - start) as usize;
        block.resize(len, 0);
        file.read_exact(&mut block)?;
        for (i, &b) in block.iter().enumerate() {
            if b == b'\n' {
                skip -= 1;
                if skip == 0 {
                    return Ok(start + i as u64 + 1);
                }
            }
        }
        start += len as u64;
    }
    Ok(left)
}

/// Turns records into output bytes under the options.
struct Writer<'a> {
    opts: &'a LogOptions,
    remain: u64,
    new_line: bool,
}

impl Writer<'_> {
    /// Format `record`; `None` once `limitBytes` is reached.
    fn write(&mut self, record: &Record, out: &mut Vec<u8>) -> bool {
        if self.opts.since.is_some_and(|since| record.timestamp < since) {
            return true;
        }
        let start = out.len();
        if self.opts.timestamps && self.new_line {
            out.extend_from_slice(format_timestamp(record.timestamp).as_bytes());
            out.push(b' ');
        }
        out.extend_from_slice(&record.content);
        let written = (out.len() - start) as u64;
        self.new_line = record.content.last().is_none_or(|&b| b == b'\n');
        if written >= self.remain {
            out.truncate(start + self.remain as usize);
            self.remain = 0;
            return false;
        }
        self.remain -= written;
        true
    }
}

/// Where a read of one log file stands between [`read_chunk`] calls.
#[derive(Clone, Debug)]
pub struct LogCursor {
    /// The file offset of the next record; `None` before the first call
    /// (which starts `tailLines` before the end).
    offset: Option<u64>,
    /// Records still to send without `follow` and with `tailLines`.
    records_left: Option<u64>,
    /// Output bytes still allowed (`limitBytes`).
    remain: u64,
    /// The output is at the start of a line (for `timestamps`).
    new_line: bool,
    /// The file's inode when the read began: a file trimmed since (the
    /// recorder replaces it) ends the read rather than being read at an
    /// offset of the old one.
    inode: Option<u64>,
}

impl LogCursor {
    /// The start of a read under `opts`.
    pub fn new(opts: &LogOptions) -> LogCursor {
        LogCursor {
            offset: None,
            records_left: opts.tail_lines.filter(|_| !opts.follow),
            remain: opts.limit_bytes.unwrap_or(u64::MAX),
            new_line: true,
            inode: None,
        }
    }
}

/// How a [`read_chunk`] call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkEnd {
    /// The chunk is full: call again at once.
    More,
    /// At the end of the file with `follow` (a record may be half written):
    /// call again once more may have been appended.
    AtEnd,
    /// Nothing more to send (end of file, `tailLines` or `limitBytes`).
    Done,
}

/// Read from `path` under `opts` where `cursor` stands, up to about `max`
/// output bytes (one record may go past it); the output and how the read
/// ended. Each call opens the file anew and holds nothing between calls, so
/// a follower costs no thread while it waits (the caller sleeps between
/// [`ChunkEnd::AtEnd`] calls). Blocking: run on a blocking thread.
/// Errors: the file cannot be opened or read.
pub fn read_chunk(
    path: &Path,
    opts: &LogOptions,
    cursor: &mut LogCursor,
    max: usize,
) -> std::io::Result<(Vec<u8>, ChunkEnd)> {
    let mut file = File::open(path)?;
    let inode = std::os::unix::fs::MetadataExt::ino(&file.metadata()?);
    if cursor.inode.is_some_and(|first| first != inode) {
        return Ok((Vec::new(), ChunkEnd::Done));
    }
    cursor.inode = Some(inode);
    let start = match cursor.offset {
        Some(offset) => offset,
        None => match opts.tail_lines {
            Some(tail) => find_tail_start(&mut file, tail)?,
            None => 0,
        },
    };
    cursor.offset = Some(start);
    file.seek(SeekFrom::Start(start))?;
    let mut reader = BufReader::new(file);
    let mut writer = Writer { opts, remain: cursor.remain, new_line: cursor.new_line };
    let mut line = Vec::new();
    let mut out = Vec::new();
    let end = loop {
        if cursor.records_left == Some(0) {
            break ChunkEnd::Done;
        }
        if out.len() >= max {
            break ChunkEnd::More;
        }
        line.clear();
        let n = reader.read_until(b'\n', &mut line)?;
        let complete = line.last() == Some(&b'\n');
        if !complete && opts.follow {
            // Not a whole record yet: the next call reads it again.
            break ChunkEnd::AtEnd;
        }
        if n == 0 {
            break ChunkEnd::Done;
        }
        cursor.offset = Some(cursor.offset.unwrap_or(start) + n as u64);
        let Some(record) = parse_cri_line(&line) else { continue };
        let more = writer.write(&record, &mut out);
        if let Some(left) = cursor.records_left.as_mut() {
            *left -= 1;
        }
        if !more || !complete {
            break ChunkEnd::Done;
        }
    };
    cursor.remain = writer.remain;
    cursor.new_line = writer.new_line;
    Ok((out, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const LOG: &str = "\
2024-05-01T10:00:00.000000001Z stdout F booting
2024-05-01T10:00:01.5Z stdout P login:\x20
2024-05-01T10:00:02Z stdout F root
2024-05-01T10:00:03.123456789Z stdout F # uptime
2024-05-01T10:00:04Z stdout F  10:00:04 up 4 sec
";

    fn read(opts: LogOptions) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("0.log");
        std::fs::write(&path, LOG).unwrap();
        String::from_utf8(read_to_end(&path, &opts, &mut LogCursor::new(&opts), 7)).unwrap()
    }

    /// [`read_chunk`] of `max` bytes until it is not [`ChunkEnd::More`].
    fn read_to_end(path: &Path, opts: &LogOptions, cursor: &mut LogCursor, max: usize) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let (chunk, end) = read_chunk(path, opts, cursor, max).unwrap();
            out.extend(chunk);
            if end != ChunkEnd::More {
                return out;
            }
        }
    }

    fn q(s: &str) -> Vec<(String, String)> {
        s.split('&').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect()
    }

    #[test]
    fn the_whole_history_joins_partial_records() {
        assert_eq!(read(LogOptions::default()), "booting\nlogin: root\n# uptime\n 10:00:04 up 4 sec\n");
    }

    #[test]
    fn timestamps_prefix_lines_but_not_continuations() {
        let out = read(LogOptions { timestamps: true, ..Default::default() });
        assert_eq!(
            out,
            "2024-05-01T10:00:00.000000001Z booting\n\
             2024-05-01T10:00:01.500000000Z login: root\n\
             2024-05-01T10:00:03.123456789Z # uptime\n\
             2024-05-01T10:00:04.000000000Z  10:00:04 up 4 sec\n"
        );
    }

    #[test]
    fn tail_counts_file_lines_from_the_end() {
        assert_eq!(read(LogOptions { tail_lines: Some(2), ..Default::default() }), "# uptime\n 10:00:04 up 4 sec\n");
        assert_eq!(read(LogOptions { tail_lines: Some(0), ..Default::default() }), "");
        assert_eq!(read(LogOptions { tail_lines: Some(100), ..Default::default() }).lines().count(), 4);
    }

    #[test]
    fn since_skips_older_records() {
        let since = "2024-05-01T10:00:03Z".parse().unwrap();
        assert_eq!(read(LogOptions { since: Some(since), ..Default::default() }), "# uptime\n 10:00:04 up 4 sec\n");
    }

    #[test]
    fn limit_bytes_cuts_the_output() {
        assert_eq!(read(LogOptions { limit_bytes: Some(10), ..Default::default() }), "booting\nlo");
        let with_ts = read(LogOptions { limit_bytes: Some(12), timestamps: true, ..Default::default() });
        assert_eq!(with_ts, "2024-05-01T1");
    }

    #[test]
    fn follow_streams_appended_records_call_by_call() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("0.log");
        std::fs::write(&path, "2024-05-01T10:00:00Z stdout F one\n2024-05-01T10:00:01Z stdout F tw").unwrap();
        let opts = LogOptions { follow: true, tail_lines: Some(1), ..Default::default() };
        let mut cursor = LogCursor::new(&opts);
        let (first, end) = read_chunk(&path, &opts, &mut cursor, 1024).unwrap();
        assert_eq!((String::from_utf8(first).unwrap().as_str(), end), ("one\n", ChunkEnd::AtEnd));
        let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"o\n2024-05-01T10:00:02Z stdout F three\n").unwrap();
        let (next, end) = read_chunk(&path, &opts, &mut cursor, 1024).unwrap();
        assert_eq!((String::from_utf8(next).unwrap().as_str(), end), ("two\nthree\n", ChunkEnd::AtEnd));
        let (none, end) = read_chunk(&path, &opts, &mut cursor, 1024).unwrap();
        assert_eq!((none.len(), end), (0, ChunkEnd::AtEnd));
        // The recorder trimmed the history (a new file in its place): the
        // follow ends rather than read the new file at the old offset.
        let trimmed = dir.path().join("trimmed");
        std::fs::write(&trimmed, "2024-05-01T10:00:03Z stdout F four\n").unwrap();
        std::fs::rename(&trimmed, &path).unwrap();
        assert_eq!(read_chunk(&path, &opts, &mut cursor, 1024).unwrap(), (Vec::new(), ChunkEnd::Done));
    }

    #[test]
    fn a_tail_past_the_start_reads_the_file_in_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("0.log");
        let lines: String = (0..5000).map(|i| format!("2024-05-01T10:00:00Z stdout F line {i}\n")).collect();
        std::fs::write(&path, &lines).unwrap();
        let mut file = File::open(&path).unwrap();
        assert_eq!(find_tail_start(&mut file, 5000).unwrap(), 0);
        assert_eq!(find_tail_start(&mut file, 1_000_000).unwrap(), 0);
        let last_two = lines.rfind("2024-05-01T10:00:00Z stdout F line 4998").unwrap() as u64;
        assert_eq!(find_tail_start(&mut file, 2).unwrap(), last_two);
    }

    #[test]
    fn query_options_follow_the_kubelets_validation() {
        let now: Timestamp = "2024-05-01T10:00:10Z".parse().unwrap();
        let o =
            options_from_query(&q("tailLines=5&limitBytes=100&timestamps=true&follow=1&sinceSeconds=10"), now).unwrap();
        assert_eq!(o.tail_lines, Some(5));
        assert_eq!(o.limit_bytes, Some(100));
        assert!(o.timestamps && o.follow && !o.previous);
        assert_eq!(o.since, Some("2024-05-01T10:00:00Z".parse().unwrap()));
        let o = options_from_query(&q("sinceTime=2024-05-01T09:00:00Z&previous=true&tail=all"), now).unwrap();
        assert_eq!(o.since, Some("2024-05-01T09:00:00Z".parse().unwrap()));
        assert!(o.previous);
        assert_eq!(o.tail_lines, None);
        for bad in ["tailLines=-1", "limitBytes=0", "sinceSeconds=0", "sinceSeconds=5&sinceTime=2024-05-01T09:00:00Z"] {
            assert!(options_from_query(&q(bad), now).is_err(), "{bad}");
        }
    }

    #[test]
    fn boot_files_sort_numerically() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["10.log", "2.log", "0.log", "notes.txt"] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        let boots: Vec<u64> = boot_files(dir.path()).into_iter().map(|(b, _)| b).collect();
        assert_eq!(boots, [0, 2, 10]);
    }
}
