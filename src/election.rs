//! The controllers' leader. Every vmlet process may run the controllers
//! (VirtualMachine, backups, restores, snapshots, Service endpoints); exactly
//! one does at a time: the holder of one `coordination.k8s.io/v1` Lease
//! (`leaderElection` in the config, [`crate::config::LeaderElectionConfig`]),
//! locked and renewed through the `kube-lease-manager` crate. The node agents
//! never wait for it: VMs keep running as they are while no process leads.
//!
//! # Expected flow
//! [`run`] joins the election (creating the Lease if it is missing) and
//! campaigns. When it wins it calls `lead` with a token of its own and sets
//! `vmlet_controller_leader` to 1; while it leads the crate renews the Lease
//! every [`Timing::renew_every`] (5 s of 15). It watches the Lease all along:
//! a follower that sees the Lease released or deleted joins again at once,
//! so it takes over without waiting for the old hold to expire; otherwise the
//! crate takes an expired Lease over when it expires. At shutdown the leader
//! stops its controllers first and then releases the Lease (holder cleared).
//!
//! # Guarantees
//! - A leader that has not seen one of its renewals reach the API server for
//!   [`Timing::step_down_after`] (10 s of 15) stops its controllers, before
//!   the Lease can expire and another process take over.
//! - A leader that sees the Lease held by another live process, deleted, or
//!   cleared after it held it, stops its controllers before it campaigns
//!   again.
//! - A deleted Lease is created again by whichever process joins first.
//!
//! # Assumptions
//! Renewal times are written with the leader's clock and compared with the
//! follower's: the clocks of the machines differ by less than
//! `lease duration - renew interval` (10 s of 15), as for the kubelet's.
//!
//! # Caveats
//! Stepping down cancels the controllers' token and waits for them up to one
//! lease duration (2 s at shutdown); a controller that does not stop by then
//! is aborted. The release at shutdown gets 5 s; if it fails, the Lease
//! expires on its own and a follower takes over within one lease duration.

use crate::config::Config;
use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use kube_lease_manager::{LeaseCreateMode, LeaseManager, LeaseManagerBuilder, LeaseManagerError, LeaseParams};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// An election that cannot go on: it is logged and joined again (see [`run`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading (or creating) the election Lease failed.
    #[error("joining the election through Lease {namespace}/{name}: {source}")]
    Join {
        /// The Lease's namespace.
        namespace: String,
        /// The Lease's name.
        name: String,
        /// The crate's error (an API error, mostly).
        #[source]
        source: LeaseManagerError,
    },
    /// Locking or renewing the Lease failed.
    #[error("campaigning for Lease {namespace}/{name}: {source}")]
    Campaign {
        /// The Lease's namespace.
        namespace: String,
        /// The Lease's name.
        name: String,
        /// The crate's error.
        #[source]
        source: LeaseManagerError,
    },
    /// Releasing the Lease at shutdown failed (it then expires on its own).
    #[error("releasing Lease {namespace}/{name}: {source}")]
    Release {
        /// The Lease's namespace.
        namespace: String,
        /// The Lease's name.
        name: String,
        /// The crate's error.
        #[source]
        source: LeaseManagerError,
    },
}

/// The rhythm of an election, all derived from the lease duration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How long the Lease holds without renewal (`leaseDurationSeconds`).
    pub lease_duration: Duration,
    /// How often the leader renews: a third of the duration, whole seconds,
    /// at least 1 s (5 s of 15).
    pub renew_every: Duration,
    /// How long a leader goes on without a renewal it saw reach the API
    /// server before it steps down: two thirds of the duration (10 s of 15).
    pub step_down_after: Duration,
}

impl Timing {
    /// The timing of a Lease of `seconds` (validated: 5 to 300).
    pub fn for_lease_seconds(seconds: u32) -> Timing {
        let seconds = u64::from(seconds.max(2));
        Timing {
            lease_duration: Duration::from_secs(seconds),
            renew_every: Duration::from_secs((seconds / 3).max(1)),
            step_down_after: Duration::from_millis(seconds * 2000 / 3),
        }
    }

    /// The crate's grace: it renews this long before the hold would expire,
    /// in whole seconds (10 of 15).
    fn grace_seconds(&self) -> u64 {
        self.lease_duration.as_secs() - self.renew_every.as_secs()
    }
}

/// Where and as whom this process campaigns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub lease_name: String,
    /// This process's identity ([`Config::identity`]), the Lease's holder
    /// while it leads.
    pub identity: String,
    /// Durations.
    pub timing: Timing,
}

impl Settings {
    /// The election of `config` (`identity`, `leaderElection`).
    pub fn from_config(config: &Config) -> Settings {
        let election = &config.leader_election;
        Settings {
            namespace: election.namespace.clone(),
            lease_name: election.lease_name.clone(),
            identity: config.identity.clone(),
            timing: Timing::for_lease_seconds(election.lease_duration_seconds),
        }
    }
}

/// What one state of the watched Lease says to this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// This process holds it; `renewed` is its last renewal (the Lease's
    /// `renewTime`, written with this process's clock).
    Ours {
        /// `spec.renewTime`, if set.
        renewed: Option<SystemTime>,
    },
    /// Another process holds it.
    Theirs {
        /// `spec.holderIdentity`.
        holder: String,
        /// Whether its hold had not expired (renewTime + duration) when seen.
        live: bool,
    },
    /// Nobody holds it (released, or never locked).
    Free,
    /// There is no Lease (deleted, or not created yet).
    Gone,
}

impl Seen {
    /// Read `lease` (`None`: it does not exist) as `identity` at `now`.
    pub fn of(lease: Option<&Lease>, identity: &str, now: SystemTime) -> Seen {
        let Some(lease) = lease else { return Seen::Gone };
        let Some(spec) = lease.spec.as_ref() else { return Seen::Free };
        let renewed = spec.renew_time.as_ref().map(|t| SystemTime::from(t.0));
        match spec.holder_identity.as_deref() {
            None | Some("") => Seen::Free,
            Some(holder) if holder == identity => Seen::Ours { renewed },
            Some(holder) => {
                let duration = spec.lease_duration_seconds.map(|s| Duration::from_secs(s.max(0) as u64));
                let live = match (renewed, duration) {
                    (Some(renewed), Some(duration)) => renewed + duration > now,
                    _ => false,
                };
                Seen::Theirs { holder: holder.to_owned(), live }
            }
        }
    }
}

/// What to do about a change of the watched Lease ([`react`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaction {
    /// Nothing: the campaign goes on as it is.
    Keep,
    /// Join the election again now (a follower that sees the Lease freed or
    /// deleted, rather than waiting for the old hold to expire).
    Rejoin,
    /// Stop the controllers, then join again.
    StepDown,
}

/// The reaction of a process that `leading` (or not) sees the Lease go from
/// `before` (the previous state the watch showed, `None` at first) to `now`.
///
/// A leader steps down when another live process holds the Lease, when it is
/// deleted, and when it is cleared after the watch showed it held by this
/// process; an expired hold of another, or "free" before the watch showed
/// this process's own hold, are older news than the campaign's own result.
/// A follower joins again when the Lease is released or deleted after the
/// watch showed it there.
pub fn react(leading: bool, before: Option<&Seen>, now: &Seen) -> Reaction {
    match (leading, now) {
        (true, Seen::Ours { .. }) => Reaction::Keep,
        (true, Seen::Theirs { live, .. }) => {
            if *live {
                Reaction::StepDown
            } else {
                Reaction::Keep
            }
        }
        (true, Seen::Gone) => Reaction::StepDown,
        (true, Seen::Free) => {
            if matches!(before, Some(Seen::Ours { .. })) {
                Reaction::StepDown
            } else {
                Reaction::Keep
            }
        }
        (false, Seen::Free) => {
            if matches!(before, Some(Seen::Theirs { .. } | Seen::Ours { .. })) {
                Reaction::Rejoin
            } else {
                Reaction::Keep
            }
        }
        (false, Seen::Gone) => match before {
            Some(Seen::Gone) | None => Reaction::Keep,
            Some(_) => Reaction::Rejoin,
        },
        (false, Seen::Ours { .. } | Seen::Theirs { .. }) => Reaction::Keep,
    }
}

/// Whether a leader whose last renewal that it saw reach the API server was
/// at `last_renewal` must step down at `now` ([`Timing::step_down_after`]).
pub fn must_step_down(last_renewal: SystemTime, now: SystemTime, timing: &Timing) -> bool {
    now.duration_since(last_renewal).is_ok_and(|since| since >= timing.step_down_after)
}

/// What the campaign task reports.
enum Campaigned {
    /// It joined: the manager, kept to release the Lease at shutdown.
    Joined(Arc<LeaseManager>),
    /// Whether this process holds the Lease now (reported on every change).
    Leading(bool),
    /// It failed; it has ended.
    Failed(Error),
}

/// One try at the election: join, then report every change of the hold.
struct Campaign {
    task: JoinHandle<()>,
    events: mpsc::UnboundedReceiver<Campaigned>,
    manager: Option<Arc<LeaseManager>>,
}

impl Campaign {
    fn start(client: Client, settings: Settings) -> Campaign {
        let (tx, events) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let manager = match join(client, &settings).await {
                Ok(manager) => Arc::new(manager),
                Err(e) => {
                    let _ = tx.send(Campaigned::Failed(e));
                    return;
                }
            };
            let _ = tx.send(Campaigned::Joined(manager.clone()));
            loop {
                match manager.changed().await {
                    Ok(leading) => {
                        if tx.send(Campaigned::Leading(leading)).is_err() {
                            return;
                        }
                    }
                    Err(source) => {
                        let _ = tx.send(Campaigned::Failed(Error::Campaign {
                            namespace: settings.namespace.clone(),
                            name: settings.lease_name.clone(),
                            source,
                        }));
                        return;
                    }
                }
            }
        });
        Campaign { task, events, manager: None }
    }

    /// Stop campaigning; wait until the task has let go of the manager.
    async fn stop(self) -> Option<Arc<LeaseManager>> {
        self.task.abort();
        let _ = self.task.await;
        self.manager
    }
}

/// A lease manager for `settings`, the Lease created if missing.
async fn join(client: Client, settings: &Settings) -> Result<LeaseManager, Error> {
    let params = LeaseParams::new(
        settings.identity.clone(),
        settings.timing.lease_duration.as_secs(),
        settings.timing.grace_seconds(),
    );
    LeaseManagerBuilder::new(client, settings.lease_name.clone())
        .with_namespace(settings.namespace.clone())
        .with_parameters(params)
        .with_create_mode(LeaseCreateMode::AutoCreate)
        .build()
        .await
        .map_err(|source| Error::Join {
            namespace: settings.namespace.clone(),
            name: settings.lease_name.clone(),
            source,
        })
}

/// The controllers while this process leads: their token and task.
struct Term {
    token: CancellationToken,
    task: JoinHandle<()>,
    /// The last renewal this process saw reach the API server (or when the
    /// term began).
    last_renewal: SystemTime,
}

/// What the election loop does next.
enum Step {
    Shutdown,
    Campaign(Option<Campaigned>),
    Lease(Option<Box<Result<watcher::Event<Lease>, watcher::Error>>>),
    Unrenewed,
    Rejoin,
}

/// Take part in the election until `shutdown`: while this process leads,
/// `lead(token)` runs (spawned; it must return soon after `token` is
/// cancelled). Errors are logged and the election joined again after a
/// pause (1 s, doubling up to [`Timing::renew_every`]); this never fails.
/// At shutdown a leader stops `lead`, then releases the Lease.
pub async fn run<F, Fut>(client: Client, settings: Settings, shutdown: CancellationToken, mut lead: F)
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let timing = settings.timing;
    let gauge = &crate::metrics::global().controller_leader;
    gauge.set(0);
    info!(
        lease.namespace = %settings.namespace,
        lease.name = %settings.lease_name,
        identity = %settings.identity,
        lease_duration_s = timing.lease_duration.as_secs(),
        "joining the controllers' election"
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), &settings.namespace);
    let mut lease_events = lease_watch(leases, &settings.lease_name);
    let mut campaign = Some(Campaign::start(client.clone(), settings.clone()));
    let mut term: Option<Term> = None;
    let mut seen: Option<Seen> = None;
    // Whether the watch's current list has shown the Lease (a list without it
    // means it is gone).
    let mut listed = false;
    let mut pause = Duration::from_secs(1);
    let mut rejoin_at: Option<tokio::time::Instant> = None;

    loop {
        let step_down_at = term.as_ref().map(|t| t.last_renewal + timing.step_down_after);
        let step = tokio::select! {
            biased;
            _ = shutdown.cancelled() => Step::Shutdown,
            _ = sleep_until_wall(step_down_at), if step_down_at.is_some() => Step::Unrenewed,
            event = async { campaign.as_mut().expect("checked").events.recv().await }, if campaign.is_some() => {
                Step::Campaign(event)
            }
            event = lease_events.next() => Step::Lease(event.map(Box::new)),
            _ = tokio::time::sleep_until(rejoin_at.unwrap_or_else(tokio::time::Instant::now)), if rejoin_at.is_some() => {
                Step::Rejoin
            }
        };
        match step {
            Step::Shutdown => break,
            Step::Unrenewed => {
                if term.as_ref().is_some_and(|t| must_step_down(t.last_renewal, SystemTime::now(), &timing)) {
                    warn!(
                        step_down_after_s = timing.step_down_after.as_secs_f64(),
                        "no renewal of the controllers' Lease reached the API server in time; stepping down"
                    );
                    step_down(&mut term, timing.lease_duration).await;
                    if let Some(old) = campaign.take() {
                        old.stop().await;
                    }
                    rejoin_at = Some(tokio::time::Instant::now() + pause);
                }
            }
            Step::Campaign(Some(Campaigned::Joined(manager))) => {
                debug!("joined the controllers' election");
                if let Some(c) = campaign.as_mut() {
                    c.manager = Some(manager);
                }
            }
            Step::Campaign(Some(Campaigned::Leading(true))) => {
                pause = Duration::from_secs(1);
                if term.is_none() {
                    info!(identity = %settings.identity, "elected: running the controllers");
                    let token = shutdown.child_token();
                    let task = tokio::spawn(lead(token.clone()));
                    term = Some(Term { token, task, last_renewal: SystemTime::now() });
                    gauge.set(1);
                }
            }
            Step::Campaign(Some(Campaigned::Leading(false))) => {
                pause = Duration::from_secs(1);
                if term.is_some() {
                    warn!("the controllers' Lease is no longer this process's; stepping down");
                    step_down(&mut term, timing.lease_duration).await;
                }
            }
            Step::Campaign(Some(Campaigned::Failed(e))) => {
                warn!(error = %e, retry_in_s = pause.as_secs(), "controllers' election: joining again");
                campaign = None;
                rejoin_at = Some(tokio::time::Instant::now() + pause);
                pause = (pause * 2).min(timing.renew_every.max(Duration::from_secs(1)));
            }
            Step::Campaign(None) => {
                campaign = None;
                rejoin_at = Some(tokio::time::Instant::now() + pause);
            }
            Step::Rejoin => {
                rejoin_at = None;
                if let Some(old) = campaign.take() {
                    old.stop().await;
                }
                campaign = Some(Campaign::start(client.clone(), settings.clone()));
            }
            Step::Lease(None) => {
                // The watch stream never ends (it retries with backoff); if it
                // did, start it again.
                lease_events = lease_watch(Api::namespaced(client.clone(), &settings.namespace), &settings.lease_name);
            }
            Step::Lease(Some(result)) => {
                let event = match *result {
                    Ok(event) => event,
                    Err(e) => {
                        debug!(error = %e, "watch of the controllers' Lease failed; retrying");
                        continue;
                    }
                };
                let lease = match event {
                    watcher::Event::Init => {
                        listed = false;
                        continue;
                    }
                    watcher::Event::InitApply(lease) => {
                        listed = true;
                        Some(lease)
                    }
                    watcher::Event::InitDone if listed => continue,
                    watcher::Event::InitDone | watcher::Event::Delete(_) => None,
                    watcher::Event::Apply(lease) => Some(lease),
                };
                let now = Seen::of(lease.as_ref(), &settings.identity, SystemTime::now());
                if let (Some(t), Seen::Ours { renewed: Some(renewed) }) = (term.as_mut(), &now) {
                    t.last_renewal = t.last_renewal.max(*renewed);
                }
                match react(term.is_some(), seen.as_ref(), &now) {
                    Reaction::Keep => {}
                    Reaction::Rejoin => {
                        // Only a campaign that has joined waits on an old
                        // state; one still joining reads the Lease itself.
                        if campaign.as_ref().is_none_or(|c| c.manager.is_some()) {
                            debug!(lease = ?now, "the controllers' Lease was freed or deleted; joining again now");
                            rejoin_at = Some(tokio::time::Instant::now());
                        }
                    }
                    Reaction::StepDown => {
                        warn!(lease = ?now, "the controllers' Lease changed hands; stepping down");
                        step_down(&mut term, timing.lease_duration).await;
                        if let Some(old) = campaign.take() {
                            old.stop().await;
                        }
                        rejoin_at = Some(tokio::time::Instant::now());
                    }
                }
                seen = Some(now);
            }
        }
    }

    // Shutdown: controllers first, then the Lease, so that the next leader
    // never runs beside them; both within the process's shutdown grace
    // (default 10 s): a controller still starting (its watches listing) may
    // not notice its token for longer, and is aborted.
    let was_leading = term.is_some();
    step_down(&mut term, SHUTDOWN_CONTROLLERS_WAIT).await;
    let manager = match campaign.take() {
        Some(c) => c.stop().await,
        None => None,
    };
    // A process that joined may hold the Lease before its loop heard so
    // (the manager locks it, then reports the change): release whenever it
    // joined. The manager releases only a Lease it holds (or an expired one).
    if was_leading || manager.is_some() {
        let released = tokio::time::timeout(RELEASE_WAIT, async {
            let manager = match manager {
                Some(m) => m,
                None => Arc::new(join(client.clone(), &settings).await?),
            };
            manager.release().await.map_err(|source| Error::Release {
                namespace: settings.namespace.clone(),
                name: settings.lease_name.clone(),
                source,
            })
        })
        .await;
        match released {
            Ok(Ok(())) => info!("released the controllers' Lease"),
            Ok(Err(e)) => warn!(error = %e, "could not release the controllers' Lease; it expires on its own"),
            Err(_) => warn!("releasing the controllers' Lease took too long; it expires on its own"),
        }
    }
    info!("left the controllers' election");
}

/// How long a shutting-down leader waits for its controllers to stop before
/// it aborts them.
const SHUTDOWN_CONTROLLERS_WAIT: Duration = Duration::from_secs(2);

/// How long a shutting-down leader tries to release the Lease.
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// Stop the controllers of `term`, if any: cancel, wait up to `wait` (one
/// lease duration when stepping down, [`SHUTDOWN_CONTROLLERS_WAIT`] at
/// shutdown), then abort; the gauge reads 0 afterwards.
async fn step_down(term: &mut Option<Term>, wait: Duration) {
    if let Some(Term { token, mut task, .. }) = term.take() {
        token.cancel();
        if tokio::time::timeout(wait, &mut task).await.is_err() {
            warn!(waited_s = wait.as_secs(), "the controllers did not stop in time; aborting them");
            task.abort();
            let _ = task.await;
        }
        info!("stepped down: the controllers are stopped");
    }
    crate::metrics::global().controller_leader.set(0);
}

/// The watch of the one Lease `name`, retrying with backoff.
fn lease_watch(
    leases: Api<Lease>,
    name: &str,
) -> Pin<Box<dyn Stream<Item = Result<watcher::Event<Lease>, watcher::Error>> + Send>> {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    watcher(leases, config).default_backoff().boxed()
}

/// Sleep until wall-clock time `at` (`None`: forever).
async fn sleep_until_wall(at: Option<SystemTime>) {
    match at {
        Some(at) => tokio::time::sleep(at.duration_since(SystemTime::now()).unwrap_or_default()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn lease(holder: Option<&str>, renewed: SystemTime, seconds: i32) -> Lease {
        Lease {
            metadata: Default::default(),
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_owned),
                renew_time: Some(MicroTime(renewed.try_into().unwrap())),
                lease_duration_seconds: Some(seconds),
                ..LeaseSpec::default()
            }),
        }
    }

    fn ago(seconds: u64) -> SystemTime {
        SystemTime::now() - Duration::from_secs(seconds)
    }

    #[test]
    fn a_fifteen_second_lease_renews_every_five_and_steps_down_after_ten() {
        let timing = Timing::for_lease_seconds(15);
        assert_eq!(timing.lease_duration, Duration::from_secs(15));
        assert_eq!(timing.renew_every, Duration::from_secs(5));
        assert_eq!(timing.step_down_after, Duration::from_secs(10));
        assert_eq!(timing.grace_seconds(), 10);
        let shortest = Timing::for_lease_seconds(5);
        assert_eq!(shortest.renew_every, Duration::from_secs(1));
        assert!(shortest.step_down_after < shortest.lease_duration);
        assert!(shortest.grace_seconds() > 0 && shortest.grace_seconds() < 5);
    }

    #[test]
    fn a_leader_steps_down_once_no_renewal_was_seen_for_two_thirds_of_the_lease() {
        let timing = Timing::for_lease_seconds(15);
        let now = SystemTime::now();
        assert!(!must_step_down(now - Duration::from_secs(9), now, &timing));
        assert!(must_step_down(now - Duration::from_secs(10), now, &timing));
        assert!(!must_step_down(now + Duration::from_secs(1), now, &timing), "a renewal in the future is fresh");
    }

    #[test]
    fn a_lease_reads_as_ours_theirs_free_or_gone() {
        let now = SystemTime::now();
        assert_eq!(Seen::of(None, "me", now), Seen::Gone);
        assert_eq!(Seen::of(Some(&Lease::default()), "me", now), Seen::Free);
        assert_eq!(Seen::of(Some(&lease(None, ago(1), 15)), "me", now), Seen::Free);
        assert!(matches!(Seen::of(Some(&lease(Some("me"), ago(1), 15)), "me", now), Seen::Ours { renewed: Some(_) }));
        assert_eq!(
            Seen::of(Some(&lease(Some("other"), ago(1), 15)), "me", now),
            Seen::Theirs { holder: "other".into(), live: true }
        );
        assert_eq!(
            Seen::of(Some(&lease(Some("other"), ago(16), 15)), "me", now),
            Seen::Theirs { holder: "other".into(), live: false }
        );
    }

    #[test]
    fn a_leader_steps_down_when_another_live_process_holds_the_lease_or_it_is_deleted() {
        let ours = Seen::Ours { renewed: None };
        let theirs = |live| Seen::Theirs { holder: "other".into(), live };
        assert_eq!(react(true, Some(&ours), &ours), Reaction::Keep);
        assert_eq!(react(true, Some(&ours), &theirs(true)), Reaction::StepDown);
        assert_eq!(react(true, Some(&ours), &Seen::Gone), Reaction::StepDown);
        assert_eq!(react(true, Some(&ours), &Seen::Free), Reaction::StepDown, "someone cleared our hold");
    }

    #[test]
    fn a_leader_ignores_news_older_than_its_own_win() {
        let theirs = |live| Seen::Theirs { holder: "dead".into(), live };
        assert_eq!(react(true, None, &theirs(false)), Reaction::Keep, "the expired hold it took over");
        assert_eq!(react(true, Some(&theirs(false)), &Seen::Free), Reaction::Keep, "its own forced release");
        assert_eq!(react(true, Some(&Seen::Gone), &Seen::Free), Reaction::Keep, "the Lease it just created");
    }

    #[test]
    fn a_follower_joins_again_at_once_when_the_lease_is_released_or_deleted() {
        let theirs = Seen::Theirs { holder: "leader".into(), live: true };
        assert_eq!(react(false, Some(&theirs), &Seen::Free), Reaction::Rejoin);
        assert_eq!(react(false, Some(&theirs), &Seen::Gone), Reaction::Rejoin);
        assert_eq!(react(false, Some(&theirs), &theirs), Reaction::Keep, "a renewal");
        assert_eq!(react(false, None, &Seen::Gone), Reaction::Keep, "not created yet: the campaign creates it");
        assert_eq!(react(false, Some(&Seen::Gone), &Seen::Free), Reaction::Keep, "just created");
    }
}
