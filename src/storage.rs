//! Storage roots: the host directories a VM's disk image, kernel and initrd may
//! come from. A security boundary between namespaces.
//!
//! Under `qemu:///system` libvirt relabels (chowns, and labels for SELinux or
//! AppArmor) whatever file a domain names, so a path in a VirtualMachine is a
//! request to hand that file to a guest. Without a boundary, anyone who may
//! create a VirtualMachine (or edit its pod's annotations) could attach another
//! namespace's disk image, or any file of the host, to a VM of theirs.
//!
//! # The rule
//!
//! Each host has a list of storage roots, absolute directories: the host's
//! `storageRoots` in vmlet's config, or when it names none, the backend's
//! default ([`vmlet_provider::HostInfo::storage_roots`]; libvirt: the target
//! directory of the storage pool `default`, else `/var/lib/libvirt/images`).
//! Before it defines a VM, the node agent checks every file the VM names
//! (`spec.image`, `spec.kernelBoot.kernel`, `spec.kernelBoot.initrd`,
//! `spec.disks[].hostImage.path`, and the backing files a qcow2 image or host image
//! names, one at a time before the image behind it is read):
//!
//! 1. **By its path**, component by component: the path is absolute, has no
//!    `..` component and lies strictly below a root. So
//!    `/var/lib/libvirt/images-evil/x` is not under `/var/lib/libvirt/images`,
//!    the root itself is no file under it, and `/var/lib/libvirt//images/./x`
//!    is the same as `/var/lib/libvirt/images/x`. A volume name (a relative
//!    path) is refused.
//! 2. **By the file it really is**, where vmlet can see it: when the host's URI
//!    names no remote host (`qemu:///system`, `test:///…`), vmlet shares the
//!    backend's file system, so it resolves symbolic links in the path and in
//!    the roots ([`std::fs::canonicalize`]) and requires the real file to lie
//!    under a real root. A link inside a root that points out of it is refused;
//!    so is a path that exists but cannot be resolved (a dangling link, a link
//!    loop, a directory vmlet may not search). A root that is itself a link
//!    (`/var/lib/libvirt/images -> /srv/images`) works as expected.
//!
//! A file vmlet cannot see (the host is remote, e.g. `qemu+ssh://…`, or the file
//! does not exist yet) gets check 1 alone. On such hosts, roots must not contain
//! symbolic links that point out of them. vmlet must also see the same files at
//! the same paths as the backend for check 2 to mean anything: run it on the
//! host, or with the roots mounted at the same paths.
//!
//! A refusal names the field, the path, the host's roots and the fix. Nothing
//! is defined; the pod waits with reason `StorageNotAllowed`.
//!
//! # What roots do not do
//!
//! - **Roots are per host, not per namespace.** Any VM on a host may use any
//!   file under any of the host's roots, including another namespace's image
//!   in a directory meant for that namespace. Separate tenants by host (node
//!   selectors, taints) with their own roots, not by directory.
//! - **A check is not a lock.** Whoever may write into a root decides what the
//!   next VM gets (a file swapped for a link after the check is followed by the
//!   backend). Roots must be writable by the host's administrators only.
//! - **VMs already defined are not affected**: the check runs before a define
//!   only, so narrowing a host's roots stops nothing that runs.
//! - `/` as a root allows every file. It counts only when written in the
//!   config; a backend that reports `/` as its default is ignored.

use std::collections::HashMap;
use std::fmt;
use std::path::{Component, Path, PathBuf};

use vmlet_provider::{HostInfo, ImageReference, VmSpec};

use crate::config::HostConfig;
use crate::v1alpha1::VmDisk;

/// The VirtualMachine field that names a host file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageField {
    /// `spec.image`: the boot disk.
    Image,
    /// `spec.kernelBoot.kernel`.
    Kernel,
    /// `spec.kernelBoot.initrd`.
    Initrd,
    /// `spec.disks[<name>].hostImage.path`: a data disk's host image.
    HostImage {
        /// The disk's name (`spec.disks[].name`).
        disk: String,
    },
    /// The catalogue image a provisioned claim's volume is an overlay on
    /// (the claim's `dataSourceRef`).
    ClaimBase {
        /// The disk's name (`spec.disks[].name`).
        disk: String,
    },
}

impl fmt::Display for StorageField {
    /// The field's path in the VirtualMachine, e.g. `spec.kernelBoot.kernel`
    /// or `spec.disks[data].hostImage.path`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StorageField::Image => f.write_str("spec.image"),
            StorageField::Kernel => f.write_str("spec.kernelBoot.kernel"),
            StorageField::Initrd => f.write_str("spec.kernelBoot.initrd"),
            StorageField::HostImage { disk } => write!(f, "spec.disks[{disk}].hostImage.path"),
            StorageField::ClaimBase { disk } => {
                write!(f, "the VirtualMachineImage under spec.disks[{disk}].persistentVolumeClaim")
            }
        }
    }
}

/// Why a file is not allowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotAllowed {
    /// The path does not start with `/` (e.g. a volume name).
    #[error("is not an absolute path")]
    Relative,
    /// The path has a `..` component.
    #[error("has a '..' component")]
    ParentComponent,
    /// The path is not strictly below any root.
    #[error("is not under a storage root")]
    OutsideRoots,
    /// The path is below a root, but the file it names (links followed) is not.
    #[error("resolves to {real:?} through a symbolic link, which is not under a storage root")]
    ResolvesOutside {
        /// The resolved path.
        real: String,
    },
    /// The path exists on the host but cannot be resolved.
    #[error("cannot be resolved on the host ({reason})")]
    Unresolvable {
        /// The file system's answer, e.g. a dangling link or a link loop.
        reason: String,
    },
    /// The image is allowed, but a backing file its header names (which the
    /// hypervisor would open too) is not.
    #[error("names the backing file {:?}, which {}", .0.file, .0.why)]
    Backing(Box<BackingFile>),
    /// The VM's namespace may not name host files at all (it is not in
    /// vmlet's `trustedNamespaces`).
    #[error("is a host file, which namespace {namespace} may not name")]
    Untrusted {
        /// The VM's namespace.
        namespace: String,
    },
    /// A catalogue image booted without a root disk: its file, which every
    /// VM booting the image (and every overlay made from it) shares, would
    /// be the VM's writable boot disk, and namespace `namespace` may not
    /// write it.
    #[error("is a catalogue image whose file namespace {namespace} may not write")]
    SharedImage {
        /// The VM's namespace.
        namespace: String,
    },
}

/// A backing file that is not allowed ([`NotAllowed::Backing`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackingFile {
    /// The backing file as the image names it (joined to the image's
    /// directory when relative).
    pub file: String,
    /// Why it is not allowed.
    pub why: NotAllowed,
}

/// A VM file outside its host's storage roots: what the pod's status message
/// and the Warning Event say, naming the field, the path, the roots and the fix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageRefusal {
    /// The field naming the file.
    pub field: StorageField,
    /// The path as the VM gives it.
    pub path: String,
    /// Why it is refused.
    pub why: NotAllowed,
    /// The host (node name).
    pub host: String,
    /// The host's storage roots.
    pub roots: Vec<String>,
}

impl fmt::Display for StorageRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (field, path) = (&self.field, &self.path);
        if let NotAllowed::Untrusted { namespace } = &self.why {
            return write!(
                f,
                "{field} {path:?} names a file of host {}, which only namespaces an administrator lists in \
                 trustedNamespaces of vmlet's config may do, and namespace {namespace} is not one of them: boot an \
                 image of the catalogue instead (kubectl get virtualmachineimages; spec.image: <name>) and take data \
                 disks from PersistentVolumeClaims",
                self.host
            );
        }
        if let NotAllowed::SharedImage { namespace } = &self.why {
            return write!(
                f,
                "{field} {path:?} is a catalogue image, and booting it without a root disk would make its file on \
                 host {}, which every VM of the image shares, this VM's writable disk: only namespaces an \
                 administrator lists in trustedNamespaces of vmlet's config may do that, and namespace {namespace} \
                 is not one of them. Give the VM its own disk made from the image: spec.rootDisk: {{size: <at least \
                 the image's size>, storageClassName: <a class of provisioner libvirt.vmlet.io>}}",
                self.host
            );
        }
        write!(
            f,
            "{field} {path:?} {}; host {} allows files only under its storage roots {}. Move the file under one of \
             them, set {field} to its new path and delete this pod so that it is made again, or ask the host's \
             administrator to add a directory to the host's storageRoots in vmlet's config",
            self.why,
            self.host,
            list(&self.roots)
        )
    }
}

impl std::error::Error for StorageRefusal {}

/// `[a, b]`, or a note that there are none.
fn list(roots: &[String]) -> String {
    if roots.is_empty() {
        "[] (none: only VMs without files can run there)".to_owned()
    } else {
        format!("[{}]", roots.join(", "))
    }
}

/// Where a host's storage roots came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootsOrigin {
    /// The host's `storageRoots` in vmlet's config.
    Config,
    /// The backend's default ([`HostInfo::storage_roots`]).
    Backend,
}

impl RootsOrigin {
    /// `config` or `backend`, for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            RootsOrigin::Config => "config",
            RootsOrigin::Backend => "backend",
        }
    }
}

/// What the host's file system says about a path, as far as vmlet can see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// vmlet cannot see the path: the host is remote, or there is no such file.
    /// Only the check by path applies.
    Unseen,
    /// The path as it really is: absolute, every symbolic link followed.
    Real(PathBuf),
    /// The path exists but cannot be resolved; the reason, for the message.
    Unresolvable(String),
}

/// One host's storage roots, resolved once when its agent starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageRoots {
    host: String,
    roots: Vec<String>,
    origin: RootsOrigin,
    /// vmlet shares the backend's file system (the URI names no remote host).
    local: bool,
    /// Backend defaults that were not used, each with the reason.
    ignored: Vec<(String, String)>,
    /// What `spec.image` names on this host's backend: only a host path is
    /// checked against the roots (a catalog image is the back end's business).
    image: ImageReference,
    /// The namespaces whose VMs may name host files themselves.
    trusted: Vec<String>,
}

impl StorageRoots {
    /// The roots of `host`: its config's `storageRoots` (validated by
    /// [`crate::config::Config`]), or else the backend's defaults in `info`,
    /// of which invalid ones and `/` are ignored (see [`StorageRoots::ignored`]).
    pub fn for_host(host: &HostConfig, info: &HostInfo) -> StorageRoots {
        let local = names_no_remote_host(&host.uri);
        if let Some(roots) = &host.storage_roots {
            return StorageRoots {
                host: host.name.clone(),
                roots: roots.clone(),
                origin: RootsOrigin::Config,
                local,
                ignored: vec![],
                image: ImageReference::HostPath,
                trusted: Vec::new(),
            };
        }
        let mut roots = Vec::new();
        let mut ignored = Vec::new();
        for root in &info.storage_roots {
            match check_root(root) {
                Err(why) => ignored.push((root.clone(), why)),
                Ok(()) if Path::new(root).parent().is_none() => {
                    ignored.push((root.clone(), "allows every file; only a configured root may be /".to_owned()))
                }
                Ok(()) => roots.push(root.clone()),
            }
        }
        StorageRoots {
            host: host.name.clone(),
            roots,
            origin: RootsOrigin::Backend,
            local,
            ignored,
            image: ImageReference::HostPath,
            trusted: Vec::new(),
        }
    }

    /// These roots for a backend whose `spec.image` names `image`: with
    /// [`ImageReference::Catalog`] (a Nova image, a vSphere template) the image
    /// is not a host file and is not checked; kernels and initrds still are.
    #[must_use]
    pub fn with_image_reference(mut self, image: ImageReference) -> StorageRoots {
        self.image = image;
        self
    }

    /// These roots, with VMs of `namespaces` (vmlet's `trustedNamespaces`)
    /// allowed to name host files themselves ([`StorageRoots::check_trust`]).
    #[must_use]
    pub fn with_trusted_namespaces(mut self, namespaces: &[String]) -> StorageRoots {
        self.trusted = namespaces.to_vec();
        self
    }

    /// Decide whether `spec` (as its VirtualMachine gives it, before a
    /// catalogue image is resolved), with the data disks `disks`, may name
    /// the host files it names: only a VM of a trusted namespace may (the
    /// files are then checked against the roots as well). A catalogue name
    /// in `spec.image` (no leading `/`) names no file.
    /// Errors: the first host file named, as a [`StorageRefusal`] with
    /// [`NotAllowed::Untrusted`].
    pub fn check_trust(&self, spec: &VmSpec, disks: &[VmDisk]) -> Result<(), Box<StorageRefusal>> {
        if self.trusted.contains(&spec.namespace) {
            return Ok(());
        }
        let named = self
            .files_of(spec, disks)
            .into_iter()
            .find(|(field, path)| *field != StorageField::Image || !crate::v1alpha1::is_catalogue_name(path));
        match named {
            None => Ok(()),
            Some((field, path)) => {
                Err(self.refusal(field, path, NotAllowed::Untrusted { namespace: spec.namespace.clone() }))
            }
        }
    }

    /// Decide whether a VM of `spec` (as its VirtualMachine gives it),
    /// with a root disk when `root_disk`, may boot its catalogue image's
    /// file itself: on a back end whose images are host files, that file is
    /// the base of every VM of the image (and of every overlay made from
    /// it), so only a VM of a trusted namespace may write it; others boot
    /// their own volume made from it (`spec.rootDisk`). A host path in
    /// `spec.image` is [`StorageRoots::check_trust`]'s to judge.
    /// Errors: a [`StorageRefusal`] of `spec.image` with
    /// [`NotAllowed::SharedImage`].
    pub fn check_own_boot_disk(&self, spec: &VmSpec, root_disk: bool) -> Result<(), Box<StorageRefusal>> {
        let Some(image) = spec.image.as_deref() else { return Ok(()) };
        if root_disk
            || self.image != ImageReference::HostPath
            || !crate::v1alpha1::is_catalogue_name(image)
            || self.trusted.contains(&spec.namespace)
        {
            return Ok(());
        }
        Err(self.refusal(StorageField::Image, image, NotAllowed::SharedImage { namespace: spec.namespace.clone() }))
    }

    /// The roots, as configured or reported.
    pub fn roots(&self) -> &[String] {
        &self.roots
    }

    /// Where the roots came from.
    pub fn origin(&self) -> RootsOrigin {
        self.origin
    }

    /// Whether vmlet resolves symbolic links on this host (its URI names no
    /// remote host).
    pub fn resolves_links(&self) -> bool {
        self.local
    }

    /// Backend defaults that were not used, each with the reason (to log).
    pub fn ignored(&self) -> &[(String, String)] {
        &self.ignored
    }

    /// Decide whether `spec`, with the data disks `disks` of its
    /// VirtualMachine, may be defined on this host: every file it names
    /// (image, kernel, initrd, host images) lies under a root, by path and,
    /// where `resolve` sees it, by the file it really is. Pure: what the file
    /// system says comes from `resolve`.
    /// Errors: the first file that is not allowed, as a [`StorageRefusal`].
    pub fn check(
        &self,
        spec: &VmSpec,
        disks: &[VmDisk],
        resolve: impl Fn(&Path) -> Resolution,
    ) -> Result<(), Box<StorageRefusal>> {
        for (field, path) in self.files_of(spec, disks) {
            if let Err(why) = self.check_file(path, &resolve) {
                return Err(self.refusal(field, path, why));
            }
        }
        Ok(())
    }

    /// [`StorageRoots::check`] against this machine's file system where vmlet
    /// shares it with the backend (the VM's files and the roots resolved by
    /// [`resolve_here`]), by path alone elsewhere.
    pub async fn check_on_host(&self, spec: &VmSpec, disks: &[VmDisk]) -> Result<(), Box<StorageRefusal>> {
        let files = self.files_of(spec, disks);
        let seen = self.seen_here(files.iter().map(|(_, path)| *path)).await;
        self.check(spec, disks, |path| seen.get(path).cloned().unwrap_or(Resolution::Unseen))
    }

    /// Check `backing`, a backing file that the image `image` (named by
    /// `field`, and allowed already) names in its header, as
    /// [`StorageRoots::check_on_host`] checks the image itself: the
    /// hypervisor opens it too. Errors: a [`StorageRefusal`] of `field` and
    /// `image`, saying which backing file is not allowed and why.
    pub async fn check_backing_on_host(
        &self,
        field: &StorageField,
        image: &str,
        backing: &str,
    ) -> Result<(), Box<StorageRefusal>> {
        let seen = self.seen_here([backing].into_iter()).await;
        let resolve = |path: &Path| seen.get(path).cloned().unwrap_or(Resolution::Unseen);
        self.check_file(backing, &resolve).map_err(|why| {
            self.refusal(
                field.clone(),
                image,
                NotAllowed::Backing(Box::new(BackingFile { file: backing.to_owned(), why })),
            )
        })
    }

    /// What this machine's file system says about `paths` and the roots,
    /// where vmlet shares it with the backend; nothing elsewhere (every path
    /// then reads [`Resolution::Unseen`]).
    async fn seen_here<'p>(&self, paths: impl Iterator<Item = &'p str>) -> HashMap<PathBuf, Resolution> {
        let mut seen = HashMap::new();
        if !self.local {
            return seen;
        }
        for path in paths.map(PathBuf::from).chain(self.roots.iter().map(PathBuf::from)) {
            let resolution = resolve_here(&path).await;
            seen.insert(path, resolution);
        }
        seen
    }

    fn refusal(&self, field: StorageField, path: &str, why: NotAllowed) -> Box<StorageRefusal> {
        let (host, roots) = (self.host.clone(), self.roots.clone());
        Box::new(StorageRefusal { field, path: path.to_owned(), why, host, roots })
    }

    /// The host files `spec` and `disks` name, each with its field.
    fn files_of<'s>(&self, spec: &'s VmSpec, disks: &'s [VmDisk]) -> Vec<(StorageField, &'s str)> {
        host_files_of(spec, disks, self.image)
    }

    fn check_file(&self, path: &str, resolve: &impl Fn(&Path) -> Resolution) -> Result<(), NotAllowed> {
        check_path(&self.roots, path, resolve)
    }
}

/// Check a file that vmlet itself writes or reads on a host (a backup, a disk
/// a restore makes) against `roots` (the host's backup or storage roots), as
/// [`StorageRoots::check`] checks a VM's files: by path, and where vmlet
/// shares the host's file system (`local`) by the file it really is. A file
/// that does not exist yet is judged by its directory, which must really be a
/// root or lie under one (a link to elsewhere in a root is refused).
pub async fn check_host_file(roots: &[String], local: bool, path: &str) -> Result<(), NotAllowed> {
    if !local {
        return check_path(roots, path, &|_| Resolution::Unseen);
    }
    let mut seen = HashMap::new();
    let parent = Path::new(path).parent().map(Path::to_path_buf);
    for p in roots.iter().map(PathBuf::from).chain([PathBuf::from(path)]).chain(parent.clone()) {
        let resolution = resolve_here(&p).await;
        seen.insert(p, resolution);
    }
    let resolve = |p: &Path| seen.get(p).cloned().unwrap_or(Resolution::Unseen);
    check_path(roots, path, &resolve)?;
    match (resolve(Path::new(path)), parent.map(|p| resolve(&p))) {
        (Resolution::Unseen, Some(Resolution::Real(dir))) => {
            let inside = roots.iter().any(|root| {
                let real_root = match resolve(Path::new(root)) {
                    Resolution::Real(real) => real,
                    _ => PathBuf::from(root),
                };
                dir == real_root || strictly_under(&dir, &real_root)
            });
            if inside {
                Ok(())
            } else {
                Err(NotAllowed::ResolvesOutside { real: dir.display().to_string() })
            }
        }
        (Resolution::Unseen, Some(Resolution::Unresolvable(reason))) => Err(NotAllowed::Unresolvable { reason }),
        _ => Ok(()),
    }
}

/// [`StorageRoots::check`] of one path against `roots`.
fn check_path(roots: &[String], path: &str, resolve: &impl Fn(&Path) -> Resolution) -> Result<(), NotAllowed> {
    let path = Path::new(path);
    if !path.is_absolute() {
        return Err(NotAllowed::Relative);
    }
    if path.components().any(|c| c == Component::ParentDir) {
        return Err(NotAllowed::ParentComponent);
    }
    if !roots.iter().any(|root| strictly_under(path, Path::new(root))) {
        return Err(NotAllowed::OutsideRoots);
    }
    match resolve(path) {
        Resolution::Unseen => Ok(()),
        Resolution::Unresolvable(reason) => Err(NotAllowed::Unresolvable { reason }),
        Resolution::Real(real) => {
            let inside = roots.iter().any(|root| {
                let root = Path::new(root);
                match resolve(root) {
                    Resolution::Real(real_root) => strictly_under(&real, &real_root),
                    Resolution::Unseen | Resolution::Unresolvable(_) => strictly_under(&real, root),
                }
            });
            if inside {
                Ok(())
            } else {
                Err(NotAllowed::ResolvesOutside { real: real.display().to_string() })
            }
        }
    }
}

impl fmt::Display for StorageRoots {
    /// `[a, b]`, as in refusal messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&list(&self.roots))
    }
}

/// The host files `spec` and the VM's `disks` name, with their fields: the
/// image (when it is a host path on this backend), kernel, initrd, and each
/// host image in spec order. A claim's image is checked where the claim is
/// resolved ([`check_host_file`]).
fn host_files_of<'s>(spec: &'s VmSpec, disks: &'s [VmDisk], image: ImageReference) -> Vec<(StorageField, &'s str)> {
    let mut files = Vec::new();
    if let (Some(path), ImageReference::HostPath) = (&spec.image, image) {
        files.push((StorageField::Image, path.as_str()));
    }
    if let Some(boot) = &spec.kernel_boot {
        files.push((StorageField::Kernel, boot.kernel.as_str()));
        if let Some(initrd) = &boot.initrd {
            files.push((StorageField::Initrd, initrd.as_str()));
        }
    }
    for disk in disks {
        if let Some(path) = disk.host_image_path() {
            files.push((StorageField::HostImage { disk: disk.name.clone() }, path));
        }
    }
    files
}

/// `path` lies below `root`, compared component by component, and is not
/// `root` itself.
fn strictly_under(path: &Path, root: &Path) -> bool {
    path.starts_with(root) && path.components().count() > root.components().count()
}

/// Resolve `path` on this machine: [`Resolution::Real`] with every link
/// followed; [`Resolution::Unseen`] when there is no such file (nor a link of
/// that name); [`Resolution::Unresolvable`] for a dangling link, a link loop
/// or a directory vmlet may not search. Runs on tokio's blocking pool.
pub async fn resolve_here(path: &Path) -> Resolution {
    match tokio::fs::canonicalize(path).await {
        Ok(real) => Resolution::Real(real),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => match tokio::fs::symlink_metadata(path).await {
            Ok(_) => Resolution::Unresolvable("a symbolic link to a file that does not exist".to_owned()),
            Err(_) => Resolution::Unseen,
        },
        Err(err) => Resolution::Unresolvable(err.to_string()),
    }
}

/// True when a backend URI names no remote host: `scheme:///path`
/// (`qemu:///system`, `test:///abs/host.xml`), where vmlet and the backend
/// share one file system.
pub fn names_no_remote_host(uri: &str) -> bool {
    uri.split_once("://").is_some_and(|(_, rest)| rest.starts_with('/'))
}

/// Check one configured storage root: an absolute directory path without `..`
/// components or control characters. Errors: what is wrong and what to write
/// instead, for [`crate::config::ConfigError`].
pub fn check_root(root: &str) -> Result<(), String> {
    const EXAMPLE: &str = "e.g. /var/lib/libvirt/images";
    if root.is_empty() {
        return Err(format!("is empty; write an absolute directory on the host, {EXAMPLE}"));
    }
    if root.chars().any(char::is_control) {
        return Err(format!("contains a control character; write an absolute directory on the host, {EXAMPLE}"));
    }
    let path = Path::new(root);
    if !path.is_absolute() {
        return Err(format!("is not an absolute path; write an absolute directory on the host, {EXAMPLE}"));
    }
    if path.components().any(|c| c == Component::ParentDir) {
        return Err("has a '..' component; write the directory it means without '..'".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmlet_provider::{KernelBoot, VmId};

    const IMAGES: &str = "/var/lib/libvirt/images";

    fn host(uri: &str, roots: Option<&[&str]>) -> HostConfig {
        let roots = roots.map(|r| r.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let yaml = serde_json::json!({"name": "host-a", "provider": "libvirt", "uri": uri, "storageRoots": roots});
        serde_json::from_value(yaml).unwrap()
    }

    fn info(roots: &[&str]) -> HostInfo {
        HostInfo {
            cpus: 2,
            memory_bytes: 1 << 30,
            architecture: "amd64".into(),
            hypervisor: "libvirt 9.0.0 (QEMU)".into(),
            accelerator: None,
            storage_roots: roots.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// Roots given in the config of a host reached over ssh (no link resolution).
    fn configured(roots: &[&str]) -> StorageRoots {
        StorageRoots::for_host(&host("qemu+ssh://root@kvm-1/system", Some(roots)), &info(&[IMAGES]))
    }

    fn vm() -> VmSpec {
        VmSpec {
            options: Default::default(),
            cloud_init: None,
            disks: vec![],
            networks: vec![],
            id: VmId("6d0c1e52-0000-4000-8000-000000000001".into()),
            namespace: "team-a".into(),
            name: "web".into(),
            cpus: 1,
            memory_bytes: 1 << 28,
            max_cpus: None,
            max_memory_bytes: None,
            image: None,
            image_backing_chain: None,
            kernel_boot: None,
        }
    }

    fn with_image(image: &str) -> VmSpec {
        VmSpec { image: Some(image.into()), ..vm() }
    }

    fn with_kernel(kernel: &str, initrd: Option<&str>) -> VmSpec {
        VmSpec {
            kernel_boot: Some(KernelBoot { kernel: kernel.into(), initrd: initrd.map(Into::into), cmdline: None }),
            ..vm()
        }
    }

    fn refusal(roots: &StorageRoots, spec: &VmSpec) -> StorageRefusal {
        *roots.check(spec, &[], |_| Resolution::Unseen).expect_err("refused")
    }

    fn allowed(roots: &StorageRoots, spec: &VmSpec) -> bool {
        roots.check(spec, &[], |_| Resolution::Unseen).is_ok()
    }

    #[test]
    fn only_trusted_namespaces_name_host_files_and_a_catalogue_name_is_none() {
        let roots = configured(&[IMAGES]);
        let image = with_image("/var/lib/libvirt/images/web.qcow2");
        let refused = *roots.check_trust(&image, &[]).expect_err("team-a is not trusted");
        assert_eq!(refused.why, NotAllowed::Untrusted { namespace: "team-a".into() });
        assert!(
            refused.to_string().starts_with(
                "spec.image \"/var/lib/libvirt/images/web.qcow2\" names a file of host host-a, which only namespaces \
                 an administrator lists in trustedNamespaces of vmlet's config may do, and namespace team-a is not \
                 one of them: boot an image of the catalogue instead"
            ),
            "{refused}"
        );
        let kernel = with_kernel("/var/lib/libvirt/images/vmlinuz", None);
        assert_eq!(roots.check_trust(&kernel, &[]).expect_err("kernel").field, StorageField::Kernel);
        let disks: Vec<VmDisk> = serde_json::from_value(serde_json::json!([
            {"name": "logs", "hostImage": {"path": "/var/lib/libvirt/images/logs.raw"}}]))
        .unwrap();
        assert_eq!(
            roots.check_trust(&vm(), &disks).expect_err("host image").field,
            StorageField::HostImage { disk: "logs".into() }
        );
        assert!(roots.check_trust(&with_image("debian-12"), &[]).is_ok(), "a catalogue name names no file");
        assert!(roots.check_trust(&vm(), &[]).is_ok());
        let trusted = roots.with_trusted_namespaces(&["team-a".to_owned()]);
        assert!(trusted.check_trust(&image, &disks).is_ok());
        assert!(trusted.check_trust(&kernel, &[]).is_ok());
    }

    #[test]
    fn only_trusted_namespaces_boot_a_catalogue_images_file_itself() {
        let roots = configured(&[IMAGES]);
        let catalogue = with_image("debian-12");
        let refused = *roots.check_own_boot_disk(&catalogue, false).expect_err("team-a is not trusted");
        assert_eq!((&refused.field, refused.path.as_str()), (&StorageField::Image, "debian-12"));
        assert_eq!(refused.why, NotAllowed::SharedImage { namespace: "team-a".into() });
        let message = refused.to_string();
        assert!(message.starts_with("spec.image \"debian-12\" is a catalogue image, and booting it"), "{message}");
        assert!(
            message.contains("namespace team-a is not one of them") && message.contains("spec.rootDisk"),
            "{message}"
        );
        assert!(roots.check_own_boot_disk(&catalogue, true).is_ok(), "its own root disk is made from the image");
        assert!(roots.check_own_boot_disk(&vm(), false).is_ok(), "no image");
        let path = with_image("/var/lib/libvirt/images/web.qcow2");
        assert!(roots.check_own_boot_disk(&path, false).is_ok(), "a path is check_trust's to judge");
        let nova = configured(&[IMAGES]).with_image_reference(ImageReference::Catalog);
        assert!(nova.check_own_boot_disk(&catalogue, false).is_ok(), "a Nova server gets its own root disk");
        let trusted = roots.with_trusted_namespaces(&["team-a".to_owned()]);
        assert!(trusted.check_own_boot_disk(&catalogue, false).is_ok());
    }

    #[test]
    fn a_vm_without_files_is_allowed_even_by_a_host_without_roots() {
        assert!(allowed(&configured(&[]), &vm()));
    }

    #[test]
    fn an_image_below_a_root_is_allowed_at_any_depth_and_spelling() {
        let roots = configured(&[IMAGES, "/srv/vm/"]);
        for image in [
            "/var/lib/libvirt/images/web.qcow2",
            "/var/lib/libvirt/images/team-a/web.qcow2",
            "/var/lib/libvirt//images/./web.qcow2",
            "/srv/vm/disk.raw",
        ] {
            assert!(allowed(&roots, &with_image(image)), "{image}");
        }
    }

    #[test]
    fn a_directory_whose_name_only_starts_like_a_root_is_outside_it() {
        let refused = refusal(&configured(&[IMAGES]), &with_image("/var/lib/libvirt/images-evil/x.qcow2"));
        assert_eq!(refused.why, NotAllowed::OutsideRoots);
    }

    #[test]
    fn a_parent_component_is_refused_even_when_it_would_stay_inside() {
        for image in ["/var/lib/libvirt/images/../../../../etc/shadow", "/var/lib/libvirt/images/a/../b.qcow2"] {
            assert_eq!(refusal(&configured(&[IMAGES]), &with_image(image)).why, NotAllowed::ParentComponent, "{image}");
        }
    }

    #[test]
    fn relative_paths_and_volume_names_are_refused() {
        for image in ["web.qcow2", "images/web.qcow2", "./web.qcow2", ""] {
            assert_eq!(refusal(&configured(&[IMAGES]), &with_image(image)).why, NotAllowed::Relative, "{image:?}");
        }
    }

    #[test]
    fn the_root_itself_is_not_a_file_under_it() {
        assert_eq!(
            refusal(&configured(&[IMAGES]), &with_image("/var/lib/libvirt/images/")).why,
            NotAllowed::OutsideRoots
        );
    }

    #[test]
    fn host_files_outside_the_roots_are_refused() {
        for image in ["/etc/shadow", "/dev/sda", "/var/lib/libvirt/qemu/other.qcow2", "/"] {
            assert_eq!(refusal(&configured(&[IMAGES]), &with_image(image)).why, NotAllowed::OutsideRoots, "{image}");
        }
    }

    #[test]
    fn kernel_and_initrd_are_checked_and_named_like_the_image() {
        let roots = configured(&["/var/lib/vmlet/guest"]);
        assert!(allowed(&roots, &with_kernel("/var/lib/vmlet/guest/vmlinuz", Some("/var/lib/vmlet/guest/initrd.img"))));
        let kernel = refusal(&roots, &with_kernel("/boot/vmlinuz", None));
        assert_eq!((kernel.field, kernel.path.as_str()), (StorageField::Kernel, "/boot/vmlinuz"));
        let initrd = refusal(&roots, &with_kernel("/var/lib/vmlet/guest/vmlinuz", Some("/boot/initrd.img")));
        assert_eq!((initrd.field, initrd.path.as_str()), (StorageField::Initrd, "/boot/initrd.img"));
    }

    #[test]
    fn a_catalog_image_is_the_backends_business_but_a_kernel_is_still_a_host_file() {
        let nova = configured(&[IMAGES]).with_image_reference(ImageReference::Catalog);
        assert!(allowed(&nova, &with_image("cirros-0.6")));
        let kernel = refusal(&nova, &VmSpec { image: Some("cirros-0.6".into()), ..with_kernel("/boot/vmlinuz", None) });
        assert_eq!((kernel.field, kernel.path.as_str()), (StorageField::Kernel, "/boot/vmlinuz"));
        let libvirt = configured(&[IMAGES]);
        assert_eq!(refusal(&libvirt, &with_image("cirros-0.6")).field, StorageField::Image, "a name is no host path");
    }

    #[test]
    fn the_refusal_names_field_path_roots_and_the_fix() {
        let message = refusal(&configured(&[IMAGES, "/srv/vm"]), &with_image("/etc/shadow")).to_string();
        assert_eq!(
            message,
            "spec.image \"/etc/shadow\" is not under a storage root; host host-a allows files only under its \
             storage roots [/var/lib/libvirt/images, /srv/vm]. Move the file under one of them, set spec.image to \
             its new path and delete this pod so that it is made again, or ask the host's administrator to add a \
             directory to the host's storageRoots in vmlet's config"
        );
        let none = refusal(&configured(&[]), &with_image("/var/lib/libvirt/images/web.qcow2")).to_string();
        assert!(none.contains("storage roots [] (none: only VMs without files can run there)"), "{none}");
    }

    #[test]
    fn roots_are_per_host_so_another_namespaces_image_under_its_own_root_is_still_allowed() {
        // Directories per namespace on one host do not separate namespaces:
        // a team-a VM may name team-b's image. Separate tenants by host.
        let roots = configured(&["/srv/images/team-a", "/srv/images/team-b"]);
        let team_a_vm = VmSpec { namespace: "team-a".into(), ..with_image("/srv/images/team-b/db.qcow2") };
        assert!(allowed(&roots, &team_a_vm));
    }

    #[test]
    fn a_configured_slash_allows_every_absolute_path() {
        let roots = configured(&["/"]);
        assert!(allowed(&roots, &with_image("/etc/shadow")));
        assert_eq!(refusal(&roots, &with_image("/etc/../etc/shadow")).why, NotAllowed::ParentComponent);
    }

    #[test]
    fn without_configured_roots_the_backend_default_applies_except_slash_and_invalid_ones() {
        let roots = StorageRoots::for_host(&host("qemu:///system", None), &info(&["/srv/pool", "/", "pool"]));
        assert_eq!(roots.roots(), ["/srv/pool".to_owned()]);
        assert_eq!(roots.origin(), RootsOrigin::Backend);
        let ignored: Vec<&str> = roots.ignored().iter().map(|(root, _)| root.as_str()).collect();
        assert_eq!(ignored, ["/", "pool"]);
        assert!(!allowed(&roots, &with_image("/etc/shadow")));
    }

    #[test]
    fn configured_roots_replace_the_backend_default_even_when_empty() {
        let roots = StorageRoots::for_host(&host("qemu:///system", Some(&[])), &info(&[IMAGES]));
        assert_eq!(roots.origin(), RootsOrigin::Config);
        assert!(roots.roots().is_empty());
        assert!(!allowed(&roots, &with_image("/var/lib/libvirt/images/web.qcow2")));
    }

    #[test]
    fn links_are_resolved_only_on_hosts_that_share_vmlets_file_system() {
        let info = info(&[IMAGES]);
        assert!(StorageRoots::for_host(&host("qemu:///system", None), &info).resolves_links());
        assert!(StorageRoots::for_host(&host("test:///opt/host-a.xml", None), &info).resolves_links());
        assert!(!StorageRoots::for_host(&host("qemu+ssh://root@kvm-1/system", None), &info).resolves_links());
        assert!(!StorageRoots::for_host(&host("qemu+tcp://kvm-1/system", None), &info).resolves_links());
    }

    /// A resolver that knows the real paths in `links` (path → real path);
    /// every other path is unseen.
    fn resolver(links: &[(&str, &str)]) -> impl Fn(&Path) -> Resolution {
        let links: HashMap<PathBuf, PathBuf> =
            links.iter().map(|(a, b)| (PathBuf::from(a), PathBuf::from(b))).collect();
        move |path| links.get(path).map_or(Resolution::Unseen, |real| Resolution::Real(real.clone()))
    }

    #[test]
    fn a_link_inside_a_root_that_points_out_of_it_is_refused() {
        let roots = configured(&[IMAGES]);
        let spec = with_image("/var/lib/libvirt/images/innocent.qcow2");
        let refused = roots.check(&spec, &[], resolver(&[("/var/lib/libvirt/images/innocent.qcow2", "/etc/shadow")]));
        assert_eq!(refused.unwrap_err().why, NotAllowed::ResolvesOutside { real: "/etc/shadow".into() });
    }

    #[test]
    fn a_root_that_is_itself_a_link_allows_the_files_it_leads_to() {
        let roots = configured(&[IMAGES]);
        let spec = with_image("/var/lib/libvirt/images/web.qcow2");
        let links =
            resolver(&[(IMAGES, "/srv/images"), ("/var/lib/libvirt/images/web.qcow2", "/srv/images/web.qcow2")]);
        assert_eq!(roots.check(&spec, &[], links), Ok(()));
    }

    #[test]
    fn a_path_that_exists_but_cannot_be_resolved_is_refused() {
        let roots = configured(&[IMAGES]);
        let spec = with_image("/var/lib/libvirt/images/loop.qcow2");
        let refused = roots.check(&spec, &[], |_| Resolution::Unresolvable("too many levels of symbolic links".into()));
        assert!(matches!(refused.unwrap_err().why, NotAllowed::Unresolvable { .. }));
    }

    #[tokio::test]
    async fn on_this_machines_file_system_links_out_of_a_root_are_refused_and_links_within_are_followed() {
        let dir = tempfile::tempdir().unwrap();
        let real_root = dir.path().join("real-images");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&real_root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(real_root.join("web.qcow2"), b"disk").unwrap();
        std::fs::write(outside.join("secret"), b"secret").unwrap();
        // The configured root is a link to the real directory.
        let root = dir.path().join("images");
        std::os::unix::fs::symlink(&real_root, &root).unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), real_root.join("escape.qcow2")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("gone"), real_root.join("dangling.qcow2")).unwrap();
        let root_str = root.display().to_string();
        let roots = StorageRoots::for_host(&host("qemu:///system", Some(&[root_str.as_str()])), &info(&[]));
        let image = |name: &str| with_image(&root.join(name).display().to_string());

        assert_eq!(roots.check_on_host(&image("web.qcow2"), &[]).await, Ok(()));
        assert_eq!(roots.check_on_host(&image("not-yet-there.qcow2"), &[]).await, Ok(()), "a missing file: by path");
        let escape = roots.check_on_host(&image("escape.qcow2"), &[]).await.unwrap_err();
        let real_secret = outside.join("secret").canonicalize().unwrap().display().to_string();
        assert_eq!(escape.why, NotAllowed::ResolvesOutside { real: real_secret });
        let dangling = roots.check_on_host(&image("dangling.qcow2"), &[]).await.unwrap_err();
        assert!(matches!(dangling.why, NotAllowed::Unresolvable { .. }), "{dangling}");
        // The real directory is not a root: only the configured path is.
        let by_real_path = with_image(&real_root.join("web.qcow2").display().to_string());
        assert_eq!(roots.check_on_host(&by_real_path, &[]).await.unwrap_err().why, NotAllowed::OutsideRoots);
        // The same link on a host vmlet does not share a file system with is
        // checked by path alone: roots there must hold no links out of them.
        let remote = StorageRoots::for_host(&host("qemu+ssh://kvm-1/system", Some(&[root_str.as_str()])), &info(&[]));
        assert_eq!(remote.check_on_host(&image("escape.qcow2"), &[]).await, Ok(()));
    }

    fn host_image(name: &str, path: &str) -> VmDisk {
        serde_json::from_value(serde_json::json!({"name": name, "hostImage": {"path": path}})).unwrap()
    }

    fn claim(name: &str) -> VmDisk {
        serde_json::from_value(serde_json::json!({"name": name, "persistentVolumeClaim": {"claimName": name}})).unwrap()
    }

    #[test]
    fn host_images_are_checked_like_the_image_and_named_by_their_disk() {
        let roots = configured(&[IMAGES]);
        let inside = [claim("db"), host_image("data", "/var/lib/libvirt/images/web-data.qcow2")];
        assert_eq!(roots.check(&vm(), &inside, |_| Resolution::Unseen), Ok(()));
        let disks = [host_image("data", "/var/lib/libvirt/images/web-data.qcow2"), host_image("logs", "/etc/passwd")];
        let refused = roots.check(&vm(), &disks, |_| Resolution::Unseen).unwrap_err();
        assert_eq!(refused.field, StorageField::HostImage { disk: "logs".into() });
        assert_eq!(refused.why, NotAllowed::OutsideRoots);
        assert!(
            refused.to_string().starts_with(
                "spec.disks[logs].hostImage.path \"/etc/passwd\" is not under a storage root; host host-a allows \
                 files only under its storage roots [/var/lib/libvirt/images]"
            ),
            "{refused}"
        );
        for path in ["/var/lib/libvirt/images/../../../etc/shadow", "images/web-data.qcow2"] {
            assert!(roots.check(&vm(), &[host_image("data", path)], |_| Resolution::Unseen).is_err(), "{path}");
        }
    }

    #[test]
    fn a_claims_disk_is_no_host_file_of_the_vm() {
        // Its image is checked where the claim is resolved, once its
        // volume's directory is known.
        assert_eq!(configured(&[]).check(&vm(), &[claim("db")], |_| Resolution::Unseen), Ok(()));
    }

    #[tokio::test]
    async fn a_host_image_or_a_backing_file_that_leads_out_of_the_roots_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("images");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("data.qcow2"), b"image").unwrap();
        std::fs::write(root.join("base.raw"), b"base").unwrap();
        std::fs::write(dir.path().join("secret"), b"secret").unwrap();
        std::os::unix::fs::symlink(dir.path().join("secret"), root.join("innocent.raw")).unwrap();
        let root_str = root.display().to_string();
        let roots = StorageRoots::for_host(&host("qemu:///system", Some(&[root_str.as_str()])), &info(&[]));
        let under = |name: &str| root.join(name).display().to_string();

        let escape = [host_image("data", &under("innocent.raw"))];
        let refused = roots.check_on_host(&vm(), &escape).await.unwrap_err();
        assert_eq!(refused.field, StorageField::HostImage { disk: "data".into() });
        assert!(matches!(refused.why, NotAllowed::ResolvesOutside { .. }), "{refused}");

        let field = StorageField::HostImage { disk: "data".into() };
        let image = under("data.qcow2");
        assert_eq!(roots.check_backing_on_host(&field, &image, &under("base.raw")).await, Ok(()));
        let refused = roots.check_backing_on_host(&field, &image, "/etc/passwd").await.unwrap_err();
        assert_eq!((refused.field.clone(), refused.path.as_str()), (field.clone(), image.as_str()));
        let message = refused.to_string();
        assert!(
            message.starts_with(&format!(
                "spec.disks[data].hostImage.path {image:?} names the backing file \"/etc/passwd\", which is not \
                 under a storage root;"
            )),
            "{message}"
        );
        let linked = roots.check_backing_on_host(&field, &image, &under("innocent.raw")).await.unwrap_err();
        let NotAllowed::Backing(backing) = linked.why else { panic!("{linked}") };
        assert!(matches!(backing.why, NotAllowed::ResolvesOutside { .. }), "{}", backing.why);
        for name in ["json:{\"driver\": \"file\", \"filename\": \"/etc/passwd\"}", "nbd://10.0.0.1/x", "base.raw"] {
            let refused = roots.check_backing_on_host(&field, &image, name).await.unwrap_err();
            assert!(matches!(&refused.why, NotAllowed::Backing(b) if b.why == NotAllowed::Relative), "{name}");
        }
    }

    #[test]
    fn roots_must_be_absolute_without_parent_components_or_control_characters() {
        assert_eq!(check_root("/var/lib/libvirt/images"), Ok(()));
        assert_eq!(check_root("/"), Ok(()));
        for bad in ["", "images", "./images", "/var/lib/../../etc", "/var/lib/images\n"] {
            assert!(check_root(bad).is_err(), "{bad:?}");
        }
    }
}
