//! Content library items as templates: finding a VM template item
//! (`vm-template`) by its library's and its own name, deploying it onto a
//! host (vAPI REST, [`crate::rest`]), and marking the deployed VM a
//! template (vim25 `MarkAsTemplate`).
//!
//! Follows the vSphere Automation API: `content/library?~action=find`,
//! `content/library/item?~action=find`, `content/library/item/id:{id}`, and
//! `vcenter/vm-template/library-items/{id}?action=deploy` (a synchronous
//! deploy that answers with the new VM's MoRef value).

use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};

use crate::session::Session;
use crate::soap::MoRef;
use crate::Error;

/// A content library item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryItem {
    /// Its id (a UUID).
    pub id: String,
    /// Its library's name.
    pub library: String,
    /// Its name.
    pub name: String,
    /// Its type: `vm-template` for a VM template, `ovf` for an OVF package, ...
    pub kind: String,
}

/// The one id a find answered, `None` for none. Errors: [`Error::Response`]
/// saying "<count> `what`" when it answered more than one (`what`: e.g.
/// `content libraries are named "lib"`).
fn one_id(operation: &'static str, answer: &Value, what: &str) -> Result<Option<String>, Error> {
    let ids: Vec<&str> = answer.as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    match ids.as_slice() {
        [] => Ok(None),
        [id] => Ok(Some((*id).to_owned())),
        _ => {
            Err(Error::Response { operation, status: 200, reason: format!("{} {what}; rename all but one", ids.len()) })
        }
    }
}

/// The item named `item` of the content library named `library`; `None`
/// when there is no such library or item.
///
/// Errors: those of the REST calls; [`Error::Response`] when two libraries
/// (or two items of the library) have the name.
pub async fn find_library_item(session: &Session, library: &str, item: &str) -> Result<Option<LibraryItem>, Error> {
    const OPERATION: &str = "find library item";
    let find = json!({"spec": {"name": library}});
    let libraries =
        session.rest(OPERATION, Method::POST, "/com/vmware/content/library?~action=find", Some(&find), None).await?;
    let Some(library_id) = one_id(OPERATION, &libraries, &format!("content libraries are named {library:?}"))? else {
        return Ok(None);
    };
    let find = json!({"spec": {"library_id": library_id, "name": item}});
    let items = session
        .rest(OPERATION, Method::POST, "/com/vmware/content/library/item?~action=find", Some(&find), None)
        .await?;
    let Some(id) = one_id(OPERATION, &items, &format!("items of library {library:?} are named {item:?}"))? else {
        return Ok(None);
    };
    let path = format!("/com/vmware/content/library/item/id:{id}");
    let info = session.rest(OPERATION, Method::GET, &path, None, None).await?;
    let kind = info.get("type").and_then(Value::as_str).unwrap_or_default().to_owned();
    Ok(Some(LibraryItem { id, library: library.to_owned(), name: item.to_owned(), kind }))
}

/// Where [`deploy_library_item`] puts the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryDeploy<'a> {
    /// The new VM's name (unique in its folder, at most 80 characters).
    pub name: &'a str,
    /// Its VM folder.
    pub folder: &'a MoRef,
    /// Its resource pool.
    pub pool: &'a MoRef,
    /// Its host.
    pub host: &'a MoRef,
    /// The datastore of its files; `None`: the library's.
    pub datastore: Option<&'a MoRef>,
}

/// Deploys the VM template item `item` as a powered-off VM where `deploy`
/// says, waiting at most `deadline`; returns the VM. The VM carries no
/// vmlet UID: callers make it a template and clone that.
///
/// Errors: those of the REST call (a 400 with vSphere's message for a
/// name already taken or a placement it refuses); [`Error::Response`] when
/// the answer names no VM.
pub async fn deploy_library_item(
    session: &Session,
    item: &LibraryItem,
    deploy: &LibraryDeploy<'_>,
    deadline: Duration,
) -> Result<MoRef, Error> {
    const OPERATION: &str = "deploy library item";
    let mut spec = json!({
        "name": deploy.name,
        "placement": {"folder": deploy.folder.value, "resource_pool": deploy.pool.value, "host": deploy.host.value},
        "powered_on": false,
    });
    if let Some(datastore) = deploy.datastore {
        spec["disk_storage"] = json!({"datastore": datastore.value});
    }
    let path = format!("/vcenter/vm-template/library-items/{}?action=deploy", item.id);
    let answer = session.rest(OPERATION, Method::POST, &path, Some(&json!({"spec": spec})), Some(deadline)).await?;
    let vm = answer.as_str().filter(|v| !v.is_empty()).ok_or_else(|| Error::Response {
        operation: OPERATION,
        status: 200,
        reason: format!("the deploy answered no VM: {answer}"),
    })?;
    Ok(MoRef::new("VirtualMachine", vm))
}

/// Marks the powered-off `vm` a template (`MarkAsTemplate`).
///
/// Errors: [`Error::Fault`] (`InvalidState`/`NotSupported` when it is one
/// already or runs).
pub async fn mark_as_template(session: &Session, vm: &MoRef) -> Result<(), Error> {
    session.call("MarkAsTemplate", vm, "").await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_find_answers_one_id_none_or_refuses_two() {
        assert_eq!(one_id("find", &json!(["a"]), "x").unwrap(), Some("a".to_owned()));
        assert_eq!(one_id("find", &json!([]), "x").unwrap(), None);
        assert_eq!(one_id("find", &Value::Null, "x").unwrap(), None);
        let two = one_id("find", &json!(["a", "b"]), "content libraries are named \"lib\"").unwrap_err();
        assert!(two.to_string().ends_with("2 content libraries are named \"lib\"; rename all but one"), "{two}");
    }
}
