//! The session and the host inventory against the real vSphere API server
//! of `hack/vsphere.sh` (see tests/common).

mod common;

use vmlet_provider::ErrorKind;
use vmlet_vsphere::{list_hosts, ConnectionState, Error, Secret, Session, SessionConfig, Thumbprint, Trust};

/// What the simulator models for every host (`simulator/esx`'s
/// `HostHardwareInfo` in govmomi v0.56.0): 2 cores, 4,294,430,720 bytes.
const VCSIM_HOST_CORES: u32 = 2;
const VCSIM_HOST_MEMORY_BYTES: u64 = 4_294_430_720;

#[tokio::test]
async fn the_simulator_has_a_cluster_of_three_hosts_and_a_standalone_one() {
    let Some(harness) = common::harness("the_simulator_has_a_cluster_of_three_hosts_and_a_standalone_one") else {
        return;
    };
    let session = Session::connect(harness.config()).await.expect("connect");
    assert_eq!(session.service_content().api_type, "VirtualCenter");
    let hosts = list_hosts(&session).await.expect("list hosts");
    let placed: Vec<(&str, Option<&str>, &str)> =
        hosts.iter().map(|h| (h.name.as_str(), h.cluster.as_deref(), h.datacenter.as_str())).collect();
    assert_eq!(
        placed,
        [
            ("DC0_C0_H0", Some("DC0_C0"), "DC0"),
            ("DC0_C0_H1", Some("DC0_C0"), "DC0"),
            ("DC0_C0_H2", Some("DC0_C0"), "DC0"),
            ("DC0_H0", None, "DC0"),
        ]
    );
    for host in &hosts {
        assert_eq!(host.moref.kind, "HostSystem", "{host:?}");
        assert!(host.moref.value.starts_with("host-"), "{host:?}");
        assert_eq!(host.cpu_cores, Some(VCSIM_HOST_CORES), "{host:?}");
        assert_eq!(host.memory_bytes, Some(VCSIM_HOST_MEMORY_BYTES), "{host:?}");
        assert_eq!(host.connection_state, ConnectionState::Connected, "{host:?}");
        assert!(!host.in_maintenance_mode, "{host:?}");
    }
    session.logout().await.expect("logout");
}

#[tokio::test]
async fn a_ca_file_is_trusted_as_well_as_a_thumbprint() {
    let Some(harness) = common::harness("a_ca_file_is_trusted_as_well_as_a_thumbprint") else { return };
    let config = SessionConfig { trust: Trust::CaFile(harness.ca_file.clone()), ..harness.config() };
    let session = Session::connect(config).await.expect("connect with the CA file");
    assert_eq!(list_hosts(&session).await.expect("list hosts").len(), 4);
}

#[tokio::test]
async fn a_wrong_password_is_an_invalid_login_and_permission_denied() {
    let Some(harness) = common::harness("a_wrong_password_is_an_invalid_login_and_permission_denied") else { return };
    let config = SessionConfig { password: Secret::new("not-the-password"), ..harness.config() };
    let error = Session::connect(config).await.expect_err("a wrong password logs in");
    assert_eq!(error.fault(), Some("InvalidLogin"), "{error}");
    assert_eq!(error.kind(), ErrorKind::PermissionDenied, "{error}");
    assert!(!error.to_string().contains("not-the-password"), "{error}");
}

#[tokio::test]
async fn a_wrong_thumbprint_is_refused_in_the_handshake_naming_the_field() {
    let Some(harness) = common::harness("a_wrong_thumbprint_is_refused_in_the_handshake_naming_the_field") else {
        return;
    };
    let wrong = Thumbprint([0xAB; 32]);
    let config = SessionConfig { trust: Trust::Thumbprint(wrong), ..harness.config() };
    let error = Session::connect(config).await.expect_err("a wrong thumbprint connects");
    match &error {
        Error::ThumbprintMismatch { expected, actual, .. } => {
            assert_eq!(expected, &wrong.to_string());
            assert_eq!(actual, &harness.thumbprint.to_string(), "the server's own thumbprint is named");
        }
        other => panic!("want ThumbprintMismatch, got {other:?}"),
    }
    assert!(error.to_string().contains("`thumbprint`"), "{error}");
}

#[tokio::test]
async fn a_call_after_the_session_ended_logs_in_again() {
    let Some(harness) = common::harness("a_call_after_the_session_ended_logs_in_again") else { return };
    let session = Session::connect(harness.config()).await.expect("connect");
    session.logout().await.expect("logout");
    assert_eq!(list_hosts(&session).await.expect("list hosts after logout").len(), 4);
}

#[tokio::test]
async fn plain_http_is_refused_before_connecting() {
    let Some(harness) = common::harness("plain_http_is_refused_before_connecting") else { return };
    let config = SessionConfig { url: harness.url.replace("https://", "http://"), ..harness.config() };
    let error = Session::connect(config).await.expect_err("http accepted");
    assert!(matches!(error, Error::Url { .. }), "{error:?}");
}

#[tokio::test]
async fn debug_output_shows_no_password() {
    let Some(harness) = common::harness("debug_output_shows_no_password") else { return };
    let config = harness.config();
    assert!(!format!("{config:?}").contains(&harness.password));
    let session = Session::connect(config).await.expect("connect");
    let shown = format!("{session:?}");
    assert!(!shown.contains(&harness.password) && !shown.contains("vmware_soap_session"), "{shown}");
}
