//! Content library items as `spec.image`: an item of
//! `vcenters[].libraryItems` is deployed once per datacenter as a template
//! named [`library_template_name`], which VMs are then cloned from like any
//! template (linked clones, the UID in the clone spec, placement). Cloning
//! from a template keeps the UID atomic with the VM's making: a deploy
//! gives a VM without it.

use super::*;
use crate::library::{deploy_library_item, find_library_item, mark_as_template, LibraryDeploy};

/// The name of the template deployed from `entry` (`<library>/<item>`):
/// `vmlet-library_<library>_<item>`.
pub fn library_template_name(entry: &str) -> String {
    format!("vmlet-library_{}", entry.replacen('/', "_", 1))
}

impl VsphereProvider {
    /// The template deployed from the library item `entry` (one of
    /// `vcenters[].libraryItems`, `<library>/<item>`) in this host's
    /// datacenter, deployed now when there is none: onto this host, in the
    /// configured folder (default the datacenter's root VM folder `vm`),
    /// pool and datastore (default the library's), then marked a template.
    /// Returns its name.
    ///
    /// Errors: `InvalidInput` naming `spec.image` when the library or item
    /// does not exist, `Unsupported` when the item is not a VM template
    /// (`ovf`); `Permanent` when the name is over 80 characters, taken by
    /// a VM that is not a template, or a configured folder, pool or
    /// datastore is missing; those of the calls.
    pub(super) async fn library_template(&self, entry: &str) -> Result<String> {
        const OP: &str = "define VM";
        let name = library_template_name(entry);
        let host = self.resolved(OP).await?;
        let session = self.session(OP).await?;
        let datacenter = self.vcenter.options.datacenter.as_deref().unwrap_or(&host.datacenter);
        if self.has_template(session, datacenter, &name).await? {
            return Ok(name);
        }
        let _one_deploy = self.vcenter.library_deploys.lock().await;
        if self.has_template(session, datacenter, &name).await? {
            return Ok(name);
        }
        if name.chars().count() > MAX_VM_NAME_CHARS {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Permanent,
                format!(
                    "vcenters[].libraryItems {entry:?}: the deployed template's name {name:?} is longer than \
                     vSphere's {MAX_VM_NAME_CHARS} characters; use shorter library and item names"
                ),
            ));
        }
        let (library, item) = entry.split_once('/').unwrap_or((entry, ""));
        let found = find_library_item(session, library, item).await.map_err(provider_error(OP))?.ok_or_else(|| {
            ProviderError::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "spec.image: vCenter {} has no content library {library:?} with an item {item:?}",
                    self.vcenter.name
                ),
            )
        })?;
        if found.kind != "vm-template" {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Unsupported,
                format!(
                    "spec.image: library item {entry:?} is of type {:?}; vmlet deploys VM template items \
                     (vm-template) only",
                    found.kind
                ),
            ));
        }
        let place = self.library_placement(session, host, datacenter).await?;
        let deploy = LibraryDeploy {
            name: &name,
            folder: &place.folder,
            pool: &place.pool,
            host: &host.moref,
            datastore: place.datastore.as_ref(),
        };
        tracing::info!(library.item = %entry, template = %name, "deploying the content library item as a template");
        let deadline = self.vcenter.options.clone_timeout;
        let vm = deploy_library_item(session, &found, &deploy, deadline).await.map_err(provider_error(OP))?;
        let templates = list_templates(session).await.map_err(provider_error(OP))?;
        if !templates.iter().any(|t| t.moref == vm) {
            mark_as_template(session, &vm).await.map_err(provider_error(OP))?;
        }
        Ok(name)
    }

    /// Whether `datacenter` has a template named `name`. Errors:
    /// `Permanent` when a VM of that name is not a template (vmlet does
    /// not touch it), or when there are two.
    async fn has_template(&self, session: &Session, datacenter: &str, name: &str) -> Result<bool> {
        const OP: &str = "define VM";
        let named = crate::lifecycle::vms_named(session, name).await.map_err(provider_error(OP))?;
        let here: Vec<bool> = named.iter().filter(|(vm, _)| vm.datacenter == datacenter).map(|(_, t)| *t).collect();
        match here.as_slice() {
            [] => Ok(false),
            [true] => Ok(true),
            [false] => Err(ProviderError::new(
                OP,
                ErrorKind::Permanent,
                format!(
                    "a VM named {name} exists in datacenter {datacenter} and is not a template (a deploy cut off \
                     before it was marked one?); mark it a template or remove it in vSphere"
                ),
            )),
            _ => Err(ProviderError::new(
                OP,
                ErrorKind::Permanent,
                format!("datacenter {datacenter} has {} VMs named {name}; remove all but one", here.len()),
            )),
        }
    }

    /// The folder, pool and datastore of a library deploy onto `host`.
    async fn library_placement(&self, session: &Session, host: &Host, datacenter: &str) -> Result<LibraryPlace> {
        const OP: &str = "define VM";
        let options = &self.vcenter.options;
        let config_error = |field: &str, why: String| self.config_error(field, why);
        let inventory = read_datacenter(session, datacenter).await.map_err(provider_error(OP))?;
        let folder = inventory
            .vm_folder(options.folder.as_deref().unwrap_or("vm"))
            .map_err(|why| config_error("folder", why))?
            .clone();
        let pool = self.pool_of(&inventory, host)?;
        let datastore = match &options.datastore {
            Some(name) => Some(inventory.datastore(name).map_err(|why| config_error("datastore", why))?.clone()),
            None => None,
        };
        Ok(LibraryPlace { folder, pool, datastore })
    }
}

/// Where a library item is deployed ([`VsphereProvider::library_placement`]).
struct LibraryPlace {
    folder: crate::MoRef,
    pool: crate::MoRef,
    datastore: Option<crate::MoRef>,
}
