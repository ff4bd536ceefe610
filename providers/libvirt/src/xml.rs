//! Domain XML that vmlet writes, and the identity element it reads back.
//!
//! vmlet writes its identity into the domain's `<metadata>` as one element in its
//! own namespace:
//!
//! ```xml
//! <metadata>
//!   <vmlet:vm xmlns:vmlet="https://vmlet.io/xmlns/domain/v1"
//!             uid="…" namespace="…" name="…"/>
//! </metadata>
//! ```
//!
//! libvirt hands that element back through `virDomainGetMetadata` (type ELEMENT,
//! keyed by the namespace URI), so reading it needs no XML library: a small
//! attribute scanner over one self-describing element is enough.

use std::fmt::Write as _;

use vmlet_provider::{DiskFormat, VmId, VmSpec};

use crate::chains;
use crate::networks::{interface_xml, Nic};

/// Namespace URI of vmlet's metadata element in a domain's `<metadata>`.
pub(crate) const METADATA_NS: &str = "https://vmlet.io/xmlns/domain/v1";

/// Prefix used for [`METADATA_NS`] when vmlet writes the element.
const METADATA_PREFIX: &str = "vmlet";

/// The identity vmlet records on a domain it defined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    /// The VirtualMachine object's UID.
    pub(crate) id: VmId,
    /// The VirtualMachine object's namespace.
    pub(crate) namespace: String,
    /// The VirtualMachine object's name.
    pub(crate) name: String,
}

/// Which libvirt driver the domain is for; decides the domain type and devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DomainKind {
    /// libvirt's test driver (`test:///…`): no devices, no real guest.
    Test,
    /// QEMU, accelerated as given: `<domain type='kvm'>` or `<domain type='qemu'>`.
    Qemu(Accelerator),
}

impl DomainKind {
    /// True for QEMU domains, whatever their accelerator.
    pub(crate) fn is_qemu(self) -> bool {
        matches!(self, DomainKind::Qemu(_))
    }

    /// The `type` attribute of `<domain>`.
    pub(crate) fn domain_type(self) -> &'static str {
        match self {
            DomainKind::Test => "test",
            DomainKind::Qemu(Accelerator::Kvm) => "kvm",
            DomainKind::Qemu(Accelerator::Tcg) => "qemu",
        }
    }
}

/// How QEMU runs guest code on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accelerator {
    /// Hardware virtualization through `/dev/kvm` (libvirt domain type `kvm`).
    Kvm,
    /// QEMU's software emulation, the Tiny Code Generator (domain type `qemu`).
    Tcg,
}

impl Accelerator {
    /// The name vmlet reports (node label `vmlet.io/accelerator`): `kvm` or `tcg`.
    pub fn as_str(self) -> &'static str {
        match self {
            Accelerator::Kvm => "kvm",
            Accelerator::Tcg => "tcg",
        }
    }
}

/// Escape `value` for use inside a single- or double-quoted XML attribute or as
/// element text.
pub(crate) fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// Undo [`escape`] and numeric character references; unknown entities are kept
/// as written.
fn unescape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        rest = &rest[amp..];
        let Some(semi) = rest.find(';') else { break };
        let entity = &rest[1..semi];
        let decoded = match entity {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => entity
                .strip_prefix("#x")
                .map(|hex| u32::from_str_radix(hex, 16))
                .or_else(|| entity.strip_prefix('#').map(str::parse))
                .and_then(|n| n.ok())
                .and_then(char::from_u32),
        };
        match decoded {
            Some(c) => {
                out.push(c);
                rest = &rest[semi + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The `<vmlet:vm …/>` element for `spec`, as written into `<metadata>`.
pub(crate) fn identity_element(spec: &VmSpec) -> String {
    format!(
        "<{p}:vm xmlns:{p}=\"{ns}\" uid=\"{uid}\" namespace=\"{namespace}\" name=\"{name}\"/>",
        p = METADATA_PREFIX,
        ns = METADATA_NS,
        uid = escape(&spec.id.0),
        namespace = escape(&spec.namespace),
        name = escape(&spec.name),
    )
}

/// Parse the identity from the element libvirt returns for [`METADATA_NS`].
/// `None` when the element lacks a non-empty `uid` (not written by vmlet).
pub(crate) fn parse_identity(element: &str) -> Option<Identity> {
    let attrs = attributes(element)?;
    let get = |key: &str| attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    let uid = get("uid").filter(|uid| !uid.is_empty())?;
    Some(Identity {
        id: VmId(uid),
        namespace: get("namespace").unwrap_or_default(),
        name: get("name").unwrap_or_default(),
    })
}

/// The attributes of the first element in `xml`, unescaped, in document order.
/// `None` when `xml` does not start with a well-formed start tag.
pub(crate) fn attributes(xml: &str) -> Option<Vec<(String, String)>> {
    let start = xml.find('<')?;
    let mut rest = &xml[start + 1..];
    // Skip the element name.
    let name_end = rest.find(|c: char| c.is_whitespace() || c == '/' || c == '>')?;
    rest = &rest[name_end..];
    let mut attrs = Vec::new();
    loop {
        rest = rest.trim_start();
        if rest.starts_with('/') || rest.starts_with('>') {
            return Some(attrs);
        }
        let eq = rest.find('=')?;
        let key = rest[..eq].trim().to_owned();
        rest = rest[eq + 1..].trim_start();
        let quote = rest.chars().next().filter(|c| *c == '"' || *c == '\'')?;
        rest = &rest[1..];
        let close = rest.find(quote)?;
        attrs.push((key, unescape(&rest[..close])));
        rest = &rest[close + 1..];
    }
}

/// A domain's size as a definition states it: vCPUs and memory, and the
/// hot-plug ceilings a running domain may grow to (libvirt's `<vcpu
/// current='cpus'>max_cpus</vcpu>`, `<memory>` = `max_memory_kib` and
/// `<currentMemory>` = `memory_kib`, the balloon's size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Size {
    /// vCPUs the domain has (online at start).
    pub(crate) cpus: u32,
    /// vCPUs the domain may have at most (hot-plug ceiling).
    pub(crate) max_cpus: u32,
    /// Memory in KiB: the balloon's size.
    pub(crate) memory_kib: u64,
    /// Memory in KiB at most: what QEMU gives the guest, the balloon's ceiling.
    pub(crate) max_memory_kib: u64,
}

impl Size {
    /// What vmlet defines for `spec`: memory rounded up to whole KiB, each
    /// ceiling at least the size (a missing or smaller ceiling is the size).
    pub(crate) fn of_spec(spec: &VmSpec) -> Size {
        let memory_kib = spec.memory_bytes.div_ceil(1024);
        Size {
            cpus: spec.cpus,
            max_cpus: spec.max_cpus.unwrap_or(0).max(spec.cpus),
            memory_kib,
            max_memory_kib: spec.max_memory_bytes.unwrap_or(0).div_ceil(1024).max(memory_kib),
        }
    }

    /// The size a domain XML (`virDomainGetXMLDesc`) states: `<vcpu>` and its
    /// `current` attribute, `<memory>` and `<currentMemory>` in any unit libvirt
    /// knows. Elements inside `<metadata>` are not read. `None` when `<vcpu>` or
    /// `<memory>` is missing or unreadable.
    pub(crate) fn from_domain_xml(xml: &str) -> Option<Size> {
        let body = xml.find("</metadata>").map_or(xml, |end| &xml[end..]);
        let (vcpu_attrs, vcpu_text) = element(body, "vcpu")?;
        let max_cpus: u32 = vcpu_text.trim().parse().ok()?;
        let cpus = match vcpu_attrs.iter().find(|(k, _)| k == "current") {
            Some((_, current)) => current.trim().parse().ok()?,
            None => max_cpus,
        };
        let max_memory_kib = memory_kib(element(body, "memory")?)?;
        let memory_kib = match element(body, "currentMemory") {
            Some(current) => self::memory_kib(current)?,
            None => max_memory_kib,
        };
        Some(Size { cpus, max_cpus, memory_kib, max_memory_kib })
    }
}

/// Where the first `<name …>` or `<name/>` start tag in `xml` begins (exactly
/// that name: `<vcpu` does not match `<vcpus>`).
pub(crate) fn start_of(xml: &str, name: &str) -> Option<usize> {
    let open = format!("<{name}");
    let mut from = 0;
    loop {
        let at = from + xml[from..].find(&open)?;
        match xml[at + open.len()..].chars().next() {
            Some(c) if c == '>' || c == '/' || c.is_whitespace() => return Some(at),
            _ => from = at + open.len(),
        }
    }
}

/// The attributes and text of the first `<name …>text</name>` element in `xml`
/// (exactly that name: `<vcpu` does not match `<vcpus>`).
pub(crate) fn element<'a>(xml: &'a str, name: &str) -> Option<(Vec<(String, String)>, &'a str)> {
    let start = start_of(xml, name)?;
    let attrs = attributes(&xml[start..])?;
    let text_start = start + xml[start..].find('>')? + 1;
    let text = &xml[text_start..];
    Some((attrs, &text[..text.find('<')?]))
}

/// KiB (rounded up) of a libvirt memory element from its `unit` attribute and
/// text; libvirt's units (<https://libvirt.org/formatdomain.html#memory-allocation>),
/// KiB when there is none.
fn memory_kib((attrs, text): (Vec<(String, String)>, &str)) -> Option<u64> {
    let value: u64 = text.trim().parse().ok()?;
    let unit = attrs.iter().find(|(k, _)| k == "unit").map_or("KiB", |(_, v)| v.as_str());
    let bytes_per_unit: u64 = match unit {
        "b" | "bytes" => 1,
        "KB" => 1000,
        "k" | "KiB" => 1 << 10,
        "MB" => 1000 * 1000,
        "M" | "MiB" => 1 << 20,
        "GB" => 1000 * 1000 * 1000,
        "G" | "GiB" => 1 << 30,
        "TB" => 1000 * 1000 * 1000 * 1000,
        "T" | "TiB" => 1 << 40,
        _ => return None,
    };
    Some(value.checked_mul(bytes_per_unit)?.div_ceil(1024))
}

/// One disk of a domain as its XML (`virDomainGetXMLDesc`) states it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Disk {
    /// `<target dev='…'>`: the name libvirt and its block jobs know the disk
    /// by (`vda`).
    pub(crate) target: String,
    /// `<disk type='…'>`: where the data lives (`file`, `block`, `network`,
    /// `volume`).
    pub(crate) kind: String,
    /// The file or block device the disk reads (`<source file='…'>` or
    /// `<source dev='…'>`); `None` for other sources.
    pub(crate) source: Option<String>,
    /// `<driver type='…'>`: the image format (`qcow2`, `raw`), when stated.
    pub(crate) format: Option<String>,
    /// `<serial>…</serial>`: for vmlet's data disks, the name of the disk in
    /// the VirtualMachine (`spec.disks[].name`).
    pub(crate) serial: Option<String>,
}

/// The disks of a domain XML in document order: `<disk>` elements with
/// `device='disk'` (or no `device`, libvirt's default). CD-ROMs, floppies and
/// LUNs are not counted, and a disk's backing chain (`<backingStore>`) and
/// copy target (`<mirror>`) are not read. Elements inside `<metadata>` are not
/// read either.
pub(crate) fn disks(xml: &str) -> Vec<Disk> {
    let get = |attrs: &[(String, String)], key: &str| attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    let mut disks = Vec::new();
    for (attrs, body) in devices(xml, "disk") {
        if get(&attrs, "device").is_some_and(|device| device != "disk") {
            continue;
        }
        // libvirt writes the disk's own <driver> and <source> before its
        // backing chain and mirror, which have <source> elements of their
        // own (but no <target>).
        let own = ["<backingStore", "<mirror"].iter().filter_map(|tag| body.find(tag)).min().unwrap_or(body.len());
        let own = &body[..own];
        let child = |name: &str| start_of(own, name).and_then(|at| attributes(&own[at..]));
        let target = start_of(body, "target").and_then(|at| attributes(&body[at..]));
        let Some(target) = target.and_then(|attrs| get(&attrs, "dev")) else {
            continue;
        };
        disks.push(Disk {
            target,
            kind: get(&attrs, "type").unwrap_or_else(|| "file".to_owned()),
            source: child("source").and_then(|attrs| get(&attrs, "file").or_else(|| get(&attrs, "dev"))),
            format: child("driver").and_then(|attrs| get(&attrs, "type")),
            serial: self::element(body, "serial").map(|(_, text)| unescape(text.trim())),
        });
    }
    disks
}

/// The `<name>` elements of a domain XML after its `<metadata>`, in document
/// order: each one's attributes and body (empty for `<name …/>`). Stops at
/// the first start tag that does not parse.
fn devices<'a>(xml: &'a str, name: &str) -> Vec<(Vec<(String, String)>, &'a str)> {
    let close = format!("</{name}>");
    let mut rest = xml.find("</metadata>").map_or(xml, |end| &xml[end..]);
    let mut found = Vec::new();
    while let Some(start) = start_of(rest, name) {
        let element = &rest[start..];
        let (Some(attrs), Some(head_end)) = (attributes(element), element.find('>')) else {
            break;
        };
        let body = if element[..head_end].ends_with('/') {
            ""
        } else {
            &element[head_end + 1..element.find(&close).unwrap_or(element.len())]
        };
        rest = &element[head_end + 1 + body.len()..];
        found.push((attrs, body));
    }
    found
}

/// One network interface of a domain as its XML (`virDomainGetXMLDesc`)
/// states it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DomainInterface {
    /// `<interface type='…'>`: `network`, `bridge`, `direct`, `user`, ...
    pub(crate) kind: String,
    /// `<mac address='…'/>`, lower case; libvirt writes one into every
    /// interface it defines (vmlet's own XML may leave it out).
    pub(crate) mac: Option<String>,
}

/// The network interfaces of a domain XML in document order. Elements inside
/// `<metadata>` are not read.
pub(crate) fn interfaces(xml: &str) -> Vec<DomainInterface> {
    devices(xml, "interface")
        .into_iter()
        .map(|(attrs, body)| DomainInterface {
            kind: attrs.into_iter().find(|(k, _)| k == "type").map(|(_, v)| v).unwrap_or_default(),
            mac: start_of(body, "mac")
                .and_then(|at| attributes(&body[at..]))
                .and_then(|attrs| attrs.into_iter().find(|(k, _)| k == "address"))
                .map(|(_, mac)| mac.to_ascii_lowercase()),
        })
        .collect()
}

/// Name of the storage pool whose target directory is a host's default storage
/// root (what `virsh pool-define-as default dir --target …` and virt-install
/// create).
pub(crate) const DEFAULT_POOL: &str = "default";

/// The default storage root of a host without a [`DEFAULT_POOL`] (libvirt's own
/// default image directory on most distributions).
pub(crate) const DEFAULT_IMAGES_DIR: &str = "/var/lib/libvirt/images";

/// The text of `<target><path>…</path></target>` in a storage pool's XML
/// (`virStoragePoolGetXMLDesc`), unescaped and trimmed; `None` when the pool
/// has no target path or the XML does not parse that far. `<source>` may carry
/// `<dir path='…'/>` or `<device path='…'/>` attributes: only the element text
/// inside `<target>` counts.
pub(crate) fn pool_target_path(pool_xml: &str) -> Option<String> {
    let start = pool_xml.find("<target>")? + "<target>".len();
    let target = &pool_xml[start..];
    let target = &target[..target.find("</target>")?];
    let path_start = target.find("<path>")? + "<path>".len();
    let path = &target[path_start..];
    let path = unescape(path[..path.find("</path>")?].trim());
    (!path.is_empty()).then_some(path)
}

/// Directory virtlogd writes QEMU domains' serial-console logs into, one file per
/// domain named after its UUID ([`console_log_path`]).
pub(crate) const CONSOLE_LOG_DIR: &str = "/var/log/vmlet/console";

/// The serial-console log of the domain with UUID `uuid`: virtlogd truncates it at
/// every start (`append='off'`), so it holds the output of the current or last boot.
pub(crate) fn console_log_path(uuid: &str) -> String {
    format!("{CONSOLE_LOG_DIR}/{uuid}.log")
}

/// Name of the virtio-serial port qemu-guest-agent listens on in the guest.
pub(crate) const AGENT_CHANNEL: &str = "org.qemu.guest_agent.0";

/// `<target dev>` of the data disks ([`VmSpec::disks`]), in order after the
/// boot disk `vda`: as many as the CRD allows (16).
pub(crate) const DATA_DISK_TARGETS: [&str; 16] =
    ["vdb", "vdc", "vdd", "vde", "vdf", "vdg", "vdh", "vdi", "vdj", "vdk", "vdl", "vdm", "vdn", "vdo", "vdp", "vdq"];

/// `<target dev>` of the cloud-init seed CD-ROM: the secondary IDE channel's
/// master, where PCs traditionally keep their CD-ROM drive.
pub(crate) const SEED_TARGET: &str = "hdc";

/// The persistent domain definition for `spec` on a driver of `kind` (domain type
/// `test`, `kvm` or `qemu`, see [`DomainKind::domain_type`]), with UUID
/// `uuid`: name [`VmSpec::backend_name`], vmlet's identity in `<metadata>`, and
/// the size [`Size::of_spec`] gives: `<vcpu current='cpus'>max_cpus</vcpu>` (just
/// `<vcpu>cpus</vcpu>` without a higher ceiling), `<memory>` the memory ceiling
/// and `<currentMemory>` the memory, in KiB. The test driver gets nothing more.
///
/// QEMU domains also get: direct kernel boot when `spec.kernel_boot` is set
/// (`<kernel>`, `<initrd>`, `<cmdline>`); a virtio disk from `spec.image` when set
/// ([`DiskFormat::of_image_path`]) and one for each of `spec.disks` on
/// [`DATA_DISK_TARGETS`], in the disk's format, with the disk's name as its
/// serial, each with its backing chain pinned ([`chains::backing_store_xml`]:
/// libvirt reads no image header for it); a serial console on a
/// pty whose output virtlogd records from boot in [`console_log_path`]; a
/// virtio-serial channel for qemu-guest-agent ([`AGENT_CHANNEL`], libvirt adds
/// the controller and picks the host socket); one virtio NIC per entry of
/// `nics` (see [`crate::networks`]: never QEMU's user-mode network); a virtio balloon that reports guest memory statistics every 5 s; and
/// when `seed` names a cloud-init seed image, that image as a read-only CD-ROM
/// on the IDE bus ([`SEED_TARGET`]), which the `pc` (i440fx) machine has built
/// in (its PIIX IDE controller: no controller to add, and guests read it with
/// their ATA and CD-ROM drivers). A CD-ROM is no disk to [`disks`], so backups
/// leave the seed alone.
pub(crate) fn domain_xml(spec: &VmSpec, kind: DomainKind, uuid: &str, seed: Option<&str>, nics: &[Nic]) -> String {
    let size = Size::of_spec(spec);
    let mut xml = String::new();
    let domain_type = kind.domain_type();
    // Writing into a String cannot fail.
    let _ = writeln!(xml, "<domain type='{domain_type}'>");
    let _ = writeln!(xml, "  <name>{}</name>", escape(&spec.backend_name()));
    let _ = writeln!(xml, "  <uuid>{}</uuid>", escape(uuid));
    let _ = writeln!(xml, "  <metadata>{}</metadata>", identity_element(spec));
    let _ = writeln!(xml, "  <memory unit='KiB'>{}</memory>", size.max_memory_kib);
    let _ = writeln!(xml, "  <currentMemory unit='KiB'>{}</currentMemory>", size.memory_kib);
    if size.max_cpus > size.cpus {
        let _ = writeln!(xml, "  <vcpu placement='static' current='{}'>{}</vcpu>", size.cpus, size.max_cpus);
    } else {
        let _ = writeln!(xml, "  <vcpu placement='static'>{}</vcpu>", size.cpus);
    }
    match kind {
        DomainKind::Test => {
            xml.push_str("  <os>\n    <type>hvm</type>\n  </os>\n");
        }
        DomainKind::Qemu(_) => {
            xml.push_str("  <os>\n    <type arch='x86_64' machine='pc'>hvm</type>\n");
            if let Some(boot) = &spec.kernel_boot {
                let _ = writeln!(xml, "    <kernel>{}</kernel>", escape(&boot.kernel));
                if let Some(initrd) = &boot.initrd {
                    let _ = writeln!(xml, "    <initrd>{}</initrd>", escape(initrd));
                }
                if let Some(cmdline) = &boot.cmdline {
                    let _ = writeln!(xml, "    <cmdline>{}</cmdline>", escape(cmdline));
                }
            } else {
                xml.push_str("    <boot dev='hd'/>\n");
            }
            xml.push_str(concat!(
                "  </os>\n",
                "  <features>\n    <acpi/>\n    <apic/>\n  </features>\n",
                "  <clock offset='utc'/>\n",
                "  <on_poweroff>destroy</on_poweroff>\n",
                "  <on_reboot>restart</on_reboot>\n",
                "  <on_crash>destroy</on_crash>\n",
                "  <devices>\n",
            ));
            if let Some(image) = &spec.image {
                let _ = write!(
                    xml,
                    concat!(
                        "    <disk type='file' device='disk'>\n",
                        "      <driver name='qemu' type='{format}'/>\n",
                        "      <source file='{source}'/>\n",
                        "{chain}",
                        "      <target dev='vda' bus='virtio'/>\n",
                        "    </disk>\n",
                    ),
                    format = DiskFormat::of_image_path(image).as_str(),
                    source = escape(image),
                    chain = spec.image_backing_chain.as_deref().map(chains::backing_store_xml).unwrap_or_default(),
                );
            }
            for (disk, target) in spec.disks.iter().zip(DATA_DISK_TARGETS) {
                let _ = write!(
                    xml,
                    concat!(
                        "    <disk type='file' device='disk'>\n",
                        "      <driver name='qemu' type='{format}'/>\n",
                        "      <source file='{source}'/>\n",
                        "{chain}",
                        "      <target dev='{target}' bus='virtio'/>\n",
                        "      <serial>{serial}</serial>\n",
                        "    </disk>\n",
                    ),
                    format = disk.format.as_str(),
                    source = escape(&disk.path),
                    chain = chains::backing_store_xml(&disk.backing_chain),
                    target = target,
                    serial = escape(&disk.name),
                );
            }
            if let Some(seed) = seed {
                let _ = write!(
                    xml,
                    concat!(
                        "    <disk type='file' device='cdrom'>\n",
                        "      <driver name='qemu' type='raw'/>\n",
                        "      <source file='{source}'/>\n",
                        "      <target dev='{target}' bus='ide'/>\n",
                        "      <readonly/>\n",
                        "    </disk>\n",
                    ),
                    source = escape(seed),
                    target = SEED_TARGET,
                );
            }
            let _ = write!(
                xml,
                concat!(
                    "    <serial type='pty'>\n",
                    "      <log file='{log}' append='off'/>\n",
                    "    </serial>\n",
                    "    <console type='pty'/>\n",
                    "    <channel type='unix'>\n",
                    "      <target type='virtio' name='{agent}'/>\n",
                    "    </channel>\n",
                ),
                log = escape(&console_log_path(uuid)),
                agent = AGENT_CHANNEL,
            );
            for nic in nics {
                xml.push_str(&interface_xml(nic));
            }
            xml.push_str(concat!(
                "    <memballoon model='virtio'>\n",
                "      <stats period='5'/>\n",
                "    </memballoon>\n",
                "  </devices>\n",
            ));
        }
    }
    xml.push_str("</domain>\n");
    xml
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmlet_provider::KernelBoot;

    const UUID: &str = "0b7a4c1e-3f7d-4d8e-9a51-2c6e8f0d1a2b";

    fn spec() -> VmSpec {
        VmSpec {
            options: Default::default(),
            cloud_init: None,
            disks: vec![],
            networks: vec![],
            id: VmId("6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a".into()),
            namespace: "team-a".into(),
            name: "web.1".into(),
            cpus: 2,
            memory_bytes: 512 * 1024 * 1024 + 1,
            max_cpus: None,
            max_memory_bytes: None,
            image: None,
            image_backing_chain: None,
            kernel_boot: None,
        }
    }

    #[test]
    fn a_pools_target_path_is_read_from_its_target_element_only() {
        let xml = "<pool type='dir'>\n  <name>default</name>\n  <source>\n    <dir path='/not/this'/>\n  </source>\n  \
                   <target>\n    <path>/srv/vm&amp;images</path>\n    <permissions>\n      <mode>0711</mode>\n    \
                   </permissions>\n  </target>\n</pool>\n";
        assert_eq!(pool_target_path(xml).as_deref(), Some("/srv/vm&images"));
        assert_eq!(pool_target_path("<pool type='rbd'><name>default</name><source/></pool>"), None);
        assert_eq!(pool_target_path("<pool><target><path>  </path></target></pool>"), None);
        assert_eq!(pool_target_path("<pool><target><path>/x"), None);
    }

    #[test]
    fn escape_covers_the_five_xml_specials_and_round_trips() {
        let raw = r#"a&b<c>d"e'f.g-h"#;
        assert_eq!(escape(raw), "a&amp;b&lt;c&gt;d&quot;e&apos;f.g-h");
        assert_eq!(unescape(&escape(raw)), raw);
        assert_eq!(unescape("&#65;&#x42;&bogus;"), "AB&bogus;");
    }

    #[test]
    fn identity_round_trips_through_the_metadata_element() {
        let mut spec = spec();
        spec.name = "quote\"and'amp&".into();
        let parsed = parse_identity(&identity_element(&spec)).expect("identity");
        assert_eq!(parsed.id, spec.id);
        assert_eq!(parsed.namespace, "team-a");
        assert_eq!(parsed.name, "quote\"and'amp&");
    }

    #[test]
    fn identity_parses_libvirts_own_serialisation() {
        // What libvirt 9 returns from virDomainGetMetadata(ELEMENT).
        let element = "<vmlet:vm xmlns:vmlet=\"https://vmlet.io/xmlns/domain/v1\" \
                       uid=\"u-1\" namespace=\"ns\" name=\"n\"/>\n";
        let parsed = parse_identity(element).expect("identity");
        assert_eq!(parsed.id, VmId("u-1".into()));
        assert_eq!((parsed.namespace.as_str(), parsed.name.as_str()), ("ns", "n"));
    }

    #[test]
    fn element_without_uid_is_no_identity() {
        assert_eq!(parse_identity("<vmlet:vm namespace='ns' name='n'/>"), None);
        assert_eq!(parse_identity("<vmlet:vm uid=''/>"), None);
        assert_eq!(parse_identity(""), None);
    }

    #[test]
    fn memory_is_rounded_up_to_whole_kib() {
        let xml = domain_xml(&spec(), DomainKind::Test, UUID, None, &[]);
        assert!(xml.contains("<memory unit='KiB'>524289</memory>"), "{xml}");
        assert!(xml.contains("<vcpu placement='static'>2</vcpu>"), "{xml}");
        assert!(xml.contains("<name>team-a_web.1</name>"), "{xml}");
        assert!(xml.starts_with("<domain type='test'>"), "{xml}");
    }

    #[test]
    fn ceilings_above_the_size_make_hot_pluggable_vcpus_and_a_balloon() {
        let mut spec = spec();
        spec.max_cpus = Some(4);
        spec.max_memory_bytes = Some(1024 * 1024 * 1024);
        let xml = domain_xml(&spec, DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]);
        assert!(xml.contains("<vcpu placement='static' current='2'>4</vcpu>"), "{xml}");
        assert!(xml.contains("<memory unit='KiB'>1048576</memory>"), "{xml}");
        assert!(xml.contains("<currentMemory unit='KiB'>524289</currentMemory>"), "{xml}");
        assert!(xml.contains("<memballoon model='virtio'>"), "{xml}");
        let size = Size { cpus: 2, max_cpus: 4, memory_kib: 524_289, max_memory_kib: 1_048_576 };
        assert_eq!(Size::of_spec(&spec), size);
        assert_eq!(Size::from_domain_xml(&xml), Some(size), "what vmlet writes reads back");
    }

    #[test]
    fn ceilings_below_the_size_are_the_size() {
        let mut spec = spec();
        spec.max_cpus = Some(1);
        spec.max_memory_bytes = Some(1024);
        let xml = domain_xml(&spec, DomainKind::Test, UUID, None, &[]);
        assert!(xml.contains("<vcpu placement='static'>2</vcpu>"), "{xml}");
        assert!(xml.contains("<memory unit='KiB'>524289</memory>"), "{xml}");
        assert!(xml.contains("<currentMemory unit='KiB'>524289</currentMemory>"), "{xml}");
        let size = Size::from_domain_xml(&xml).expect("size");
        assert_eq!((size.cpus, size.max_cpus, size.memory_kib, size.max_memory_kib), (2, 2, 524_289, 524_289));
    }

    #[test]
    fn size_is_read_from_libvirts_own_xml() {
        // As libvirt 9 formats a running domain (abridged), with a metadata
        // element and a per-vCPU list that must not be mistaken for the size.
        let xml = "<domain type='qemu' id='3'>\n  <name>ns_vm</name>\n  <metadata>\n    \
                   <x:memory xmlns:x='urn:x'>1</x:memory>\n    <memory>7</memory>\n  </metadata>\n  \
                   <memory unit='KiB'>524288</memory>\n  <currentMemory unit='KiB'>393216</currentMemory>\n  \
                   <vcpu placement='static' current='2'>4</vcpu>\n  <vcpus>\n    \
                   <vcpu id='0' enabled='yes' hotpluggable='no' order='1'/>\n  </vcpus>\n</domain>\n";
        assert_eq!(
            Size::from_domain_xml(xml),
            Some(Size { cpus: 2, max_cpus: 4, memory_kib: 393_216, max_memory_kib: 524_288 })
        );
        let units = "<domain><memory unit='GiB'>1</memory><currentMemory unit='b'>1025</currentMemory>\
                     <vcpu>3</vcpu></domain>";
        assert_eq!(
            Size::from_domain_xml(units),
            Some(Size { cpus: 3, max_cpus: 3, memory_kib: 2, max_memory_kib: 1 << 20 })
        );
        assert_eq!(Size::from_domain_xml("<domain><memory>64</memory></domain>"), None, "no vcpu");
        assert_eq!(Size::from_domain_xml("<domain><vcpu>1</vcpu><memory unit='parsec'>1</memory></domain>"), None);
    }

    #[test]
    fn qemu_domain_gets_a_disk_only_when_an_image_is_given() {
        let without = domain_xml(&spec(), DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]);
        assert!(without.starts_with("<domain type='qemu'>"), "{without}");
        assert!(without.contains("machine='pc'"), "{without}");
        assert!(without.contains("<boot dev='hd'/>"), "{without}");
        assert!(!without.contains("<disk"), "{without}");

        let mut with = spec();
        with.image = Some("/var/lib/vmlet/images/it's.qcow2".into());
        let xml = domain_xml(&with, DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]);
        assert!(xml.contains("<driver name='qemu' type='qcow2'/>"), "{xml}");
        assert!(xml.contains("<source file='/var/lib/vmlet/images/it&apos;s.qcow2'/>"), "{xml}");

        with.image = Some("/images/disk.img".into());
        assert!(domain_xml(&with, DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]).contains("type='raw'"));
    }

    #[test]
    fn disks_are_read_from_libvirts_own_xml_without_cdroms_or_backing_files() {
        // As libvirt 9 formats a running domain (abridged): a metadata element
        // that mimics a disk, a disk with a backing chain, a CD-ROM.
        let xml = "<domain type='qemu' id='3'>\n  <metadata>\n    <x:disk xmlns:x='urn:x'/><disk><target dev='no'/></disk>\n  \
                   </metadata>\n  <devices>\n    <disk type='file' device='disk'>\n      \
                   <driver name='qemu' type='qcow2'/>\n      <source file='/var/lib/vmlet/it&apos;s.qcow2' index='2'/>\n      \
                   <backingStore type='file' index='1'>\n        <format type='raw'/>\n        \
                   <source file='/base.img'/>\n        <backingStore/>\n      </backingStore>\n      \
                   <target dev='vda' bus='virtio'/>\n      <alias name='virtio-disk0'/>\n    </disk>\n    \
                   <disk type='file' device='cdrom'>\n      <target dev='hdc' bus='ide'/>\n      <readonly/>\n    \
                   </disk>\n    <disk type='block'>\n      <source dev='/dev/sdb'/>\n      \
                   <target dev='vdb' bus='virtio'/>\n    </disk>\n    <disks/>\n  </devices>\n</domain>\n";
        assert_eq!(
            disks(xml),
            vec![
                Disk {
                    target: "vda".into(),
                    kind: "file".into(),
                    source: Some("/var/lib/vmlet/it's.qcow2".into()),
                    format: Some("qcow2".into()),
                    serial: None,
                },
                Disk {
                    target: "vdb".into(),
                    kind: "block".into(),
                    source: Some("/dev/sdb".into()),
                    format: None,
                    serial: None,
                },
            ]
        );
    }

    #[test]
    fn what_vmlet_defines_has_one_disk_with_an_image_and_none_without() {
        let mut spec = spec();
        assert_eq!(disks(&domain_xml(&spec, DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[])), vec![]);
        spec.image = Some("/images/disk.qcow2".into());
        let found = disks(&domain_xml(&spec, DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]));
        assert_eq!(
            found,
            vec![Disk {
                target: "vda".into(),
                kind: "file".into(),
                source: Some("/images/disk.qcow2".into()),
                format: Some("qcow2".into()),
                serial: None,
            }]
        );
    }

    #[test]
    fn data_disks_follow_the_boot_disk_as_virtio_disks_in_their_format_with_their_names_as_serials() {
        use vmlet_provider::{BackingFile, DataDisk};
        let mut spec = spec();
        spec.image = Some("/images/boot.qcow2".into());
        spec.image_backing_chain = Some(vec![]);
        let disk = |name: &str, path: &str, format, backing_chain| DataDisk {
            name: name.into(),
            path: path.into(),
            format,
            create_bytes: None,
            backing_chain,
        };
        let base = BackingFile { path: "/images/logs-base.raw".into(), format: DiskFormat::Raw };
        spec.disks = vec![
            disk("data", "/vols/1/disk.img", DiskFormat::Raw, vec![]),
            disk("logs", "/images/logs.qcow2", DiskFormat::Qcow2, vec![base]),
        ];
        let xml = domain_xml(&spec, DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]);
        assert!(xml.contains(concat!(
            "      <driver name='qemu' type='qcow2'/>\n",
            "      <source file='/images/boot.qcow2'/>\n",
            "      <backingStore/>\n",
            "      <target dev='vda' bus='virtio'/>\n",
        )));
        assert!(xml.contains(concat!(
            "      <driver name='qemu' type='raw'/>\n",
            "      <source file='/vols/1/disk.img'/>\n",
            "      <backingStore/>\n",
            "      <target dev='vdb' bus='virtio'/>\n",
            "      <serial>data</serial>\n",
        )));
        assert!(xml.contains(concat!(
            "      <driver name='qemu' type='qcow2'/>\n",
            "      <source file='/images/logs.qcow2'/>\n",
            "      <backingStore type='file'>\n",
            "        <format type='raw'/>\n",
            "        <source file='/images/logs-base.raw'/>\n",
            "        <backingStore/>\n",
            "      </backingStore>\n",
            "      <target dev='vdc' bus='virtio'/>\n",
            "      <serial>logs</serial>\n",
        )));
        // A boot image whose chain vmlet could not read is left to libvirt.
        spec.image_backing_chain = None;
        let unpinned = domain_xml(&spec, DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]);
        assert!(unpinned.contains("<source file='/images/boot.qcow2'/>\n      <target dev='vda' bus='virtio'/>\n"));
        let found: Vec<(String, Option<String>)> = disks(&xml).into_iter().map(|d| (d.target, d.serial)).collect();
        let expected = [("vda", None), ("vdb", Some("data")), ("vdc", Some("logs"))];
        assert_eq!(found, expected.map(|(target, serial)| (target.to_owned(), serial.map(str::to_owned))));
    }

    #[test]
    fn a_cloud_init_seed_is_a_read_only_ide_cdrom_that_is_no_disk() {
        let mut spec = spec();
        spec.image = Some("/images/disk.qcow2".into());
        let xml = domain_xml(&spec, DomainKind::Qemu(Accelerator::Tcg), UUID, Some("/seeds/team-a_web.1_u&1.iso"), &[]);
        let cdrom = concat!(
            "    <disk type='file' device='cdrom'>\n",
            "      <driver name='qemu' type='raw'/>\n",
            "      <source file='/seeds/team-a_web.1_u&amp;1.iso'/>\n",
            "      <target dev='hdc' bus='ide'/>\n",
            "      <readonly/>\n",
            "    </disk>\n",
        );
        assert!(xml.contains(cdrom), "{xml}");
        assert!(xml.contains("machine='pc'"), "the IDE bus is the pc machine's own: {xml}");
        let found: Vec<String> = disks(&xml).into_iter().map(|disk| disk.target).collect();
        assert_eq!(found, ["vda"], "backups see the one disk, not the seed");
        assert!(!domain_xml(&spec, DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]).contains("cdrom"));
        assert!(!domain_xml(&spec, DomainKind::Test, UUID, Some("/seeds/s.iso"), &[]).contains("cdrom"));
    }

    #[test]
    fn qemu_domain_type_follows_the_accelerator() {
        assert!(
            domain_xml(&spec(), DomainKind::Qemu(Accelerator::Kvm), UUID, None, &[]).starts_with("<domain type='kvm'>")
        );
        assert!(domain_xml(&spec(), DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[])
            .starts_with("<domain type='qemu'>"));
    }

    #[test]
    fn test_domain_stays_minimal() {
        let mut spec = spec();
        spec.kernel_boot = Some(KernelBoot { kernel: "/k".into(), initrd: None, cmdline: None });
        let xml = domain_xml(&spec, DomainKind::Test, UUID, None, &[]);
        assert!(xml.contains(&format!("<uuid>{UUID}</uuid>")), "{xml}");
        for absent in ["<devices>", "<kernel>", "<serial", "<channel"] {
            assert!(!xml.contains(absent), "{absent} in {xml}");
        }
    }

    #[test]
    fn qemu_domain_records_its_console_and_has_an_agent_channel_and_user_networking() {
        let xml = domain_xml(&spec(), DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]);
        assert!(xml.contains(&format!("<uuid>{UUID}</uuid>")), "{xml}");
        assert!(xml.contains(&format!("<log file='/var/log/vmlet/console/{UUID}.log' append='off'/>")), "{xml}");
        assert!(xml.contains("<console type='pty'/>"), "{xml}");
        assert!(xml.contains("<target type='virtio' name='org.qemu.guest_agent.0'/>"), "{xml}");
        assert!(!xml.contains("<interface"), "no network offered, no NIC (never user-mode): {xml}");
        assert!(xml.contains("<stats period='5'/>"), "{xml}");
    }

    #[test]
    fn interfaces_are_read_from_libvirts_own_xml_with_their_macs_in_lower_case() {
        let xml = "<domain type='kvm'>\n  <metadata><vmlet:vm uid='u'/><interface type='user'/></metadata>\n  \
                   <devices>\n    <interface type='network'>\n      <mac address='52:54:00:AB:CD:01'/>\n      \
                   <source network='vmlet-lan' portid='x' bridge='vmlet-lan0'/>\n      <target dev='vnet3'/>\n      \
                   <model type='virtio'/>\n    </interface>\n    <interface type='direct'/>\n  </devices>\n</domain>\n";
        assert_eq!(
            interfaces(xml),
            vec![
                DomainInterface { kind: "network".into(), mac: Some("52:54:00:ab:cd:01".into()) },
                DomainInterface { kind: "direct".into(), mac: None },
            ]
        );
    }

    #[test]
    fn qemu_domain_gets_one_interface_per_nic_in_order_and_never_a_user_mode_one() {
        use crate::networks::Attachment;
        let nics = [
            Nic { attachment: Attachment::Network("vmlet-lan".into()), mac: Some("52:54:00:00:00:01".into()) },
            Nic { attachment: Attachment::Bridge("vmlan0".into()), mac: None },
        ];
        let xml = domain_xml(&spec(), DomainKind::Qemu(Accelerator::Tcg), UUID, None, &nics);
        let network = xml.find("<interface type='network'>").expect("network NIC");
        let bridge = xml.find("<interface type='bridge'>").expect("bridge NIC");
        assert!(network < bridge, "NIC order is the VM's: {xml}");
        assert!(!xml.contains("type='user'"), "{xml}");
        assert_eq!(
            interfaces(&xml),
            vec![
                DomainInterface { kind: "network".into(), mac: Some("52:54:00:00:00:01".into()) },
                DomainInterface { kind: "bridge".into(), mac: None },
            ]
        );
    }

    #[test]
    fn qemu_domain_boots_the_given_kernel_directly() {
        let mut spec = spec();
        spec.kernel_boot = Some(KernelBoot {
            kernel: "/guest/vmlinuz".into(),
            initrd: Some("/guest/initrd.img".into()),
            cmdline: Some("console=ttyS0 a<b".into()),
        });
        let xml = domain_xml(&spec, DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]);
        assert!(xml.contains("<kernel>/guest/vmlinuz</kernel>"), "{xml}");
        assert!(xml.contains("<initrd>/guest/initrd.img</initrd>"), "{xml}");
        assert!(xml.contains("<cmdline>console=ttyS0 a&lt;b</cmdline>"), "{xml}");
        assert!(!xml.contains("<boot dev="), "{xml}");

        spec.kernel_boot = Some(KernelBoot { kernel: "/guest/vmlinuz".into(), initrd: None, cmdline: None });
        let xml = domain_xml(&spec, DomainKind::Qemu(Accelerator::Tcg), UUID, None, &[]);
        assert!(!xml.contains("<initrd>") && !xml.contains("<cmdline>"), "{xml}");
    }
}
