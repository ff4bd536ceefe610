//! Checking a VM's spec against what the vCenter allows, before anything
//! is cloned: template, datastore, networks, name.

use super::*;

impl VsphereProvider {
    /// `spec` as this slice can make it, or `InvalidInput`/`Unsupported`
    /// naming the field; returns the template name.
    pub(super) fn check_spec<'s>(&self, spec: &'s VmSpec) -> Result<&'s str> {
        const OP: &str = "define VM";
        let invalid = |message: String| ProviderError::new(OP, ErrorKind::InvalidInput, message);
        if let Some(key) = spec.options.keys().find(|k| *k != DATASTORE_OPTION) {
            return Err(invalid(format!(
                "spec.providerOptions.{key}: the vSphere provider reads only providerOptions.{DATASTORE_OPTION}; \
                 remove it"
            )));
        }
        self.datastore_of(spec)?;
        self.networks_of(spec)?;
        if spec.kernel_boot.is_some() {
            return Err(invalid(
                "spec.kernel: vSphere cannot boot a kernel directly; boot from a template (spec.image)".into(),
            ));
        }
        if spec.cloud_init.is_some() {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Unsupported,
                "spec.cloudInit: the vSphere provider does not deliver cloud-init data yet; remove it",
            ));
        }
        if let Some(disk) = spec.disks.first() {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Unsupported,
                format!("spec.disks[{}]: the vSphere provider attaches no data disks yet; remove it", disk.name),
            ));
        }
        let options = &self.vcenter.options;
        let allowed: Vec<&str> = options.templates.iter().chain(&options.library_items).map(String::as_str).collect();
        let template = spec.image.as_deref().filter(|i| !i.is_empty()).ok_or_else(|| {
            invalid(format!("spec.image: name the template to clone, one of [{}]", allowed.join(", ")))
        })?;
        // Besides the configured templates: one a restore from a snapshot
        // made for a VM of this VM's own namespace (`provider/snapshots.rs`);
        // another namespace's is refused like any other name.
        let restored = vmlet_provider::is_restored_image_of(&spec.namespace, template);
        if !restored && !allowed.contains(&template) {
            return Err(invalid(format!(
                "spec.image: template {template:?} is not one this vCenter allows (allowed: [{}]); use one of them, or \
                 ask vmlet's administrator to add it to vcenters[].templates (or, as <library>/<item>, to \
                 vcenters[].libraryItems)",
                allowed.join(", ")
            )));
        }
        let name = spec.backend_name();
        if name.chars().count() > MAX_VM_NAME_CHARS {
            return Err(invalid(format!(
                "metadata.name: the VM's vSphere name {name:?} (<namespace>_<name>) is longer than vSphere's \
                 {MAX_VM_NAME_CHARS} characters; use a shorter name"
            )));
        }
        Ok(template)
    }

    /// The datastore `spec`'s clone goes to: `spec.providerOptions.datastore`
    /// when given (one of `datastore` and `datastores`), else the configured
    /// `datastore`; `None`: the template's. Errors: `InvalidInput` naming
    /// the field and the allowed names.
    pub(super) fn datastore_of<'s>(&'s self, spec: &'s VmSpec) -> Result<Option<&'s str>> {
        let options = &self.vcenter.options;
        let Some(wanted) = spec.options.get(DATASTORE_OPTION) else { return Ok(options.datastore.as_deref()) };
        let allowed: Vec<&str> = options.datastore.iter().chain(&options.datastores).map(String::as_str).collect();
        if allowed.contains(&wanted.as_str()) {
            return Ok(Some(wanted));
        }
        Err(ProviderError::new(
            "define VM",
            ErrorKind::InvalidInput,
            format!(
                "spec.providerOptions.{DATASTORE_OPTION}: datastore {wanted:?} is not one this vCenter allows \
                 (allowed: [{}]); use one of them, or ask vmlet's administrator to add it to vcenters[].datastores",
                allowed.join(", ")
            ),
        ))
    }

    /// The offered network each of `spec.networks` names, in order. Errors:
    /// `InvalidInput` naming `spec.networks[<i>]` and the names offered to
    /// the VM's namespace.
    pub(super) fn networks_of(&self, spec: &VmSpec) -> Result<Vec<&NetworkOffer>> {
        let offers = &self.vcenter.options.networks;
        let offered: Vec<&NetworkOffer> = offers.iter().filter(|o| o.offered_to(&spec.namespace)).collect();
        let names = || offered.iter().map(|o| o.name.as_str()).collect::<Vec<_>>().join(", ");
        let invalid = |message: String| ProviderError::new("define VM", ErrorKind::InvalidInput, message);
        let mut chosen = Vec::new();
        for (i, request) in spec.networks.iter().enumerate() {
            if request.mac.is_some() {
                return Err(invalid(format!(
                    "spec.networks[{i}].macAddress: vSphere gives a clone's network cards their MAC addresses; \
                     remove it"
                )));
            }
            let Some(offer) = offered.iter().find(|o| o.name == request.name) else {
                return Err(invalid(format!(
                    "spec.networks[{i}].name: {:?} is not offered to namespace {} by this vCenter (allowed: [{}]); \
                     use one of them, or ask vmlet's administrator to add it to vcenters[].networks",
                    request.name,
                    spec.namespace,
                    names()
                )));
            };
            chosen.push(*offer);
        }
        Ok(chosen)
    }
}
