//! The provider conformance suite: backend-neutral cases that every vmlet
//! provider runs against its real back end (libvirt's test driver, a real
//! libvirtd with QEMU guests, the real Nova API), so that the core can rely
//! on one contract ([`vmlet_provider::Provider`]) whatever the back end.
//!
//! A provider's test builds a [`Subject`] (its hosts, how to make a VM spec
//! its back end can define, how to reconnect as after a restart, and what it
//! declares it supports: [`Declared`]) and calls [`run`]. Each [`Case`] ends
//! [`Outcome::Passed`], [`Outcome::Failed`], or [`Outcome::Unsupported`]; the
//! last only where the subject declared the capability unsupported *and* the
//! provider says so itself (no capability object, or an `Unsupported`
//! error): a declared gap that works anyway, or a declared capability that
//! fails, is a failure. [`Report::matrix_row`] renders the outcomes as the
//! README's capability matrix row, so the matrix says what ran.
//!
//! Every wait has a deadline ([`Subject::deadline`]); a case never hangs.

mod cases;
mod matrix;

pub use matrix::{check_readme_row, MATRIX_HEADER};

use futures::future::BoxFuture;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use vmlet_provider::{Provider, VmSpec};

/// What a back end declares it supports; the suite checks each claim both
/// ways.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Declared {
    /// `shutdown` makes the guest power itself off (ACPI honoured, or the
    /// back end's soft stop), within the deadline.
    pub soft_stop: bool,
    /// `locate` answers for the whole back end (`OtherHost`), not only for
    /// its own host.
    pub sees_whole_backend: bool,
    /// A running VM grows its vCPUs and memory without a restart.
    pub resize_live: bool,
    /// A stopped VM's size changes for its next start.
    pub resize_next_start: bool,
    /// A running VM moves to another host without a restart.
    pub migrate_live: bool,
    /// A stopped VM moves to another host.
    pub migrate_cold: bool,
    /// The console output of a started VM can be read.
    pub console_output: bool,
}

/// Opens a subject's hosts again ([`Subject::reconnect`]).
pub type Reconnect = Box<dyn Fn() -> BoxFuture<'static, Vec<Arc<dyn Provider>>> + Send + Sync>;

/// The back end under test, as a provider test sets it up.
pub struct Subject {
    /// Shown in the matrix, e.g. `libvirt (test driver)`.
    pub name: String,
    /// Two or more hosts of one back end; the first is where VMs are made,
    /// the second the destination of migrations and the "other host" of
    /// `locate`.
    pub hosts: Vec<Arc<dyn Provider>>,
    /// A new VM spec the back end can define, with an identity unique to
    /// this run, named after the case (`what`): 1 vCPU, 256 MiB unless the
    /// back end needs more, hot-plug ceilings of 2 vCPUs and 512 MiB.
    pub new_spec: Box<dyn Fn(&str) -> VmSpec + Send + Sync>,
    /// The same hosts opened again, as a vmlet restart would (new
    /// connections, new sessions), in the same order. `None` for a back end
    /// that keeps no state across connections (libvirt's test driver): the
    /// restart cases then report it unsupported.
    pub reconnect: Option<Reconnect>,
    /// A provider of this back end that cannot reach it (a closed port):
    /// its calls must fail `Transient`.
    pub unreachable: Option<Arc<dyn Provider>>,
    /// A provider of this back end whose credentials are refused: its calls
    /// must fail `PermissionDenied`. `None` where the back end has no
    /// credentials (the case is reported as not applicable).
    pub denied: Option<Arc<dyn Provider>>,
    /// What the back end supports.
    pub declared: Declared,
    /// The longest any one wait may take (a boot, a shutdown, a migration).
    pub deadline: Duration,
}

/// One conformance case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Case {
    /// `ping`, `host_info` (capacity above zero), `list`.
    Inventory,
    /// `ensure_defined` twice (and again after a reconnect) gives one VM
    /// with one backend id; `list` shows it once.
    IdempotentDefine,
    /// `start` (twice), `destroy` (twice), `start` again: the same VM.
    StartAndHardStop,
    /// `shutdown` makes the guest power off.
    SoftStop,
    /// After a reconnect the running VM is listed once and still runs.
    AdoptAfterRestart,
    /// `locate` from another host of the back end.
    Locate,
    /// Live resize within the ceilings.
    ResizeLive,
    /// Resize of a stopped VM for its next start.
    ResizeNextStart,
    /// Live migration to the second host.
    MigrateLive,
    /// Cold migration to the second host.
    MigrateCold,
    /// Console output of a running VM.
    ConsoleOutput,
    /// `NotFound`, `InvalidInput` (an unknown provider option, named),
    /// `Transient` (unreachable), `PermissionDenied` (refused credentials).
    ErrorKinds,
    /// `undefine` refuses an active VM, removes an inactive one, and
    /// succeeds on a missing one.
    Undefine,
}

impl Case {
    /// Every case, in matrix order.
    pub const ALL: [Case; 13] = [
        Case::Inventory,
        Case::IdempotentDefine,
        Case::StartAndHardStop,
        Case::SoftStop,
        Case::AdoptAfterRestart,
        Case::Locate,
        Case::ResizeLive,
        Case::ResizeNextStart,
        Case::MigrateLive,
        Case::MigrateCold,
        Case::ConsoleOutput,
        Case::ErrorKinds,
        Case::Undefine,
    ];

    /// The matrix column title.
    pub fn title(self) -> &'static str {
        match self {
            Case::Inventory => "inventory",
            Case::IdempotentDefine => "idempotent define",
            Case::StartAndHardStop => "start / hard stop",
            Case::SoftStop => "soft stop",
            Case::AdoptAfterRestart => "adopt after restart",
            Case::Locate => "locate",
            Case::ResizeLive => "resize live",
            Case::ResizeNextStart => "resize next start",
            Case::MigrateLive => "migrate live",
            Case::MigrateCold => "migrate cold",
            Case::ConsoleOutput => "console output",
            Case::ErrorKinds => "error kinds",
            Case::Undefine => "undefine",
        }
    }
}

/// How one case ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Everything the case checks held; the note qualifies it, if anything
    /// (e.g. `OtherHost` vs `NotOnThisHost` for locate).
    Passed(Option<String>),
    /// Declared unsupported, and the provider said so itself (the reason).
    Unsupported(String),
    /// What went wrong.
    Failed(String),
}

/// All cases' outcomes for one subject.
#[derive(Clone, Debug)]
pub struct Report {
    /// The subject's name.
    pub subject: String,
    /// In [`Case::ALL`] order.
    pub outcomes: Vec<(Case, Outcome)>,
}

impl Report {
    /// The outcome of `case`.
    pub fn outcome(&self, case: Case) -> &Outcome {
        &self.outcomes.iter().find(|(c, _)| *c == case).expect("every case runs").1
    }

    /// Panic, listing every failed case, unless none failed.
    pub fn assert_passed(&self) {
        let failed: Vec<String> = self
            .outcomes
            .iter()
            .filter_map(|(case, o)| match o {
                Outcome::Failed(why) => Some(format!("  {}: {why}", case.title())),
                _ => None,
            })
            .collect();
        assert!(failed.is_empty(), "{} fails the provider conformance suite:\n{}", self.subject, failed.join("\n"));
    }

    /// The README matrix row: `| name | yes | no | ... |`.
    pub fn matrix_row(&self) -> String {
        matrix::row(self)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "conformance of {}:", self.subject)?;
        for (case, outcome) in &self.outcomes {
            match outcome {
                Outcome::Passed(None) => writeln!(f, "  {:<20} passed", case.title())?,
                Outcome::Passed(Some(note)) => writeln!(f, "  {:<20} passed ({note})", case.title())?,
                Outcome::Unsupported(why) => writeln!(f, "  {:<20} unsupported: {why}", case.title())?,
                Outcome::Failed(why) => writeln!(f, "  {:<20} FAILED: {why}", case.title())?,
            }
        }
        Ok(())
    }
}

/// Run every case against `subject`, one after another (each with VMs of
/// its own, removed at its end where the case got that far), each bounded
/// by the subject's deadline.
pub async fn run(subject: &Subject) -> Report {
    let mut outcomes = Vec::new();
    for case in Case::ALL {
        let outcome = match tokio::time::timeout(subject.deadline * 4, cases::run(subject, case)).await {
            Ok(outcome) => outcome,
            Err(_) => Outcome::Failed(format!("did not finish within {:?}", subject.deadline * 4)),
        };
        outcomes.push((case, outcome));
    }
    Report { subject: subject.name.clone(), outcomes }
}
