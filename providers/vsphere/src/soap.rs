//! vim25 SOAP 1.1 envelopes: requests written as text, responses read into
//! an [`Element`] tree, faults into [`Fault`].
//!
//! Follows the vSphere Web Services API (vim25): every method is a body
//! element `<Method xmlns="urn:vim25">` whose first child `_this` is the
//! managed object the method is called on; a fault is a SOAP `Fault` whose
//! `detail` holds one element typed (`xsi:type`) with the vim25 fault type.

use std::fmt;

use crate::xml::{escape, Element};

/// A managed object reference: the object's vim25 type and its identifier
/// in this vCenter (e.g. `HostSystem` `host-21`). Stable for the object's
/// life; not comparable across vCenters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MoRef {
    /// vim25 managed object type, e.g. `HostSystem`, `VirtualMachine`.
    pub kind: String,
    /// The identifier, e.g. `host-21`, `vm-71`.
    pub value: String,
}

impl MoRef {
    /// A reference to `value` of type `kind`.
    pub fn new(kind: impl Into<String>, value: impl Into<String>) -> MoRef {
        MoRef { kind: kind.into(), value: value.into() }
    }

    /// The reference held by an element such as `<obj type="Folder">group-d1</obj>`.
    pub(crate) fn from_element(element: &Element) -> Option<MoRef> {
        Some(MoRef::new(element.attr("type")?, element.text.trim()))
    }

    /// The reference as the element `<name type="kind">value</name>`.
    pub(crate) fn to_xml(&self, name: &str) -> String {
        format!(r#"<{name} type="{}">{}</{name}>"#, escape(&self.kind), escape(&self.value))
    }
}

impl fmt::Display for MoRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind, self.value)
    }
}

/// A vim25 fault: its type (e.g. `InvalidLogin`) and vSphere's message
/// (empty when the server gave none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fault {
    pub kind: String,
    pub message: String,
}

/// The request envelope around one method element.
pub(crate) fn envelope(method: &str) -> String {
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?><soapenv:Envelope xmlns:soapenv="http://schemas.xmlsoap.org/soap/envelope/" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xmlns:xsd="http://www.w3.org/2001/XMLSchema"><soapenv:Body>{method}</soapenv:Body></soapenv:Envelope>"#
    )
}

/// The method element `<name xmlns="urn:vim25">_this args</name>`.
pub(crate) fn method(name: &str, this: &MoRef, args: &str) -> String {
    format!(r#"<{name} xmlns="urn:vim25">{}{args}</{name}>"#, this.to_xml("_this"))
}

/// The body's response element (`<MethodResponse>`), or the fault, or why
/// the document is not a vim25 response.
pub(crate) fn parse_response(bytes: &[u8]) -> Result<Result<Element, Fault>, String> {
    let envelope = Element::parse(bytes)?;
    let body = envelope.child("Body").ok_or("no SOAP Body")?;
    let first = body.children.first().ok_or("an empty SOAP Body")?;
    if first.name != "Fault" {
        return Ok(Ok(first.clone()));
    }
    let message = first.child_text("faultstring").unwrap_or_default().trim().to_owned();
    let detail = first.child("detail").and_then(|d| d.children.first());
    let kind = detail.map(fault_type).unwrap_or_else(|| first.child_text("faultcode").unwrap_or("").to_owned());
    Ok(Err(Fault { kind, message }))
}

/// The vim25 type of a fault element: its `xsi:type`, or its name without
/// the `Fault` suffix that `detail` children carry (`InvalidLoginFault`).
pub(crate) fn fault_type(element: &Element) -> String {
    element.xsi_type().map(str::to_owned).unwrap_or_else(|| element.name.trim_end_matches("Fault").to_owned())
}

/// The message of a fault of type `kind` that a `RetrievePropertiesEx`
/// answer carries for a property instead of its value
/// (`returnval/objects/missingSet/fault`), as the simulator reports a call
/// without a session.
pub(crate) fn embedded_fault(response: &Element, kind: &str) -> Option<String> {
    let returnval = response.child("returnval")?;
    returnval
        .children_named("objects")
        .flat_map(|objects| objects.children_named("missingSet"))
        .filter_map(|missing| missing.child("fault")?.child("fault"))
        .find(|fault| fault_type(fault) == kind)
        .map(|fault| fault.child_text("privilegeId").map(|p| format!("needs a session ({p})")).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_method_names_its_object_and_escapes_its_arguments() {
        let call = method("Login", &MoRef::new("SessionManager", "SessionManager"), "<userName>a&amp;b</userName>");
        assert_eq!(
            call,
            r#"<Login xmlns="urn:vim25"><_this type="SessionManager">SessionManager</_this><userName>a&amp;b</userName></Login>"#
        );
        assert!(envelope(&call).contains("<soapenv:Body><Login"));
    }

    #[test]
    fn the_recorded_invalid_login_is_a_fault_with_its_type_and_message() {
        let fault = parse_response(include_bytes!("../tests/fixtures/invalid_login.xml")).unwrap().unwrap_err();
        assert_eq!(fault, Fault { kind: "InvalidLogin".into(), message: "Login failure".into() });
    }

    #[test]
    fn a_fault_without_xsi_type_is_named_by_its_element() {
        let doc = br#"<Envelope><Body><Fault><faultcode>ServerFaultCode</faultcode><faultstring>gone</faultstring><detail><ManagedObjectNotFoundFault xmlns="urn:vim25"/></detail></Fault></Body></Envelope>"#;
        assert_eq!(parse_response(doc).unwrap().unwrap_err().kind, "ManagedObjectNotFound");
    }

    #[test]
    fn html_from_a_proxy_is_not_a_response() {
        assert!(parse_response(b"<html><body>502 Bad Gateway</body></html>").is_err());
    }
}
