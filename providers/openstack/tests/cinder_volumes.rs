//! The OpenStack provider's volumes against the harness's real Cinder API
//! (`hack/nova.sh up`: cinder-api, cinder-scheduler and cinder-volume with
//! Cinder's own fake volume driver) and real Nova, which attaches them
//! through Cinder's attachment API: made once, found by name only with
//! vmlet's mark, attached at define and to a server that exists, grown
//! while attached, refused while attached, deleted after the server.

mod common;
use common::{cinder_behind_vmlet, harness, remove, remove_leftovers, wait_for};

use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use vmlet_provider::{DataDisk, DiskFormat, ErrorKind, Provider, VolumeRequest, VolumeSource};

const GIB: u64 = 1 << 30;
const POOL: &str = "__DEFAULT__";

fn request(name: &str, capacity_bytes: u64) -> VolumeRequest {
    VolumeRequest {
        pool: POOL.into(),
        name: name.into(),
        capacity_bytes,
        format: DiskFormat::Raw,
        source: VolumeSource::Empty,
    }
}

fn disk(name: &str, path: &str) -> DataDisk {
    DataDisk {
        name: name.into(),
        path: path.into(),
        format: DiskFormat::Raw,
        create_bytes: None,
        backing_chain: Vec::new(),
    }
}

/// Cinder's view of volume `id`.
async fn cinder_volume(id: &str) -> Value {
    let (status, body) = cinder_behind_vmlet(Method::GET, &format!("/volumes/{id}"), None).await;
    assert_eq!(status, 200, "GET /volumes/{id}: {body}");
    body["volume"].clone()
}

/// Wait until Cinder says volume `id` is `status`, attached to `server`
/// (or to nothing when `None`).
async fn wait_volume(id: &str, status: &str, server: Option<&str>) -> Value {
    wait_for(&format!("volume {id} {status} on {server:?}"), Duration::from_secs(120), || async {
        let v = cinder_volume(id).await;
        let attached: Vec<&str> =
            v["attachments"].as_array().into_iter().flatten().filter_map(|a| a["server_id"].as_str()).collect();
        let wanted: Vec<&str> = server.into_iter().collect();
        if v["status"] == status && attached == wanted {
            Ok(v)
        } else {
            Err(format!("{} attached to {attached:?}", v["status"]))
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_is_made_once_attached_grown_in_use_and_deleted_only_after_its_server() {
    let Some(h) = harness("a_volume_is_made_once_attached_grown_in_use_and_deleted_only_after_its_server") else {
        return;
    };
    const NS: &str = "vmlet-os-cinder";
    let cloud = h.cloud().await;
    let providers = h.providers(&cloud);
    remove_leftovers(&providers, NS).await;
    let a = &providers[0];
    let volumes = a.volumes().expect("the OpenStack provider has volumes");
    let spec = h.spec(NS, "disks");
    let name = format!("{NS}_data_{}", spec.id);

    // Refusals, before anything is made.
    let qcow2 = VolumeRequest { format: DiskFormat::Qcow2, ..request(&name, GIB) };
    let err = volumes.create_volume(&qcow2).await.expect_err("qcow2");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("parameters.format qcow2"), "{err}");
    let err = volumes.create_volume(&VolumeRequest { pool: "gold".into(), ..request(&name, GIB) }).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(err.message.contains("no volume type") && err.message.contains(POOL), "{err}");
    assert_eq!(volumes.volume(POOL, &name).await.expect("read"), None, "nothing was made");

    // Made once, in whole GiB; the second call finds it.
    let made = volumes.create_volume(&request(&name, GIB + GIB / 2)).await.expect("create");
    assert_eq!((made.pool.as_str(), made.name.as_str(), made.capacity_bytes), (POOL, name.as_str(), 2 * GIB));
    assert_eq!(made.format, Some(DiskFormat::Raw));
    let again = volumes.create_volume(&request(&name, GIB)).await.expect("create again");
    assert_eq!(again.path, made.path, "the same Cinder volume");
    let v = cinder_volume(&made.path).await;
    assert_eq!(
        (v["status"].as_str(), v["size"].as_u64(), v["name"].as_str()),
        (Some("available"), Some(2), Some(&*name))
    );
    assert_eq!(v["metadata"]["vmlet.io.volume"], json!(name));
    assert_eq!(volumes.volume(POOL, &name).await.expect("read").map(|v| v.path), Some(made.path.clone()));
    assert_eq!(volumes.volume("gold", &name).await.expect("read"), None, "another pool");

    // A tenant's volume of the same shape of name, without vmlet's mark:
    // never found, never deleted, never attached.
    let foreign_name = format!("{NS}_foreign_{}", spec.id);
    let (status, body) =
        cinder_behind_vmlet(Method::POST, "/volumes", Some(json!({"volume": {"name": foreign_name, "size": 1}}))).await;
    assert_eq!(status, 202, "{body}");
    let foreign = body["volume"]["id"].as_str().expect("id").to_owned();
    wait_volume(&foreign, "available", None).await;
    assert_eq!(volumes.volume(POOL, &foreign_name).await.expect("read"), None);
    volumes.delete_volume(POOL, &foreign_name).await.expect("nothing of vmlet's to delete");
    assert_eq!(cinder_volume(&foreign).await["status"], "available", "the tenant's volume is untouched");
    let mut stolen = spec.clone();
    stolen.disks = vec![disk("data", &foreign)];
    let err = a.ensure_defined(&stolen).await.expect_err("a volume vmlet did not make");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("spec.disks[data]") && err.message.contains("not made by vmlet"), "{err}");
    let mut host_file = spec.clone();
    host_file.disks = vec![disk("data", "/var/lib/vmlet/images/data.img")];
    let err = a.ensure_defined(&host_file).await.expect_err("a host file");
    assert!(err.message.contains("spec.disks[data]") && err.message.contains("openstack.vmlet.io"), "{err}");
    assert_eq!(a.get(&spec.id).await.expect("get"), None, "no server was created for a refused disk");

    // Attached at define (block_device_mapping_v2).
    let mut with_disk = spec.clone();
    with_disk.disks = vec![disk("data", &made.path)];
    let server = common::define(a, &with_disk).await;
    wait_volume(&made.path, "in-use", Some(&server.backend_id)).await;
    let err = volumes.delete_volume(POOL, &name).await.expect_err("attached");
    assert_eq!(err.kind, ErrorKind::Conflict, "{err}");
    assert!(err.message.contains(&server.backend_id), "{err}");

    // Grown while attached (3.42): Cinder extends it and tells Nova.
    a.start(&spec.id).await.expect("start");
    let grown = volumes.resize_volume(POOL, &name, DiskFormat::Raw, 3 * GIB).await.expect("grow in use");
    assert_eq!(grown.capacity_bytes, 3 * GIB);
    let v = wait_volume(&made.path, "in-use", Some(&server.backend_id)).await;
    assert_eq!(v["size"], 3);
    let err = volumes.resize_volume(POOL, &name, DiskFormat::Raw, GIB).await.expect_err("shrink");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");

    // A second volume added to the server that exists: attached by the
    // next define.
    let second_name = format!("{NS}_logs_{}", spec.id);
    let second = volumes.create_volume(&request(&second_name, GIB)).await.expect("create second");
    with_disk.disks.push(disk("logs", &second.path));
    let redefined = common::define(a, &with_disk).await;
    assert_eq!(redefined.backend_id, server.backend_id, "the same server");
    wait_volume(&second.path, "in-use", Some(&server.backend_id)).await;

    // The server goes: Nova detaches both, deletes neither; then vmlet
    // deletes them.
    remove(a, &spec.id).await;
    for (volume, path) in [(&name, &made.path), (&second_name, &second.path)] {
        wait_volume(path, "available", None).await;
        volumes.delete_volume(POOL, volume).await.expect("delete");
        let (status, _) = cinder_behind_vmlet(Method::GET, &format!("/volumes/{path}"), None).await;
        assert_eq!(status, 404, "volume {volume} is gone from Cinder");
        volumes.delete_volume(POOL, volume).await.expect("delete again (idempotent)");
    }
    let (status, body) = cinder_behind_vmlet(Method::DELETE, &format!("/volumes/{foreign}"), None).await;
    assert_eq!(status, 202, "cleanup of the tenant's volume: {body}");
}
