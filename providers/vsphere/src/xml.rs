//! A small element tree read from a vim25 response with quick-xml's events.
//!
//! vim25 puts all of its types in one namespace (`urn:vim25`), so elements are
//! kept by local name. Attributes keep their prefix: a managed object
//! reference carries both `type="HostSystem"` (the referenced type) and
//! `xsi:type="ManagedObjectReference"` (the XML Schema type), under whichever
//! prefix the server bound to the schema-instance namespace.

use quick_xml::events::{BytesStart, Event};
use quick_xml::Reader;

/// One element: local name, attributes (qualified name, value), child
/// elements and the text directly inside it (entities resolved).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Element {
    pub name: String,
    pub attrs: Vec<(String, String)>,
    pub children: Vec<Element>,
    pub text: String,
}

impl Element {
    /// The document element of `bytes`, or why it is not well-formed XML.
    pub fn parse(bytes: &[u8]) -> Result<Element, String> {
        let mut reader = Reader::from_reader(bytes);
        let mut stack: Vec<Element> = Vec::new();
        loop {
            match reader.read_event().map_err(|e| format!("at byte {}: {e}", reader.buffer_position()))? {
                Event::Start(start) => stack.push(open(&start)?),
                Event::Empty(start) => {
                    let element = open(&start)?;
                    match stack.last_mut() {
                        Some(parent) => parent.children.push(element),
                        None => return Ok(element),
                    }
                }
                Event::End(_) => {
                    let element = stack.pop().ok_or("an end tag without a start tag")?;
                    match stack.last_mut() {
                        Some(parent) => parent.children.push(element),
                        None => return Ok(element),
                    }
                }
                Event::Text(text) => {
                    if let Some(current) = stack.last_mut() {
                        current.text.push_str(&text.unescape().map_err(|e| e.to_string())?);
                    }
                }
                Event::CData(data) => {
                    if let Some(current) = stack.last_mut() {
                        current.text.push_str(&String::from_utf8_lossy(&data));
                    }
                }
                Event::Eof => return Err("the document ends before its element is closed".into()),
                Event::Decl(_) | Event::PI(_) | Event::Comment(_) | Event::DocType(_) => {}
            }
        }
    }

    /// The first child named `name`.
    pub fn child(&self, name: &str) -> Option<&Element> {
        self.children.iter().find(|c| c.name == name)
    }

    /// Every child named `name`, in document order.
    pub fn children_named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Element> + 'a {
        self.children.iter().filter(move |c| c.name == name)
    }

    /// The text of the first child named `name`.
    pub fn child_text(&self, name: &str) -> Option<&str> {
        self.child(name).map(|c| c.text.as_str())
    }

    /// The value of the unprefixed attribute `name`.
    pub fn attr(&self, name: &str) -> Option<&str> {
        self.attrs.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The XML Schema type the element declares (`<prefix>:type`, any prefix),
    /// without a namespace prefix of its own: `xsd:long` → `long`.
    pub fn xsi_type(&self) -> Option<&str> {
        let (_, value) = self.attrs.iter().find(|(k, _)| k.ends_with(":type"))?;
        Some(value.rsplit(':').next().unwrap_or(value))
    }
}

fn open(start: &BytesStart<'_>) -> Result<Element, String> {
    let name = String::from_utf8_lossy(start.local_name().as_ref()).into_owned();
    let mut attrs = Vec::new();
    for attr in start.attributes() {
        let attr = attr.map_err(|e| e.to_string())?;
        let key = String::from_utf8_lossy(attr.key.as_ref()).into_owned();
        let value = attr.unescape_value().map_err(|e| e.to_string())?.into_owned();
        attrs.push((key, value));
    }
    Ok(Element { name, attrs, ..Element::default() })
}

/// `text` with `<`, `>`, `&`, `'` and `"` escaped for element content or an
/// attribute value.
pub(crate) fn escape(text: &str) -> std::borrow::Cow<'_, str> {
    quick_xml::escape::escape(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_local_names_attributes_and_resolved_text() {
        let doc = br#"<?xml version="1.0"?><a:root xmlns:a="urn:x"><val type="HostSystem" xmlns:X="http://www.w3.org/2001/XMLSchema-instance" X:type="ManagedObjectReference">host-1</val><name>config.extraConfig[&#34;k&#34;] &amp; more</name><empty/></a:root>"#;
        let root = Element::parse(doc).unwrap();
        assert_eq!(root.name, "root");
        let val = root.child("val").unwrap();
        assert_eq!(
            (val.attr("type"), val.xsi_type(), val.text.as_str()),
            (Some("HostSystem"), Some("ManagedObjectReference"), "host-1")
        );
        assert_eq!(root.child_text("name"), Some(r#"config.extraConfig["k"] & more"#));
        assert!(root.child("empty").is_some());
    }

    #[test]
    fn a_truncated_document_is_an_error() {
        assert!(Element::parse(b"<a><b>text</b>").is_err());
        assert!(Element::parse(b"not xml at all").is_err());
    }
}
