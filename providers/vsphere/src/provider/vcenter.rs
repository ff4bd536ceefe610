//! What a vCenter is to vmlet: its options ([`VCenterOptions`], the
//! boundary between tenants) and the shared session ([`VCenter`]).

use super::*;

/// The one provider option the vSphere provider reads: the datastore a
/// clone goes to (`spec.providerOptions.datastore`), one of
/// [`VCenterOptions::datastore`] and [`VCenterOptions::datastores`].
pub const DATASTORE_OPTION: &str = "datastore";

/// vSphere's limit on a VM's name, in characters.
pub const MAX_VM_NAME_CHARS: usize = 80;

/// What vmlet's administrator allows and how long vmlet waits, for one vCenter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VCenterOptions {
    /// The datacenter whose hosts and templates are used; `None`: any
    /// (then a template is looked up in the datacenter of the VM's host).
    pub datacenter: Option<String>,
    /// The template names `spec.image` may name: a security boundary (vmlet's
    /// user may clone any VM of the vCenter; a tenant only these). Empty:
    /// no VM can be defined.
    pub templates: Vec<String>,
    /// The content library items `spec.image` may name besides
    /// `templates`, each `<library>/<item>` (a VM template item,
    /// `vm-template`): a boundary like `templates`. vmlet deploys an item
    /// once per datacenter as the template [`library_template_name`] and
    /// clones that.
    pub library_items: Vec<String>,
    /// The VM folder clones are made in, by name in the datacenter; `None`:
    /// the template's folder.
    pub folder: Option<String>,
    /// The resource pool clones are placed in, by name under the host's
    /// compute resource; `None`: its root pool.
    pub resource_pool: Option<String>,
    /// The datastore clones' files go to, by name; `None`: the template's.
    pub datastore: Option<String>,
    /// Further datastores `spec.providerOptions.datastore` may name (a
    /// security boundary, as `templates`; `datastore` is always allowed).
    pub datastores: Vec<String>,
    /// The networks `spec.networks[].name` may name (a security boundary,
    /// as `templates`). Empty: a VM keeps its template's networks.
    pub networks: Vec<NetworkOffer>,
    /// Deadline of a `CloneVM_Task` (default 10 min).
    pub clone_timeout: Duration,
    /// Deadline of every other task: power on and off, reconfigure,
    /// destroy (default 2 min).
    pub task_timeout: Duration,
}

impl Default for VCenterOptions {
    fn default() -> Self {
        VCenterOptions {
            datacenter: None,
            templates: Vec::new(),
            library_items: Vec::new(),
            folder: None,
            resource_pool: None,
            datastore: None,
            datastores: Vec::new(),
            networks: Vec::new(),
            clone_timeout: Duration::from_secs(600),
            task_timeout: Duration::from_secs(120),
        }
    }
}

/// A vSphere network offered to VMs under a name ([`VCenterOptions::networks`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkOffer {
    /// The name `spec.networks[].name` gives.
    pub name: String,
    /// The vSphere network's (or distributed portgroup's) inventory name.
    pub network: String,
    /// The namespaces whose VMs may join it; `None`: every namespace.
    pub namespaces: Option<Vec<String>>,
}

impl NetworkOffer {
    /// Whether a VM of `namespace` may join it.
    pub fn offered_to(&self, namespace: &str) -> bool {
        self.namespaces.as_ref().is_none_or(|n| n.iter().any(|n| n == namespace))
    }
}

/// One vCenter (or standalone ESXi) shared by the providers of its hosts:
/// its name in vmlet's config, one [`Session`] opened at the first call
/// (and again at the next call after a failed connect, so a vCenter that is
/// down when vmlet starts is NotReady, not fatal), the options, and the
/// push cache of its VMs ([`VCenter::pushed_vms`], followed from the first read).
pub struct VCenter {
    pub(super) name: String,
    pub(super) config: SessionConfig,
    pub(super) session: OnceCell<Session>,
    pub(super) options: VCenterOptions,
    pub(crate) updates: crate::updates::Updates,
    /// Held while a library item is deployed, so that the VMs of one item
    /// wait for one deploy.
    pub(super) library_deploys: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for VCenter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VCenter").field("name", &self.name).field("url", &self.config.url).finish_non_exhaustive()
    }
}

impl VCenter {
    /// A vCenter named `name` (config `vcenters[].name`, used in
    /// [`Provider::backend_host`]) reached with `config`; nothing is
    /// connected yet.
    pub fn new(name: impl Into<String>, config: SessionConfig, options: VCenterOptions) -> VCenter {
        VCenter {
            name: name.into(),
            config,
            session: OnceCell::new(),
            options,
            updates: Default::default(),
            library_deploys: Default::default(),
        }
    }

    /// Its name in vmlet's config.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The options.
    pub fn options(&self) -> &VCenterOptions {
        &self.options
    }

    /// The logged-in session, connecting on the first call.
    ///
    /// Errors: those of [`Session::connect`].
    pub async fn session(&self) -> std::result::Result<&Session, Error> {
        self.session.get_or_try_init(|| Session::connect(self.config.clone())).await
    }

    /// The hosts of the configured datacenter (all hosts without one).
    ///
    /// Errors: those of [`Session::connect`] and [`list_hosts`].
    pub async fn hosts(&self) -> std::result::Result<Vec<Host>, Error> {
        let hosts = list_hosts(self.session().await?).await?;
        Ok(hosts
            .into_iter()
            .filter(|h| self.options.datacenter.as_ref().is_none_or(|dc| *dc == h.datacenter))
            .collect())
    }
}
