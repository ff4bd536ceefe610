//! The cases themselves. Each returns its [`Outcome`]; an `Err(message)`
//! inside a case is a failure.

use crate::{Case, Outcome, Subject};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{sleep, Instant};
use vmlet_provider::{
    ErrorKind, Location, MigrationMode, PowerState, Provider, ResizeScope, Resources, VmId, VmSpec, VmStatus,
};

type Checked<T = Outcome> = Result<T, String>;

const MIB: u64 = 1 << 20;
/// How often a wait reads the VM again.
const POLL: Duration = Duration::from_millis(200);
/// How long a soft stop waits before it asks the guest again.
const RESEND: Duration = Duration::from_secs(5);

pub(crate) async fn run(subject: &Subject, case: Case) -> Outcome {
    let checked = match case {
        Case::Inventory => inventory(subject).await,
        Case::IdempotentDefine => idempotent_define(subject).await,
        Case::StartAndHardStop => start_and_hard_stop(subject).await,
        Case::SoftStop => soft_stop(subject).await,
        Case::AdoptAfterRestart => adopt_after_restart(subject).await,
        Case::Locate => locate(subject).await,
        Case::ResizeLive => resize(subject, ResizeScope::Live).await,
        Case::ResizeNextStart => resize(subject, ResizeScope::NextStart).await,
        Case::MigrateLive => migrate(subject, MigrationMode::Live).await,
        Case::MigrateCold => migrate(subject, MigrationMode::Cold).await,
        Case::ConsoleOutput => console_output(subject).await,
        Case::ErrorKinds => error_kinds(subject).await,
        Case::Undefine => undefine(subject).await,
    };
    checked.unwrap_or_else(Outcome::Failed)
}

fn home(subject: &Subject) -> &Arc<dyn Provider> {
    &subject.hosts[0]
}

/// `what` failed: the error, for a message.
fn failed(what: &str) -> impl Fn(vmlet_provider::Error) -> String + '_ {
    move |e| format!("{what}: {e} (kind {:?})", e.kind)
}

/// Read the VM until `done` holds or the deadline passes.
async fn wait_for(
    subject: &Subject,
    host: &dyn Provider,
    id: &VmId,
    what: &str,
    done: impl Fn(&VmStatus) -> bool,
) -> Checked<VmStatus> {
    let deadline = Instant::now() + subject.deadline;
    loop {
        let status = host.get(id).await.map_err(failed("get"))?;
        match status {
            Some(status) if done(&status) => return Ok(status),
            last if Instant::now() >= deadline => {
                return Err(format!("not {what} within {:?}; last seen {last:?}", subject.deadline))
            }
            _ => sleep(POLL).await,
        }
    }
}

async fn running(subject: &Subject, host: &dyn Provider, id: &VmId) -> Checked<VmStatus> {
    wait_for(subject, host, id, "running", |s| s.power == PowerState::Running).await
}

async fn off(subject: &Subject, host: &dyn Provider, id: &VmId) -> Checked<VmStatus> {
    wait_for(subject, host, id, "off", |s| !s.power.is_active()).await
}

/// Define and start a new VM on `host`; running.
async fn started(subject: &Subject, host: &dyn Provider, spec: &VmSpec) -> Checked<VmStatus> {
    host.ensure_defined(spec).await.map_err(failed("ensure_defined"))?;
    host.start(&spec.id).await.map_err(failed("start"))?;
    running(subject, host, &spec.id).await
}

/// Remove a case's VM from every host, whatever state it is in (best effort:
/// the case's outcome is already decided).
async fn remove(subject: &Subject, id: &VmId) {
    for host in &subject.hosts {
        let _ = host.destroy(id).await;
        let deadline = Instant::now() + subject.deadline;
        while Instant::now() < deadline {
            match host.get(id).await {
                Ok(Some(s)) if s.power.is_active() => sleep(POLL).await,
                _ => break,
            }
        }
        let _ = host.undefine(id).await;
    }
}

/// Run `body` with a fresh spec and remove its VM afterwards.
async fn with_vm<'s, F, Fut>(subject: &'s Subject, what: &str, body: F) -> Checked
where
    F: FnOnce(VmSpec) -> Fut,
    Fut: std::future::Future<Output = Checked> + 's,
{
    let spec = (subject.new_spec)(what);
    let id = spec.id.clone();
    let outcome = body(spec).await;
    remove(subject, &id).await;
    outcome
}

async fn inventory(subject: &Subject) -> Checked {
    for host in &subject.hosts {
        host.ping().await.map_err(failed("ping"))?;
        let info = host.host_info().await.map_err(failed("host_info"))?;
        if info.cpus == 0 || info.memory_bytes < 64 * MIB {
            return Err(format!("host_info reports no capacity: {} CPUs, {} bytes", info.cpus, info.memory_bytes));
        }
        host.list().await.map_err(failed("list"))?;
    }
    Ok(Outcome::Passed(None))
}

async fn idempotent_define(subject: &Subject) -> Checked {
    with_vm(subject, "define", |spec| async move {
        let host = home(subject);
        let first = host.ensure_defined(&spec).await.map_err(failed("first ensure_defined"))?;
        let second = host.ensure_defined(&spec).await.map_err(failed("second ensure_defined"))?;
        if first.backend_id != second.backend_id || first.id != spec.id {
            return Err(format!("two defines gave {} and {}", first.backend_id, second.backend_id));
        }
        // As after a crash between the back end's create and vmlet's record:
        // a new connection defines again and must find the same VM.
        let mut note = None;
        match &subject.reconnect {
            Some(reconnect) => {
                let reopened = reconnect().await;
                let third =
                    reopened[0].ensure_defined(&spec).await.map_err(failed("ensure_defined after reconnect"))?;
                if third.backend_id != first.backend_id {
                    let (a, b) = (third.backend_id, first.backend_id);
                    return Err(format!("a define after reconnecting made {a} beside {b}"));
                }
            }
            None => note = Some("not across connections: the back end keeps no state across them".to_owned()),
        }
        let listed = host.list().await.map_err(failed("list"))?;
        let copies = listed.iter().filter(|s| s.id == spec.id).count();
        if copies != 1 {
            return Err(format!("list shows the VM {copies} times"));
        }
        if first.cpus != spec.cpus || first.memory_bytes < spec.memory_bytes {
            let (cpus, bytes) = (first.cpus, first.memory_bytes);
            return Err(format!(
                "defined with {cpus} vCPUs, {bytes} bytes; asked {} and {}",
                spec.cpus, spec.memory_bytes
            ));
        }
        Ok(Outcome::Passed(note))
    })
    .await
}

async fn start_and_hard_stop(subject: &Subject) -> Checked {
    with_vm(subject, "power", |spec| async move {
        let host = home(subject).as_ref();
        let first = started(subject, host, &spec).await?;
        host.start(&spec.id).await.map_err(failed("start of a running VM"))?;
        host.destroy(&spec.id).await.map_err(failed("destroy"))?;
        off(subject, host, &spec.id).await?;
        host.destroy(&spec.id).await.map_err(failed("destroy of an inactive VM"))?;
        let again = started(subject, host, &spec).await?;
        if again.backend_id != first.backend_id {
            return Err(format!("a restart changed the backend id from {} to {}", first.backend_id, again.backend_id));
        }
        Ok(Outcome::Passed(None))
    })
    .await
}

async fn soft_stop(subject: &Subject) -> Checked {
    with_vm(subject, "soft-stop", |spec| async move {
        let host = home(subject).as_ref();
        started(subject, host, &spec).await?;
        // A guest that is still booting misses the request (an ACPI event
        // before its handler runs is lost), so it is repeated, as a user
        // presses the button again; the back end must take that.
        let deadline = Instant::now() + subject.deadline;
        let off = loop {
            match host.shutdown(&spec.id).await {
                Err(e) if e.kind == ErrorKind::Unsupported && !subject.declared.soft_stop => {
                    return Ok(Outcome::Unsupported(e.message))
                }
                other => other.map_err(failed("shutdown"))?,
            }
            let until = (Instant::now() + RESEND).min(deadline);
            let status = loop {
                let status = host.get(&spec.id).await.map_err(failed("get"))?;
                if status.as_ref().is_none_or(|s| !s.power.is_active()) || Instant::now() >= until {
                    break status;
                }
                sleep(POLL).await;
            };
            if status.as_ref().is_none_or(|s| !s.power.is_active()) {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
        };
        match (off, subject.declared.soft_stop) {
            (true, true) => Ok(Outcome::Passed(None)),
            (true, false) => Err("declared unsupported, yet the guest powered off".into()),
            (false, false) => Ok(Outcome::Unsupported("the guest ignores the shutdown request".into())),
            (false, true) => Err(format!(
                "still running {:?} after shutdown requests{}",
                subject.deadline,
                console_tail(subject, &spec.id).await
            )),
        }
    })
    .await
}

/// The end of the VM's console output, for a failure message (empty when
/// the provider has no console).
async fn console_tail(subject: &Subject, id: &VmId) -> String {
    let Some(console) = home(subject).console() else { return String::new() };
    match console.console_output(id, 0, 1 << 20).await {
        Ok(chunk) => {
            let text = String::from_utf8_lossy(&chunk.data);
            let tail: String = text.chars().rev().take(600).collect::<Vec<_>>().into_iter().rev().collect();
            format!("; console ends:\n{tail}")
        }
        Err(e) => format!("; console unreadable: {e}"),
    }
}

async fn adopt_after_restart(subject: &Subject) -> Checked {
    let Some(reconnect) = &subject.reconnect else {
        return Ok(Outcome::Unsupported("the back end keeps no state across connections".into()));
    };
    with_vm(subject, "adopt", |spec| async move {
        let before = started(subject, home(subject).as_ref(), &spec).await?;
        let reopened = reconnect().await;
        let listed = reopened[0].list().await.map_err(failed("list after reconnect"))?;
        let found: Vec<&VmStatus> = listed.iter().filter(|s| s.id == spec.id).collect();
        match found.as_slice() {
            [one] if one.backend_id == before.backend_id && one.power == PowerState::Running => {
                Ok(Outcome::Passed(None))
            }
            other => Err(format!("after a reconnect the VM was listed as {other:?}")),
        }
    })
    .await
}

async fn locate(subject: &Subject) -> Checked {
    let Some(other) = subject.hosts.get(1) else { return Err("the subject has one host; locate needs two".into()) };
    with_vm(subject, "locate", |spec| async move {
        let status = home(subject).ensure_defined(&spec).await.map_err(failed("ensure_defined"))?;
        match home(subject).locate(&spec.id, &spec.backend_name()).await.map_err(failed("locate here"))? {
            vmlet_provider::Location::ThisHost(s) if s.backend_id == status.backend_id => {}
            other => return Err(format!("its own host answered {other:?}")),
        }
        let answer = other.locate(&spec.id, &spec.backend_name()).await.map_err(failed("locate elsewhere"))?;
        let unknown = (subject.new_spec)("nowhere");
        let nowhere = other.locate(&unknown.id, &unknown.backend_name()).await.map_err(failed("locate unknown"))?;
        match (answer, nowhere, subject.declared.sees_whole_backend) {
            (Location::OtherHost(host), Location::Nowhere, true) if Some(&host) == home(subject).backend_host().as_ref() => {
                Ok(Outcome::Passed(Some("whole back end: OtherHost / Nowhere".into())))
            }
            (Location::NotOnThisHost, Location::NotOnThisHost, false) => {
                Ok(Outcome::Passed(Some("own host only: NotOnThisHost".into())))
            }
            (answer, nowhere, declared) => Err(format!(
                "another host answered {answer:?} (and {nowhere:?} for an unknown VM), declared whole back end: {declared}"
            )),
        }
    })
    .await
}

async fn resize(subject: &Subject, scope: ResizeScope) -> Checked {
    let declared = match scope {
        ResizeScope::Live => subject.declared.resize_live,
        ResizeScope::NextStart => subject.declared.resize_next_start,
    };
    let Some(resizer) = home(subject).resize() else {
        return if declared {
            Err("declared, but the provider has no Resize".into())
        } else {
            Ok(unsupported_none("Resize"))
        };
    };
    with_vm(subject, "resize", |spec| async move {
        let host = home(subject).as_ref();
        let bigger = Resources { cpus: spec.cpus + 1, memory_bytes: spec.memory_bytes * 2 };
        let ceilings = Resources {
            cpus: spec.max_cpus.unwrap_or(spec.cpus).max(bigger.cpus),
            memory_bytes: spec.max_memory_bytes.unwrap_or(spec.memory_bytes).max(bigger.memory_bytes),
        };
        match scope {
            ResizeScope::Live => started(subject, host, &spec).await?,
            ResizeScope::NextStart => host.ensure_defined(&spec).await.map_err(failed("ensure_defined"))?,
        };
        match resizer.resize(&spec.id, bigger, ceilings, scope).await {
            Err(e) if e.kind == ErrorKind::Unsupported && !declared => return Ok(Outcome::Unsupported(e.message)),
            Err(e) => return Err(failed("resize")(e)),
            Ok(()) if !declared => return Err("declared unsupported, yet the resize succeeded".into()),
            Ok(()) => {}
        }
        // Idempotent: the same size again is no change and no error.
        resizer.resize(&spec.id, bigger, ceilings, scope).await.map_err(failed("the same resize again"))?;
        let status = match scope {
            ResizeScope::Live => {
                wait_for(subject, host, &spec.id, "resized", |s| {
                    s.cpus == bigger.cpus && s.memory_bytes >= bigger.memory_bytes
                })
                .await?
            }
            ResizeScope::NextStart => {
                let now = host.get(&spec.id).await.map_err(failed("get"))?.ok_or("the VM is gone")?;
                let next = now.next_start.unwrap_or(Resources { cpus: now.cpus, memory_bytes: now.memory_bytes });
                if next.cpus != bigger.cpus || next.memory_bytes < bigger.memory_bytes {
                    return Err(format!("after a next-start resize the VM reports {now:?}"));
                }
                host.start(&spec.id).await.map_err(failed("start after resize"))?;
                running(subject, host, &spec.id).await?
            }
        };
        if status.cpus != bigger.cpus {
            return Err(format!("asked {} vCPUs, the VM has {}", bigger.cpus, status.cpus));
        }
        Ok(Outcome::Passed(None))
    })
    .await
}

async fn migrate(subject: &Subject, mode: MigrationMode) -> Checked {
    let declared = match mode {
        MigrationMode::Live => subject.declared.migrate_live,
        MigrationMode::Cold => subject.declared.migrate_cold,
    };
    let Some(target_host) = subject.hosts.get(1) else {
        return if declared {
            Err("declared, but the subject has one host".into())
        } else {
            Ok(unsupported_none("a second host"))
        };
    };
    let (Some(migration), Some(target)) = (home(subject).migration(), target_host.migration()) else {
        return if declared {
            Err("declared, but the provider has no Migration".into())
        } else {
            Ok(unsupported_none("Migration"))
        };
    };
    let target = target.target();
    with_vm(subject, "migrate", |spec| async move {
        let host = home(subject).as_ref();
        let before = match mode {
            MigrationMode::Live => started(subject, host, &spec).await?,
            MigrationMode::Cold => host.ensure_defined(&spec).await.map_err(failed("ensure_defined"))?,
        };
        match migration.migrate(&spec.id, &target, mode, subject.deadline).await {
            Err(e) if e.kind == ErrorKind::Unsupported && !declared => return Ok(Outcome::Unsupported(e.message)),
            Err(e) => return Err(failed("migrate")(e)),
            Ok(()) if !declared => return Err("declared unsupported, yet the migration succeeded".into()),
            Ok(()) => {}
        }
        let there = target_host.get(&spec.id).await.map_err(failed("get on the target"))?;
        let here = host.get(&spec.id).await.map_err(failed("get on the source"))?;
        let want = match mode {
            MigrationMode::Live => PowerState::Running,
            MigrationMode::Cold => PowerState::Off,
        };
        match (there, here) {
            (Some(there), None) if there.backend_id == before.backend_id && there.power == want => {
                Ok(Outcome::Passed(None))
            }
            (there, here) => Err(format!("after the migration: target {there:?}, source {here:?}")),
        }
    })
    .await
}

async fn console_output(subject: &Subject) -> Checked {
    let declared = subject.declared.console_output;
    let Some(console) = home(subject).console() else {
        return if declared {
            Err("declared, but the provider has no Console".into())
        } else {
            Ok(unsupported_none("Console"))
        };
    };
    with_vm(subject, "console", |spec| async move {
        started(subject, home(subject).as_ref(), &spec).await?;
        let deadline = Instant::now() + subject.deadline;
        loop {
            match console.console_output(&spec.id, 0, 64 * 1024).await {
                Err(e) if e.kind == ErrorKind::Unsupported && !declared => return Ok(Outcome::Unsupported(e.message)),
                Err(e) => return Err(failed("console_output")(e)),
                Ok(_) if !declared => return Err("declared unsupported, yet console output was read".into()),
                Ok(chunk) if !chunk.data.is_empty() => {
                    if chunk.next_offset != chunk.data.len() as u64 {
                        return Err(format!("{} bytes from 0, next offset {}", chunk.data.len(), chunk.next_offset));
                    }
                    let rest = console
                        .console_output(&spec.id, chunk.next_offset, 64 * 1024)
                        .await
                        .map_err(failed("console_output from the end"))?;
                    if rest.next_offset < chunk.next_offset {
                        return Err(format!("reading on from {} went back to {}", chunk.next_offset, rest.next_offset));
                    }
                    return Ok(Outcome::Passed(None));
                }
                Ok(_) if Instant::now() >= deadline => {
                    return Err(format!("no console output within {:?}", subject.deadline))
                }
                Ok(_) => sleep(POLL).await,
            }
        }
    })
    .await
}

async fn error_kinds(subject: &Subject) -> Checked {
    let host = home(subject);
    let missing = (subject.new_spec)("missing");
    let kind_of = |r: vmlet_provider::Result<()>| r.err().map(|e| e.kind);
    if kind_of(host.start(&missing.id).await) != Some(ErrorKind::NotFound) {
        return Err("start of an unknown VM is not NotFound".into());
    }
    let mut odd = (subject.new_spec)("odd-option");
    odd.options.insert("no-such-option".into(), "x".into());
    match host.ensure_defined(&odd).await {
        Err(e) if e.kind == ErrorKind::InvalidInput && e.message.contains("spec.providerOptions.no-such-option") => {}
        Err(e) => return Err(format!("an unknown provider option gave {:?}: {}", e.kind, e.message)),
        Ok(_) => {
            remove(subject, &odd.id).await;
            return Err("an unknown provider option was accepted".into());
        }
    }
    let mut notes = Vec::new();
    match &subject.unreachable {
        Some(p) => match p.ping().await {
            Err(e) if e.kind == ErrorKind::Transient => {}
            other => return Err(format!("an unreachable back end answered ping with {:?}", other.map_err(|e| e.kind))),
        },
        None => notes.push("unreachable not set up"),
    }
    match &subject.denied {
        Some(p) => match p.list().await {
            Err(e) if e.kind == ErrorKind::PermissionDenied => {}
            other => return Err(format!("refused credentials gave {:?}", other.map(|v| v.len()).map_err(|e| e.kind))),
        },
        None => notes.push("no credentials to refuse"),
    }
    Ok(Outcome::Passed((!notes.is_empty()).then(|| notes.join("; "))))
}

async fn undefine(subject: &Subject) -> Checked {
    with_vm(subject, "undefine", |spec| async move {
        let host = home(subject).as_ref();
        started(subject, host, &spec).await?;
        match host.undefine(&spec.id).await {
            Err(e) if e.kind == ErrorKind::InvalidInput => {}
            other => return Err(format!("undefine of a running VM gave {:?}", other.map_err(|e| e.kind))),
        }
        host.destroy(&spec.id).await.map_err(failed("destroy"))?;
        off(subject, host, &spec.id).await?;
        host.undefine(&spec.id).await.map_err(failed("undefine"))?;
        let deadline = Instant::now() + subject.deadline;
        while host.get(&spec.id).await.map_err(failed("get"))?.is_some() {
            if Instant::now() >= deadline {
                return Err("still there after undefine".into());
            }
            sleep(POLL).await;
        }
        host.undefine(&spec.id).await.map_err(failed("undefine of a missing VM"))?;
        Ok(Outcome::Passed(None))
    })
    .await
}

fn unsupported_none(what: &str) -> Outcome {
    Outcome::Unsupported(format!("the provider declares no {what}"))
}
