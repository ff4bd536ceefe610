//! Resize and migration through the OpenStack provider against the real
//! Nova API of the harness (`hack/nova.sh up`, fake computes nova-a, nova-b,
//! nova-c). Each test uses a namespace of its own and first removes what an
//! earlier run of it left there.

mod common;
use common::{count_everywhere, harness, remove, remove_leftovers, wait_power, MIB};

use std::time::Duration;

use vmlet_provider::{ErrorKind, Location, MigrationMode, PowerState, Provider, ResizeScope, Resources};

/// A migration between fake computes takes seconds; generous for a loaded host.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(180);

fn size(cpus: u32, mib: u64) -> Resources {
    Resources { cpus, memory_bytes: mib * MIB }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_is_resized_at_once_and_a_running_one_at_its_next_start() {
    let Some(h) = harness("a_stopped_server_is_resized_at_once") else { return };
    const NS: &str = "vmlet-os-resize";
    let cloud = h.cloud().await;
    let providers = h.providers(&cloud);
    remove_leftovers(&providers, NS).await;
    let a = &providers[0];
    let resize = a.resize().expect("resize capability");
    let spec = h.spec(NS, "resize");
    let defined = common::define(a, &spec).await;
    assert_eq!((defined.cpus, defined.memory_bytes), (1, 256 * MIB));

    let err = resize.resize(&spec.id, size(2, 512), size(2, 512), ResizeScope::Live).await.expect_err("live");
    assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");

    // Running: recorded for the next start.
    a.start(&spec.id).await.expect("start");
    resize.resize(&spec.id, size(2, 512), size(2, 512), ResizeScope::NextStart).await.expect("next start");
    let pending = a.get(&spec.id).await.expect("get").expect("here");
    assert_eq!((pending.cpus, pending.memory_bytes), (1, 256 * MIB), "unchanged while it runs");
    assert_eq!(pending.next_start, Some(size(2, 512)));
    assert_eq!(pending.power, PowerState::Running);
    a.destroy(&spec.id).await.expect("stop");
    a.start(&spec.id).await.expect("start applies the pending size");
    let grown = wait_power(a, &spec.id, PowerState::Running).await;
    assert_eq!((grown.cpus, grown.memory_bytes, grown.next_start), (2, 512 * MIB, None), "{grown:?}");
    assert_eq!(grown.backend_id, defined.backend_id);
    assert_eq!(a.locate(&spec.id, "").await.expect("locate"), Location::ThisHost(grown.clone()));

    // Stopped: resized at once, stays stopped, stays on this host.
    a.destroy(&spec.id).await.expect("stop");
    resize.resize(&spec.id, size(1, 1024), size(1, 1024), ResizeScope::NextStart).await.expect("resize stopped");
    let resized = a.get(&spec.id).await.expect("get").expect("still on this host");
    assert_eq!((resized.cpus, resized.memory_bytes, resized.next_start), (1, 1024 * MIB, None), "{resized:?}");
    assert_eq!(resized.power, PowerState::Off, "a stopped server stays stopped after its resize");
    assert_eq!(resized.backend_id, defined.backend_id);
    // The same size again: nothing to do.
    resize.resize(&spec.id, size(1, 1024), size(1, 1024), ResizeScope::NextStart).await.expect("no-op");
    assert_eq!(count_everywhere(&providers, &spec.id).await, 1);
    remove(a, &spec.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_server_live_migrates_and_a_stopped_one_cold_migrates_keeping_its_id() {
    let Some(h) = harness("a_running_server_live_migrates") else { return };
    const NS: &str = "vmlet-os-migrate";
    let cloud = h.cloud().await;
    let providers = h.providers(&cloud);
    remove_leftovers(&providers, NS).await;
    let (a, b) = (&providers[0], &providers[1]);
    let spec = h.spec(NS, "mover");
    let defined = common::define(a, &spec).await;
    a.start(&spec.id).await.expect("start");
    let to_b = b.migration().expect("migration").target();
    assert_eq!((to_b.host.as_str(), to_b.address.as_str()), (b.host(), b.host()));

    // Live a -> b.
    let migration = a.migration().expect("migration");
    let err = migration
        .migrate(&spec.id, &to_b, MigrationMode::Cold, MIGRATION_TIMEOUT)
        .await
        .expect_err("cold of a running one");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert_eq!(migration.progress(&spec.id).await.expect("progress"), None);
    tokio::time::timeout(
        MIGRATION_TIMEOUT + Duration::from_secs(30),
        migration.migrate(&spec.id, &to_b, MigrationMode::Live, MIGRATION_TIMEOUT),
    )
    .await
    .expect("live migration within its deadline")
    .expect("live migration");
    let on_b = b.get(&spec.id).await.expect("get on b").expect("on b now");
    assert_eq!((on_b.backend_id.as_str(), on_b.power), (defined.backend_id.as_str(), PowerState::Running));
    assert_eq!(a.get(&spec.id).await.expect("get on a"), None);
    assert_eq!(a.locate(&spec.id, "").await.expect("locate"), Location::OtherHost(b.backend_host().unwrap()));
    let err =
        migration.migrate(&spec.id, &to_b, MigrationMode::Live, MIGRATION_TIMEOUT).await.expect_err("gone from a");
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");

    // Cold b -> a.
    b.destroy(&spec.id).await.expect("stop on b");
    let to_a = a.migration().expect("migration").target();
    tokio::time::timeout(
        MIGRATION_TIMEOUT + Duration::from_secs(30),
        b.migration().expect("migration").migrate(&spec.id, &to_a, MigrationMode::Cold, MIGRATION_TIMEOUT),
    )
    .await
    .expect("cold migration within its deadline")
    .expect("cold migration");
    let back = a.get(&spec.id).await.expect("get on a").expect("on a again");
    assert_eq!((back.backend_id.as_str(), back.power), (defined.backend_id.as_str(), PowerState::Off));
    assert_eq!(b.get(&spec.id).await.expect("get on b"), None);
    assert_eq!(count_everywhere(&providers, &spec.id).await, 1);
    remove(a, &spec.id).await;
}
