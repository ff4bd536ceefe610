//! Reading properties through the `PropertyCollector`
//! (`RetrievePropertiesEx`, then `ContinueRetrievePropertiesEx` while the
//! answer carries a `token`), following vim25's `PropertyFilterSpec`:
//! property specs (which paths of which types), object specs (where to
//! start) and traversal specs (which reference properties to follow).

use crate::session::Session;
use crate::soap::{fault_type, MoRef};
use crate::xml::{escape, Element};
use crate::Error;

/// One object of an answer: its reference, the values of the requested
/// paths it has (`val` elements) and the paths that failed, with the fault type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ObjectContent {
    pub obj: MoRef,
    pub props: Vec<(String, Element)>,
    pub missing: Vec<(String, String)>,
}

impl ObjectContent {
    fn from_element(objects: &Element) -> Option<ObjectContent> {
        let obj = MoRef::from_element(objects.child("obj")?)?;
        let props = objects
            .children_named("propSet")
            .filter_map(|p| Some((p.child_text("name")?.to_owned(), p.child("val")?.clone())))
            .collect();
        let missing = objects
            .children_named("missingSet")
            .map(|m| {
                let fault = m.child("fault").and_then(|f| f.child("fault")).map(fault_type).unwrap_or_default();
                // A missing object (not one of its paths) may come without a path.
                (m.child_text("path").unwrap_or_default().to_owned(), fault)
            })
            .collect();
        Some(ObjectContent { obj, props, missing })
    }

    /// Whether vSphere reported the object itself as deleted
    /// (`ManagedObjectNotFound` in its `missingSet`, as a read with
    /// `reportMissingObjectsInResults` does).
    pub fn is_gone(&self) -> bool {
        self.missing.iter().any(|(_, fault)| fault == "ManagedObjectNotFound")
    }

    /// The value element of `path`.
    pub fn get(&self, path: &str) -> Option<&Element> {
        self.props.iter().find(|(name, _)| name == path).map(|(_, val)| val)
    }

    /// The text of `path`'s value, trimmed.
    pub fn text(&self, path: &str) -> Option<&str> {
        self.get(path).map(|val| val.text.trim())
    }

    /// The reference that `path`'s value holds.
    pub fn moref(&self, path: &str) -> Option<MoRef> {
        self.get(path).and_then(MoRef::from_element)
    }
}

/// A property spec: `paths` of objects of type `kind`.
pub(crate) fn prop_set(kind: &str, paths: &[&str]) -> String {
    let paths: String = paths.iter().map(|p| format!("<pathSet>{}</pathSet>", escape(p))).collect();
    format!("<propSet><type>{kind}</type>{paths}</propSet>")
}

/// A named traversal spec: from objects of type `kind` follow `path`, then
/// apply the traversal specs named in `then`.
pub(crate) fn traversal(name: &str, kind: &str, path: &str, then: &[&str]) -> String {
    let then: String = then.iter().map(|n| format!("<selectSet><name>{n}</name></selectSet>")).collect();
    format!(
        r#"<selectSet xsi:type="TraversalSpec"><name>{name}</name><type>{kind}</type><path>{path}</path><skip>false</skip>{then}</selectSet>"#
    )
}

/// An object spec: start at `start` (itself selected too), then follow
/// the traversal specs `select` (none: only `start`).
pub(crate) fn object_set(start: &MoRef, select: &[String]) -> String {
    format!("<objectSet>{}<skip>false</skip>{}</objectSet>", start.to_xml("obj"), select.concat())
}

/// The traversal specs from a root folder through nested folders and each
/// datacenter's `datacenter_folder` (`hostFolder`, `vmFolder`) to the
/// objects in those folders, then into them by the traversal specs named
/// in `then` (defined by the caller).
pub(crate) fn datacenter_walk(datacenter_folder: &str, then: &[&str]) -> Vec<String> {
    let from_folder: Vec<&str> = ["folder", "datacenter"].iter().chain(then).copied().collect();
    vec![
        traversal("folder", "Folder", "childEntity", &from_folder),
        traversal("datacenter", "Datacenter", datacenter_folder, &["folder"]),
    ]
}

/// All objects that `spec_set` (the `specSet` element's content) selects.
///
/// Errors: those of [`Session`] calls.
pub(crate) async fn retrieve(session: &Session, spec_set: &str) -> Result<Vec<ObjectContent>, Error> {
    let collector = &session.service_content().property_collector;
    let args = format!("<specSet>{spec_set}</specSet><options/>");
    let mut response = session.call("RetrievePropertiesEx", collector, &args).await?;
    let mut objects = Vec::new();
    loop {
        let Some(result) = response.child("returnval") else { return Ok(objects) };
        objects.extend(result.children_named("objects").filter_map(ObjectContent::from_element));
        let Some(token) = result.child_text("token") else { return Ok(objects) };
        let args = format!("<token>{}</token>", escape(token));
        response = session.call("ContinueRetrievePropertiesEx", collector, &args).await?;
    }
}

/// The objects of one answer (recorded envelopes in unit tests).
#[cfg(test)]
pub(crate) fn objects_of(response: &Element) -> Vec<ObjectContent> {
    response
        .child("returnval")
        .map(|r| r.children_named("objects").filter_map(ObjectContent::from_element).collect())
        .unwrap_or_default()
}
