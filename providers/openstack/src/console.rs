//! [`Console`] for Nova: output only.
//!
//! `os-getConsoleOutput` (`{"length": null}`) returns the console log Nova's
//! driver keeps (libvirt: the last 100 KiB or so), with no offsets: vmlet
//! fetches it whole and slices it at the asked byte offset. When the driver
//! drops the log's start, offsets into it shift; the boot id does not change
//! then.
//!
//! The boot id is the newest instance action that (re)starts the guest
//! (`create`, `start`, `reboot`, `rebuild`, `resize`, `migrate`, `unshelve`,
//! `evacuate`, `restore`, `rescue`, `unrescue`, from `GET
//! /servers/{id}/os-instance-actions`), as `<action>:<request id>`. Nova's
//! `launched_at` does not change on `os-start`, so it cannot serve.
//!
//! Live attach is not offered: Nova's serial console is a websocket behind
//! its own proxy (`remote-consoles`), which vmlet does not speak.

use vmlet_provider::{Console, ConsoleChunk, Error, ErrorKind, Result, StreamIo, VmId};

use crate::compute::InstanceAction;
use crate::provider::OpenStackProvider;

/// Instance actions after which the guest runs a new boot.
const BOOT_ACTIONS: [&str; 11] = [
    "create", "start", "reboot", "rebuild", "resize", "migrate", "unshelve", "evacuate", "restore", "rescue",
    "unrescue",
];

/// The boot id from a server's instance actions (see the module doc);
/// `fallback` (the server id) when none is a boot.
pub(crate) fn boot_of(actions: &[InstanceAction], fallback: &str) -> String {
    actions
        .iter()
        .filter(|a| BOOT_ACTIONS.contains(&a.action.as_str()))
        .max_by(|a, b| (&a.start_time, &a.request_id).cmp(&(&b.start_time, &b.request_id)))
        .map(|a| format!("{}:{}", a.action, a.request_id))
        .unwrap_or_else(|| fallback.to_owned())
}

/// The piece of `log` from byte `offset`, at most `max_bytes`.
pub(crate) fn slice(log: &[u8], boot: String, offset: u64, max_bytes: usize) -> ConsoleChunk {
    let start = usize::try_from(offset).unwrap_or(usize::MAX).min(log.len());
    let end = start.saturating_add(max_bytes).min(log.len());
    let data = log[start..end].to_vec();
    let next_offset = if start < log.len() { end as u64 } else { offset };
    ConsoleChunk { boot, data, next_offset }
}

#[async_trait::async_trait]
impl Console for OpenStackProvider {
    /// Errors: `NotFound` when this host has no such server; `Unsupported`
    /// when Nova has no console log for it; `Conflict` while Nova's driver
    /// cannot read it yet.
    async fn console_output(&self, id: &VmId, offset: u64, max_bytes: usize) -> Result<ConsoleChunk> {
        const OP: &str = "read console output";
        let server = self.find_here(OP, id).await?;
        let log = match self.cloud.console_log(&server.id).await {
            Ok(log) => log,
            Err(e) if e.kind == ErrorKind::NotFound => {
                return Err(Error::new(
                    OP,
                    ErrorKind::Unsupported,
                    format!("Nova has no console log for server {}: {}", server.id, e.message),
                ));
            }
            Err(e) => return Err(e),
        };
        let actions = self.cloud.instance_actions(&server.id).await?;
        Ok(slice(log.as_bytes(), boot_of(&actions, &server.id), offset, max_bytes))
    }

    /// Always `Unsupported`.
    async fn attach(&self, _id: &VmId, _io: StreamIo) -> Result<()> {
        Err(Error::new(
            "attach console",
            ErrorKind::Unsupported,
            "not supported by Nova: its serial console is a websocket behind Nova's console proxy, which vmlet does \
             not speak; `kubectl logs` shows the console output",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn action(action: &str, request_id: &str, start_time: &str) -> InstanceAction {
        InstanceAction { action: action.into(), request_id: request_id.into(), start_time: start_time.into() }
    }

    #[test]
    fn the_boot_is_the_newest_action_that_starts_the_guest() {
        let actions = [
            action("stop", "req-3", "2026-12-02T03:50:00.000000"),
            action("start", "req-2", "2026-12-02T03:45:00.000000"),
            action("create", "req-1", "2026-12-02T03:40:00.000000"),
            action("live-migration", "req-4", "2026-12-02T03:55:00.000000"),
        ];
        assert_eq!(boot_of(&actions, "sid"), "start:req-2");
        assert_eq!(boot_of(&actions[2..3], "sid"), "create:req-1");
        assert_eq!(boot_of(&[], "sid"), "sid");
    }

    #[test]
    fn output_is_sliced_by_byte_offset() {
        let log = b"FAKE CONSOLE OUTPUT\nANOTHER\nLAST LINE";
        let first = slice(log, "b".into(), 0, 5);
        assert_eq!((first.data.as_slice(), first.next_offset), (&b"FAKE "[..], 5));
        let rest = slice(log, "b".into(), 5, 1000);
        assert_eq!((rest.data.len(), rest.next_offset), (log.len() - 5, log.len() as u64));
        let past = slice(log, "b".into(), 500, 10);
        assert_eq!((past.data.len(), past.next_offset), (0, 500));
        let end = slice(log, "b".into(), log.len() as u64, 10);
        assert_eq!((end.data.len(), end.next_offset), (0, log.len() as u64));
    }
}
