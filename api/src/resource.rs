//! `kube::Resource` for our typed objects, so the registrar can
//! `kube::Api::<T>::all(client)` and watch them.

/// Implements `kube_core::Resource` for a namespaced kind: `(type, group, version, kind,
/// plural)`, the type having a `metadata: ObjectMeta` field. A sixth argument names another
/// scope: `k8s_openapi::ClusterResourceScope` for a cluster-scoped kind (GatewayClass).
macro_rules! namespaced_resource {
    ($type:ty, $group:expr, $version:expr, $kind:expr, $plural:literal) => {
        $crate::resource::namespaced_resource!(
            $type,
            $group,
            $version,
            $kind,
            $plural,
            k8s_openapi::NamespaceResourceScope
        );
    };
    ($type:ty, $group:expr, $version:expr, $kind:expr, $plural:literal, $scope:ty) => {
        impl kube_core::Resource for $type {
            type DynamicType = ();
            type Scope = $scope;

            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed($kind)
            }
            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed($group)
            }
            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed($version)
            }
            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed($plural)
            }
            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

pub(crate) use namespaced_resource;
