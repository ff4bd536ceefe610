//! Whether KVM really runs a guest on a host, before `accelerator: auto`
//! chooses it.
//!
//! libvirt's domain capabilities for the `kvm` virt type say that QEMU can
//! open `/dev/kvm`, not that a guest runs there: under some nested
//! hypervisors KVM runs firmware but stops the guest's kernel with "KVM
//! internal error. Suberror: 1, emulation failure", and libvirt leaves the
//! domain paused. So on a local connection vmlet boots a probe: a transient
//! domain (`virDomainCreateXML` with `VIR_DOMAIN_START_AUTODESTROY`, so it
//! cannot outlive the connection) of type `kvm` with 128 MiB, no disk and no
//! network, that boots the host's own kernel (the newest `/boot/vmlinuz-*`)
//! with `console=ttyS0`, its serial console logged by libvirt to a file.
//! KVM runs guests when the kernel's first line (`Linux version`) shows up
//! within [`PROBE_WAIT`]; a paused or stopped probe, or silence, means it
//! does not. The probe is destroyed and its log removed either way.
//!
//! On a remote connection, whose files vmlet cannot read, no probe runs and
//! the capabilities decide. A local host without a readable kernel in
//! `/boot` cannot be probed either: it gets TCG, with a warning that names
//! `accelerator: kvm` as the way to use KVM unchecked.
//! `test-vms/guest/accelerator.sh` asks the same question of the test guest.

use std::path::Path;
use std::time::{Duration, Instant};

use virt::connect::Connect;
use virt::domain::{DomainState, DomainStateEnum};
use virt::sys;

use crate::xml::{escape, CONSOLE_LOG_DIR};

/// How long the probe's kernel gets to print its first line. A kernel under
/// KVM prints it in well under a second; under TCG it takes seconds, but TCG
/// is not what is probed.
pub(crate) const PROBE_WAIT: Duration = Duration::from_secs(20);

/// What the probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A kernel ran under KVM.
    Runs,
    /// It did not; why (for the log).
    Fails(String),
    /// No probe could run here; why (the capabilities decide).
    NotProbed(String),
}

/// Probe KVM on the host of `conn` (a local connection) with the host's
/// newest kernel, waiting up to `wait` for its first line.
pub(crate) fn probe(conn: &Connect, wait: Duration) -> Verdict {
    match host_kernel(Path::new("/boot")) {
        Some(kernel) => probe_with(conn, &kernel, wait),
        None => Verdict::NotProbed("no readable kernel /boot/vmlinuz-* to boot a probe guest with".to_owned()),
    }
}

/// Probe KVM on the host of `conn` by booting `kernel` (a path QEMU can
/// read on that host), waiting up to `wait` for its first line.
pub(crate) fn probe_with(conn: &Connect, kernel: &str, wait: Duration) -> Verdict {
    let name = format!("vmlet-kvm-probe-{}-{}", std::process::id(), nonce());
    let log = format!("{CONSOLE_LOG_DIR}/{name}.log");
    if let Err(err) = std::fs::create_dir_all(CONSOLE_LOG_DIR) {
        return Verdict::NotProbed(format!("cannot create {CONSOLE_LOG_DIR} for the probe's console: {err}"));
    }
    let domain = match conn.create_domain_xml(&probe_xml(&name, kernel, &log), sys::VIR_DOMAIN_START_AUTODESTROY) {
        Ok(domain) => domain,
        Err(err) => return Verdict::Fails(format!("the probe guest did not start under KVM: {}", err.message())),
    };
    let until = Instant::now() + wait;
    let verdict = loop {
        if std::fs::read(&log).is_ok_and(|text| contains(&text, b"Linux version")) {
            break Verdict::Runs;
        }
        match domain.state() {
            Ok((DomainStateEnum::Known(DomainState::Paused), reason)) => {
                break Verdict::Fails(format!(
                    "KVM paused the probe guest booting {kernel} (libvirt reason {reason:?}; QEMU's log under \
                     /var/log/libvirt/qemu/{name}.log says why, e.g. an emulation failure)"
                ));
            }
            Ok((DomainStateEnum::Known(DomainState::Shutoff | DomainState::Crashed), _)) | Err(_) => {
                break Verdict::Fails(format!(
                    "the probe guest booting {kernel} under KVM stopped before its kernel spoke"
                ));
            }
            Ok(_) if Instant::now() >= until => {
                break Verdict::Fails(format!(
                    "the probe guest's kernel ({kernel}) printed nothing under KVM within {}s",
                    wait.as_secs()
                ));
            }
            Ok(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    if let Err(err) = domain.destroy() {
        tracing::debug!(domain = %name, error = %err.message(), "probe guest already gone");
    }
    let _ = std::fs::remove_file(&log);
    verdict
}

/// The probe's transient domain: KVM, no disk, no network, the host's kernel
/// with its serial console logged to `log`, and nothing left after a crash
/// or reboot.
fn probe_xml(name: &str, kernel: &str, log: &str) -> String {
    format!(
        "<domain type='kvm'><name>{}</name><memory unit='MiB'>128</memory><vcpu>1</vcpu>\
         <os><type arch='x86_64'>hvm</type><kernel>{}</kernel>\
         <cmdline>console=ttyS0 earlyprintk=serial,ttyS0 panic=-1</cmdline></os>\
         <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>\
         <devices><serial type='pty'><log file='{}' append='off'/><target port='0'/></serial>\
         <memballoon model='none'/></devices></domain>",
        escape(name),
        escape(kernel),
        escape(log)
    )
}

/// The newest readable kernel image `vmlinuz-*` (or `vmlinuz`) in `boot`.
fn host_kernel(boot: &Path) -> Option<String> {
    let entries = std::fs::read_dir(boot).ok()?;
    let mut kernels: Vec<(std::time::SystemTime, String)> = entries
        .filter_map(Result::ok)
        .filter(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            name == "vmlinuz" || name.starts_with("vmlinuz-")
        })
        .filter_map(|entry| {
            let path = entry.path();
            let meta = std::fs::metadata(&path).ok().filter(|meta| meta.is_file())?;
            std::fs::File::open(&path).ok()?;
            Some((meta.modified().ok()?, path.to_str()?.to_owned()))
        })
        .collect();
    kernels.sort();
    kernels.pop().map(|(_, path)| path)
}

/// Whether `haystack` contains `needle`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

/// A few random hex digits, so that two probes never share a name.
fn nonce() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("{nanos:08x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_boots_the_kernel_under_kvm_with_no_disk_and_a_logged_console() {
        let xml = probe_xml("vmlet-kvm-probe-1-a", "/boot/vmlinuz-6.1.0-28-amd64", "/var/log/vmlet/console/p.log");
        assert!(xml.starts_with("<domain type='kvm'><name>vmlet-kvm-probe-1-a</name>"), "{xml}");
        assert!(xml.contains("<kernel>/boot/vmlinuz-6.1.0-28-amd64</kernel>"), "{xml}");
        assert!(xml.contains("<log file='/var/log/vmlet/console/p.log' append='off'/>"), "{xml}");
        assert!(xml.contains("<on_crash>destroy</on_crash>"), "{xml}");
        assert!(!xml.contains("<disk") && !xml.contains("<interface"), "nothing but a console: {xml}");
    }

    #[test]
    fn the_newest_readable_kernel_is_chosen() {
        let boot = std::env::temp_dir().join(format!("vmlet-kvm-probe-test-{}", std::process::id()));
        std::fs::create_dir_all(&boot).unwrap();
        let boot = Dir(boot);
        assert_eq!(host_kernel(boot.path()), None);
        std::fs::write(boot.path().join("config-6.1.0"), "x").unwrap();
        std::fs::write(boot.path().join("vmlinuz-6.1.0"), "old").unwrap();
        let old = std::time::SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(boot.path().join("vmlinuz-6.1.0"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        std::fs::write(boot.path().join("vmlinuz-6.12.0"), "new").unwrap();
        let chosen = host_kernel(boot.path()).expect("a kernel");
        assert!(chosen.ends_with("/vmlinuz-6.12.0"), "{chosen}");
        assert!(host_kernel(Path::new("/nonexistent")).is_none());
    }

    /// A directory removed on drop.
    struct Dir(std::path::PathBuf);

    impl Dir {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn the_first_line_is_found_anywhere_in_the_log() {
        assert!(contains(b"\x1b[0m[    0.000000] Linux version 6.1.0", b"Linux version"));
        assert!(!contains(b"SeaBIOS (version 1.16)", b"Linux version"));
    }
}
