//! Watch caches that hold each object as the JSON it was received as, and
//! decode it when it is read.
//!
//! A typed object is several times the size of its JSON: a VM's pod is about
//! 2.9 KB of JSON and held 12.5 KB as a `k8s_openapi` `Pod` (heaptrack, 2,000
//! VMs: 2.5 KB of struct, most of it fields that are `None`, plus a heap
//! allocation per string, list and map node). At 10,000 VMs the pod and
//! VirtualMachine caches were the larger part of vmlet's memory. A read costs
//! one `serde_json` decode (tens of microseconds for a pod), which the
//! controllers' passes and the kubelet API's lookups can afford; the stores
//! are read per object, never scanned in a hot loop.
//!
//! [`Compact`] is what the kube-runtime store holds: the object's name,
//! namespace, UID and resourceVersion (what the store and the controllers key
//! and trigger on) and its JSON. [`Cache`] is the read side the rest of vmlet
//! uses, as it used `Store`: it hands out decoded objects. The controllers
//! over a cache run on [`Compact`] objects ([`Cache::store`], [`compact_ref`])
//! and see decoded ones ([`decoded`], [`decoded_policy`]).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kube::Resource;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};
use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

/// An object of kind `K` as a watch cache holds it: the metadata the cache
/// keys on (name, namespace, UID, resourceVersion) and the whole object as
/// JSON.
pub struct Compact<K> {
    meta: ObjectMeta,
    json: Arc<[u8]>,
    kind: PhantomData<fn() -> K>,
}

impl<K: Resource + Serialize> Compact<K> {
    /// `object`, encoded.
    ///
    /// # Panics
    /// If `object` does not serialize, which a `k8s_openapi` type or a
    /// vmlet CRD type (plain data, string-keyed maps) cannot do.
    pub fn new(object: &K) -> Self {
        let meta = object.meta();
        Compact {
            meta: ObjectMeta {
                name: meta.name.clone(),
                namespace: meta.namespace.clone(),
                uid: meta.uid.clone(),
                resource_version: meta.resource_version.clone(),
                ..ObjectMeta::default()
            },
            json: serde_json::to_vec(object).expect("a Kubernetes object serializes to JSON").into(),
            kind: PhantomData,
        }
    }
}

impl<K: DeserializeOwned> Compact<K> {
    /// The object, decoded.
    ///
    /// # Panics
    /// If the JSON does not decode as `K`. It is what [`Compact::new`]
    /// encoded from a `K`, and the types vmlet caches read back what they
    /// write (see this module's round-trip tests).
    pub fn decode(&self) -> K {
        serde_json::from_slice(&self.json).expect("a cached object decodes as the type it was encoded from")
    }

    /// The size of the object's JSON, in bytes.
    pub fn encoded_len(&self) -> usize {
        self.json.len()
    }
}

impl<K> Clone for Compact<K> {
    fn clone(&self) -> Self {
        Compact { meta: self.meta.clone(), json: Arc::clone(&self.json), kind: PhantomData }
    }
}

impl<K> fmt::Debug for Compact<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Compact")
            .field("namespace", &self.meta.namespace)
            .field("name", &self.meta.name)
            .field("resource_version", &self.meta.resource_version)
            .field("json_bytes", &self.json.len())
            .finish()
    }
}

/// The kind, group, version and plural of `K`; the metadata is the
/// compact object's own (name, namespace, UID, resourceVersion only).
impl<K: Resource> Resource for Compact<K> {
    type DynamicType = K::DynamicType;
    type Scope = K::Scope;

    fn kind(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::version(dt)
    }

    fn plural(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

/// Decodes a `K` and compacts it (a controller's object type must
/// deserialize; vmlet's controllers never receive objects this way).
impl<'de, K: Resource + Serialize + DeserializeOwned> Deserialize<'de> for Compact<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        K::deserialize(deserializer).map(|object| Compact::new(&object))
    }
}

/// The read side of a watch cache of `K` objects held as [`Compact`]: what
/// `Store<K>` offered, with each object decoded as it is read.
pub struct Cache<K: Resource<DynamicType = ()> + 'static> {
    store: Store<Compact<K>>,
}

impl<K: Resource<DynamicType = ()> + 'static> Clone for Cache<K> {
    fn clone(&self) -> Self {
        Cache { store: self.store.clone() }
    }
}

/// A new empty cache and the writer that fills it (apply [`compact_event`]s).
pub fn cache<K: Resource<DynamicType = ()> + 'static>() -> (Cache<K>, reflector::store::Writer<Compact<K>>) {
    let (store, writer) = reflector::store();
    (Cache { store }, writer)
}

impl<K: Resource<DynamicType = ()> + DeserializeOwned + 'static> Cache<K> {
    /// The cached object `key`, decoded; `None` if it is not cached.
    pub fn get(&self, key: &ObjectRef<K>) -> Option<Arc<K>> {
        self.store.get(&compact_ref(key.clone())).map(|object| Arc::new(object.decode()))
    }

    /// Whether object `key` is cached (without decoding it).
    pub fn contains(&self, key: &ObjectRef<K>) -> bool {
        self.store.get(&compact_ref(key.clone())).is_some()
    }

    /// Every cached object, decoded.
    pub fn state(&self) -> Vec<Arc<K>> {
        self.store.state().iter().map(|object| Arc::new(object.decode())).collect()
    }

    /// The keys of every cached object (without decoding any).
    pub fn keys(&self) -> Vec<ObjectRef<K>> {
        let key = |object: &Arc<Compact<K>>| {
            let mut key = ObjectRef::new(object.meta.name.as_deref().unwrap_or_default());
            key.namespace = object.meta.namespace.clone();
            key
        };
        self.store.state().iter().map(key).collect()
    }

    /// The number of cached objects.
    pub fn len(&self) -> usize {
        self.store.len()
    }

    /// Whether the cache holds no object.
    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }

    /// The store itself, of compact objects: what a controller over this
    /// cache runs on (see [`decoded`]).
    pub fn store(&self) -> Store<Compact<K>> {
        self.store.clone()
    }
}

/// `event` with its objects compacted, as a [`Cache`]'s writer applies it.
pub fn compact_event<K: Resource + Serialize>(event: &watcher::Event<K>) -> watcher::Event<Compact<K>> {
    match event {
        watcher::Event::Apply(object) => watcher::Event::Apply(Compact::new(object)),
        watcher::Event::Delete(object) => watcher::Event::Delete(Compact::new(object)),
        watcher::Event::InitApply(object) => watcher::Event::InitApply(Compact::new(object)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// `key` as the key of the same object in a [`Cache`]'s store.
pub fn compact_ref<K>(key: ObjectRef<K>) -> ObjectRef<Compact<K>>
where
    K: Resource,
    K::DynamicType: Clone,
{
    let ObjectRef { dyntype, name, namespace, extra, .. } = key;
    let mut compact = ObjectRef::new_with(&name, dyntype);
    compact.namespace = namespace;
    compact.extra = extra;
    compact
}

/// A controller's reconcile function over `K`, as one over the compact
/// objects of a [`Cache`]'s store: each pass decodes its object first.
pub fn decoded<K, C, Fut>(reconcile: impl Fn(Arc<K>, Arc<C>) -> Fut) -> impl Fn(Arc<Compact<K>>, Arc<C>) -> Fut
where
    K: DeserializeOwned,
{
    move |object, context| reconcile(Arc::new(object.decode()), context)
}

/// A controller's error policy over `K`, as one over compact objects (see
/// [`decoded`]).
pub fn decoded_policy<K, C, E>(
    policy: impl Fn(Arc<K>, &E, Arc<C>) -> Action,
) -> impl Fn(Arc<Compact<K>>, &E, Arc<C>) -> Action
where
    K: DeserializeOwned,
{
    move |object, error, context| policy(Arc::new(object.decode()), error, context)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{PodBuilder, VmBuilder};
    use crate::v1alpha1::VirtualMachine;
    use k8s_openapi::api::core::v1::Pod;

    fn running_pod(vm: &str, node: &str) -> Pod {
        let vm = VmBuilder::new(vm).disks(&[("root", "web-root")]).cpu(2).memory("2Gi").build();
        PodBuilder::for_vm(&vm).on_node(node).running("10.0.0.7").build()
    }

    #[test]
    fn a_vm_and_its_pod_read_back_as_they_were_cached() {
        let vm = VmBuilder::new("web").disks(&[("root", "web-root")]).image("debian-12").build();
        let pod = running_pod("web", "host-a");
        let (cached_vm, cached_pod) = (Compact::new(&vm), Compact::new(&pod));
        assert_eq!(serde_json::to_value(cached_vm.decode()).unwrap(), serde_json::to_value(&vm).unwrap());
        assert_eq!(cached_pod.decode(), pod);
        assert_eq!(cached_pod.meta().name, pod.metadata.name);
        assert_eq!(cached_pod.meta().uid, pod.metadata.uid);
        assert_eq!(cached_pod.meta().labels, None, "only the key metadata is kept outside the JSON");
        assert_eq!(cached_pod.encoded_len(), serde_json::to_vec(&pod).unwrap().len());
    }

    #[test]
    fn the_cache_applies_events_and_hands_out_decoded_objects() {
        let (cache, mut writer) = cache::<Pod>();
        let a = running_pod("a", "host-a");
        let b = running_pod("b", "host-b");
        for event in [
            watcher::Event::Init,
            watcher::Event::InitApply(a.clone()),
            watcher::Event::InitApply(b.clone()),
            watcher::Event::InitDone,
        ] {
            writer.apply_watcher_event(&compact_event(&event));
        }
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&ObjectRef::from_obj(&a)).as_deref(), Some(&a));
        writer.apply_watcher_event(&compact_event(&watcher::Event::Delete(a.clone())));
        assert!(!cache.contains(&ObjectRef::from_obj(&a)));
        assert_eq!(
            cache.state().iter().map(|p| p.metadata.name.clone()).collect::<Vec<_>>(),
            vec![b.metadata.name.clone()]
        );
        let elsewhere = ObjectRef::<Pod>::new(b.metadata.name.as_deref().unwrap()).within("other");
        assert!(cache.get(&elsewhere).is_none(), "keyed by namespace too");
    }

    #[test]
    fn a_compact_key_names_the_same_object() {
        let key = ObjectRef::<VirtualMachine>::new("web").within("ns");
        let compact = compact_ref(key);
        assert_eq!((compact.name.as_str(), compact.namespace.as_deref()), ("web", Some("ns")));
    }
}
