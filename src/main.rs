//! The `vmlet` binary: `vmlet run --config FILE` serves the configured hypervisor
//! hosts as virtual nodes; `vmlet bootstrap` gives a host its certificates;
//! `vmlet crd` prints its CRDs.
//!
//! This is the only place that names backends: it turns a host's `provider` field
//! into a [`Provider`].

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use kube::CustomResourceExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};
use vmlet::config::{Config, HostConfig};
use vmlet::v1alpha1::{
    VirtualMachine, VirtualMachineBackup, VirtualMachineImage, VirtualMachineRestore, VirtualMachineSnapshot,
};
use vmlet_provider::Provider;

mod cloud_hosts;
mod vcenter_hosts;

/// Backends this binary is built with: `hosts[]` are libvirt hosts, `clouds[]`
/// OpenStack clouds (`vcenters[]`, vSphere, have a section and no provider
/// field of their own).
const PROVIDERS: &[&str] = &["libvirt", "openstack"];

/// Exit code for a bad command line or configuration (sysexits EX_USAGE).
const EX_USAGE: u8 = 64;

#[derive(Parser)]
#[command(name = "vmlet", version, about = "Run IaaS virtual machines from Kubernetes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the configured hosts as virtual nodes (and take part in the
    /// election of the process that runs the VirtualMachine controller unless
    /// the config says `controller: false`). Exits 1 without writing anything
    /// when another live vmlet serves a node of the config.
    Run {
        /// The configuration file (YAML); see deploy/config.example.yaml.
        #[arg(long, short, env = "VMLET_CONFIG")]
        config: PathBuf,
        /// Grace period for a clean shutdown, in seconds.
        #[arg(long, default_value_t = 10)]
        shutdown_grace_seconds: u64,
    },
    /// Give this host its own identity through CertificateSigningRequests:
    /// a client certificate (CN system:vmlet:<host>) and with --serving the
    /// kubelet API's serving certificate; renews them with a third of their
    /// lifetime left. See README "Install on a host".
    Bootstrap(vmlet::bootstrap::Args),
    /// Print vmlet's CustomResourceDefinitions (VirtualMachine,
    /// VirtualMachineBackup, VirtualMachineRestore, VirtualMachineSnapshot) as
    /// one multi-document YAML.
    Crd,
}

/// Every CRD vmlet serves, as YAML documents separated by `---`.
fn crds_yaml() -> Result<String, serde_yaml::Error> {
    let crds = [
        VirtualMachine::crd(),
        VirtualMachineBackup::crd(),
        VirtualMachineRestore::crd(),
        VirtualMachineSnapshot::crd(),
        VirtualMachineImage::crd(),
    ];
    let documents: Result<Vec<String>, _> = crds.iter().map(serde_yaml::to_string).collect();
    Ok(documents?.join("---\n"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => match crds_yaml() {
            Ok(yaml) => {
                print!("{yaml}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("vmlet crd: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Bootstrap(args) => {
            init_tracing();
            let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
            match runtime.block_on(vmlet::bootstrap::run(&args)) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    error!("vmlet bootstrap: {e}");
                    eprintln!("vmlet bootstrap: {e}");
                    ExitCode::from(e.exit_code())
                }
            }
        }
        Command::Run { config, shutdown_grace_seconds } => {
            init_tracing();
            let config = match Config::from_file(&config, PROVIDERS) {
                Ok(config) => config,
                Err(e) => {
                    eprintln!("vmlet: bad configuration: {e}");
                    return ExitCode::from(EX_USAGE);
                }
            };
            let runtime = agent_runtime();
            match runtime.block_on(run(config, Duration::from_secs(shutdown_grace_seconds))) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    error!("{e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// The runtime of `vmlet run`: tokio's defaults, but an idle blocking-pool
/// thread exits after [`BLOCKING_THREAD_KEEP_ALIVE`] rather than 10 s.
///
/// Every libvirt call runs on the blocking pool. tokio hands each new call to
/// an idle thread in turn, so with calls from 500 hosts arriving more often
/// than once per 10 s per thread, none of the 512 threads a burst (the VMs'
/// defines) had started ever idled long enough to exit: 493 threads stayed
/// at 500 hosts, each with its stack and its allocator caches. With 1 s, 10
/// stayed, RSS fell from 167 to 153 MiB (1,000 VMs), and the idle CPU was the
/// same (5.5 against 5.6% of a core).
fn agent_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_keep_alive(BLOCKING_THREAD_KEEP_ALIVE)
        .build()
        .expect("tokio runtime")
}

/// How long an idle thread of the blocking pool waits for work before it
/// exits (tokio's default: 10 s); see [`agent_runtime`].
const BLOCKING_THREAD_KEEP_ALIVE: Duration = Duration::from_secs(1);

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("VMLET_LOG").unwrap_or_else(|_| EnvFilter::new("info,kube=warn"));
    let json = std::env::var("VMLET_LOG_FORMAT").is_ok_and(|f| f == "json");
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

async fn connect(host: &HostConfig) -> anyhow::Result<Arc<dyn Provider>> {
    match host.provider.as_str() {
        "openstack" => anyhow::bail!(
            "host {}: OpenStack compute hosts are found through clouds[] (provider: openstack), not listed in hosts[]",
            host.name
        ),
        "vsphere" => {
            anyhow::bail!("host {}: ESXi hosts are found through vcenters[], not listed in hosts[]", host.name)
        }
        "libvirt" => {
            use vmlet::config::AcceleratorConfig;
            use vmlet_libvirt::AcceleratorSetting;
            let accelerator = match host.accelerator {
                AcceleratorConfig::Auto => AcceleratorSetting::Auto,
                AcceleratorConfig::Kvm => AcceleratorSetting::Kvm,
                AcceleratorConfig::Tcg => AcceleratorSetting::Tcg,
            };
            let mut provider = vmlet_libvirt::LibvirtProvider::connect_with(&host.uri, accelerator)
                .await
                .with_context(|| format!("host {}: connecting to {}", host.name, host.uri))?
                .with_host_name(&host.name)
                .with_unsafe_migration(host.allow_unsafe_migration);
            if let Some(uri) = &host.migration_uri {
                provider = provider.with_migration_uri(uri);
            }
            provider = provider.with_networks(host.networks.iter().filter_map(offered_network).collect());
            Ok(Arc::new(provider))
        }
        other => anyhow::bail!("host {}: provider {other:?} is not built in", host.name),
    }
}

/// A libvirt host's network from its config (validated: exactly one source).
fn offered_network(network: &vmlet::config::NetworkConfig) -> Option<vmlet_libvirt::OfferedNetwork> {
    use vmlet_libvirt::Attachment;
    let attachment = match (&network.network, &network.bridge, &network.macvtap) {
        (Some(name), None, None) => Attachment::Network(name.clone()),
        (None, Some(bridge), None) => Attachment::Bridge(bridge.clone()),
        (None, None, Some(device)) => Attachment::Macvtap(device.clone()),
        _ => return None,
    };
    Some(vmlet_libvirt::OfferedNetwork {
        name: network.name.clone(),
        attachment,
        namespaces: network.namespaces.clone(),
    })
}

async fn run(config: Config, grace: Duration) -> anyhow::Result<()> {
    let kube_config = kube::Config::infer()
        .await
        .context("reading the Kubernetes client configuration (KUBECONFIG or in-cluster)")?;
    let client = vmlet::api_client::client(kube_config)
        .context("connecting to the Kubernetes API server (KUBECONFIG or in-cluster)")?;
    let shutdown = CancellationToken::new();
    // The compute hosts of the configured clouds join the hosts as nodes.
    let mut config = config;
    let mut providers = Vec::new();
    for host in &config.hosts {
        providers.push(connect(host).await?);
    }
    let discovered = tokio::select! {
        found = async {
            let clouds = cloud_hosts::discover(&client, &config.clouds, &shutdown).await?;
            let vcenters = vcenter_hosts::discover(&client, &config.vcenters, &shutdown).await?;
            anyhow::Ok(clouds.zip(vcenters).map(|(mut clouds, vcenters)| {
                clouds.extend(vcenters);
                clouds
            }))
        } => found?,
        _ = wait_for_signal() => None,
    };
    let Some(discovered) = discovered else {
        info!("shut down before the clouds' compute hosts and the vCenters' ESXi hosts were found");
        return Ok(());
    };
    for (host, provider) in discovered {
        if config.hosts.iter().any(|h| h.name == host.name) {
            anyhow::bail!(
                "node name {} is used twice (hosts[], a cloud's compute host or a vCenter's ESXi host); set \
                 clouds[].nodeNamePrefix or vcenters[].nodeNamePrefix",
                host.name
            );
        }
        config.hosts.push(host);
        providers.push(provider);
    }
    // Before anything is written: no node of this config may be served by
    // another live process (vmlet::node::lease).
    let node_leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(client.clone(), vmlet::node::lease::NAMESPACE);
    let nodes: Vec<String> = config.hosts.iter().map(|h| h.name.clone()).collect();
    vmlet::node::lease::check_free(&node_leases, &nodes, &config.identity)
        .await
        .context("refusing to start: the host sets of two vmlet processes must not overlap")?;
    let config = Arc::new(config);
    let mut tasks = tokio::task::JoinSet::new();

    // One pod watch and one VirtualMachine watch for the whole process,
    // shared by the controller, the release loop, every host agent and the
    // kubelet API (vmlet::watches).
    let (watches, writers) = vmlet::watches::Watches::new(&config);
    let release_triggers = watches.vm_triggers();
    watches.start(writers, &client, &config, shutdown.child_token());

    let hosts = vmlet::node::Hosts::default();
    for (host, provider) in config.hosts.iter().zip(providers) {
        tasks.spawn(vmlet::node::run(
            client.clone(),
            config.clone(),
            host.clone(),
            provider,
            hosts.clone(),
            watches.clone(),
            shutdown.child_token(),
        ));
    }
    if !config.hosts.is_empty() {
        // Volumes and deleted VMs are handled by the processes that serve
        // hosts; one that runs only the controllers has neither.
        tasks.spawn(vmlet::node::provisioner::run(
            client.clone(),
            config.namespace.clone(),
            hosts.clone(),
            shutdown.child_token(),
        ));
        tasks.spawn(vmlet::node::release::run(
            client.clone(),
            hosts.clone(),
            watches.clone(),
            release_triggers,
            config.state_dir.clone(),
            shutdown.child_token(),
        ));
    }
    let api = config.kubelet_api.clone().resolve(
        config.node_ip,
        config.kubelet_port,
        &config.hosts.iter().map(|h| h.name.clone()).collect::<Vec<_>>(),
    );
    let directory =
        Arc::new(vmlet::node::directory::Directory::new(hosts.clone(), watches.clone(), config.state_dir.clone()));
    // One listener per node (node i on kubeletPort + i, as its Node says),
    // so that each answers for its own host: /stats/summary per node.
    let servers = vmlet::api::Server::bind_per_node(api, &nodes, directory, client.clone())
        .await
        .context("starting the kubelet API")?;
    for (node, server) in servers {
        info!(node.name = node.as_deref().unwrap_or("-"), listen = %server.local_addr(), "kubelet API listening");
        tasks.spawn(server.run(shutdown.child_token()));
    }
    if config.controller {
        // Every process may run the controllers; the elected one does.
        let settings = vmlet::election::Settings::from_config(&config);
        let (leader_client, leader_config, leader_watches) = (client.clone(), config.clone(), watches.clone());
        let lead = move |term: CancellationToken| {
            run_controllers(leader_client.clone(), leader_config.clone(), leader_watches.clone(), term)
        };
        tasks.spawn(vmlet::election::run(client.clone(), settings, shutdown.child_token(), lead));
    }
    // What a burst of creates, deletes or host starts freed goes back to the
    // system within a period (vmlet::heap).
    tasks.spawn(vmlet::heap::trim_every(vmlet::heap::TRIM_PERIOD, shutdown.child_token()));
    info!(hosts = config.hosts.len(), controller = config.controller, identity = %config.identity, "vmlet running");

    wait_for_signal().await;
    info!("shutting down; VMs keep running");
    shutdown.cancel();
    if tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} }).await.is_err() {
        warn!(grace_seconds = grace.as_secs(), "shutdown grace period passed; exiting");
    }
    Ok(())
}

/// The controllers of the elected leader, until `term` is cancelled (the
/// process stepped down or shuts down): VirtualMachines, their Service
/// endpoints, backups, restores and snapshots. Each starts from every
/// VirtualMachine in the shared cache, as after a restart.
async fn run_controllers(
    client: kube::Client,
    config: Arc<Config>,
    watches: vmlet::watches::Watches,
    term: CancellationToken,
) {
    let mut controllers = tokio::task::JoinSet::new();
    controllers.spawn(vmlet::controller::endpoints::run(
        client.clone(),
        config.namespace.clone(),
        watches.clone(),
        watches.vm_triggers_from_now(),
        term.child_token(),
    ));
    let scope = config.scope().to_owned();
    controllers.spawn(vmlet::controller::backups::run(
        client.clone(),
        config.namespace.clone(),
        scope.clone(),
        term.child_token(),
    ));
    controllers.spawn(vmlet::controller::restores::run(
        client.clone(),
        config.namespace.clone(),
        scope.clone(),
        term.child_token(),
    ));
    controllers.spawn(vmlet::controller::snapshots::run(
        client.clone(),
        config.namespace.clone(),
        scope,
        term.child_token(),
    ));
    controllers.spawn(vmlet::controller::run(
        client,
        config.namespace.clone(),
        watches.clone(),
        watches.vm_triggers_from_now(),
        term.child_token(),
    ));
    while controllers.join_next().await.is_some() {}
}

async fn wait_for_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
